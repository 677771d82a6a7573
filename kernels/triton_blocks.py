"""Triton kernels for block scales (docs/ALGORITHMS.md section 7): one RMS scale per ``B``
elements of a chunk, ``B`` a power of two from 8 to 4096 (other multiples of 8 take the torch
path). Same contracts as the ``*_blocks`` functions of :mod:`onebit.kernels.torch_kernels`.

Each program handles ``max(4096, B)`` elements in the byte-major tile of the chunk-scale
kernels (``[bytes, 8]``: loads and stores of ``x``, ``e`` and the output stay 128 bits wide
on full tiles), so it holds whole blocks and computes their norms itself (float64 sums, no
cross-program reduction). The only global step is the non-finite rule: a program that makes
a non-finite scale raises a flag; the last program of the launch (the arrival counter of
:func:`onebit.kernels.triton_kernels.ticket`) then writes NaN into every scale of the
message. So a message's scales are all finite or all NaN, and a reader checks one scale per
segment. Nothing synchronises with the host.

One file: the three stages (worker, server, decompress) of one wire format share the tile helpers
at the top and change together whenever the format does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import Layout, inverse_world
from .rounding import SERVER, WORKER, store_typed_error
from .triton_kernels import (
    _INF,
    BOTH_PATHS,
    Launch,
    _segments_finite,
    _settings,
    _store_decompressed,
    _store_packed,
    bfloat16_errors,  # noqa: F401 (this module's answer too: api.own_bfloat16 asks each implementation)
    ticket,
)

_WORKER, _SERVER = tl.constexpr(WORKER), tl.constexpr(SERVER)  # the error buffers' rounding roles

_FULL_PATH, _MASKED_PATH = tl.constexpr(1), tl.constexpr(2)


def supported(block: int) -> bool:
    """Whether the Triton kernels take this block size (a power of two, 8..4096)."""
    return 8 <= block <= 4096 and block & (block - 1) == 0


def _tile_bytes(block: int) -> int:
    return max(_settings()[0], block // 8)


@triton.jit
def _block_scales(z, NB: tl.constexpr, B: tl.constexpr):
    # RMS of each B consecutive elements of the byte-major tile z [NB, 8] (float64 sums)
    zd = z.to(tl.float64)
    sq = tl.reshape(zd * zd, (NB * 8 // B, B))
    return tl.sqrt(tl.sum(sq, axis=1) / B).to(tl.float32)


@triton.jit
def _poison(flag_ptr, ticket_ptr, words_ptr, segments, seg_words, scale_word, blocks, BLOCK: tl.constexpr):
    # every program: arrive; the last one, if any program flagged a non-finite scale, writes
    # NaN into all `segments * blocks` scale slots, then resets the flag and the counter
    tl.debug_barrier()
    arrived = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        if tl.atomic_xchg(flag_ptr, 0, sem="acq_rel") != 0:
            offs = tl.arange(0, BLOCK)
            nan = tl.zeros([BLOCK], dtype=tl.float32) + (_INF - _INF)  # no NaN global: triton_kernels
            for j in range(0, segments):
                for start in range(0, blocks, BLOCK):
                    o = (start + offs).to(tl.int64)
                    tl.store(words_ptr + j * seg_words + scale_word + o, nan, mask=o < blocks)
        tl.atomic_xchg(ticket_ptr, 0)


@triton.jit
def _worker_tile(
    x_ptr, e_ptr, msg_ptr, words_ptr, flag_ptr, pid, n, total_bytes, chunk_bytes, seg_bytes, seg_words,
    scale_word, blocks, FULL: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
):
    g = pid * NB + tl.arange(0, NB)
    i = tl.arange(0, 8)
    idx = g[:, None] * 8 + i[None, :]
    if FULL:
        z = tl.load(x_ptr + idx).to(tl.float32) + tl.load(e_ptr + idx)
    else:
        live = (g < total_bytes)[:, None]
        x = tl.load(x_ptr + idx, mask=live & (idx < n), other=0.0).to(tl.float32)
        z = x + tl.load(e_ptr + idx, mask=live, other=0.0)
    s = _block_scales(z, NB, B)
    row = pid * (NB * 8 // B) + tl.arange(0, NB * 8 // B)  # global block index
    ok = row < total_bytes * 8 // B
    slot = (row // blocks) * seg_words + scale_word + row % blocks
    tl.store(words_ptr + slot, s, mask=ok)
    bad = tl.sum(tl.where(ok & ~(tl.abs(s) < _INF), 1, 0), axis=0)
    if bad > 0:
        tl.atomic_or(flag_ptr, 1)
    _store_packed(msg_ptr, z, i, g, total_bytes, chunk_bytes, seg_bytes, FULL)


@triton.jit
def _worker_blocks_kernel(
    x_ptr, e_ptr, msg_ptr, words_ptr, flag_ptr, ticket_ptr, n, total_bytes, chunk_bytes, seg_bytes, seg_words,
    scale_word, blocks, W, NB: tl.constexpr, B: tl.constexpr, PATHS: tl.constexpr,
):
    # packed sgn(pad(x) + e) and one scale per block; any non-finite scale: all scales NaN
    pid = tl.program_id(0).to(tl.int64)
    if PATHS == _FULL_PATH:
        _worker_tile(
            x_ptr, e_ptr, msg_ptr, words_ptr, flag_ptr, pid, n, total_bytes, chunk_bytes, seg_bytes,
            seg_words, scale_word, blocks, True, NB, B,
        )
    elif PATHS == _MASKED_PATH:
        _worker_tile(
            x_ptr, e_ptr, msg_ptr, words_ptr, flag_ptr, pid, n, total_bytes, chunk_bytes, seg_bytes,
            seg_words, scale_word, blocks, False, NB, B,
        )
    elif (pid + 1) * (NB * 8) <= n:
        _worker_tile(
            x_ptr, e_ptr, msg_ptr, words_ptr, flag_ptr, pid, n, total_bytes, chunk_bytes, seg_bytes,
            seg_words, scale_word, blocks, True, NB, B,
        )
    else:
        _worker_tile(
            x_ptr, e_ptr, msg_ptr, words_ptr, flag_ptr, pid, n, total_bytes, chunk_bytes, seg_bytes,
            seg_words, scale_word, blocks, False, NB, B,
        )
    _poison(flag_ptr, ticket_ptr, words_ptr, W, seg_words, scale_word, blocks, 1024)


@triton.jit
def _byte_scale(words_ptr, g, live, chunk_bytes, seg_words, scale_word, B: tl.constexpr):
    # the scale of the block holding byte g of the whole (chunked) buffer: [NB]. Masked: in the
    # last program, bytes past the end would address a segment beyond the message (an illegal
    # access on an H100 when W does not divide the tile count, e.g. W = 5, block 64).
    j = g // chunk_bytes
    return tl.load(words_ptr + j * seg_words + scale_word + (g % chunk_bytes) * 8 // B, mask=live, other=0.0)


@triton.jit
def _worker_error_kernel(
    x_ptr, e_ptr, words_ptr, n, total_bytes, chunk_bytes, seg_words, scale_word, NB: tl.constexpr,
    B: tl.constexpr,
):
    # e <- pad(x) + e - s_b * sgn(pad(x) + e) where the block's scale s_b is finite
    pid = tl.program_id(0).to(tl.int64)
    g = pid * NB + tl.arange(0, NB)
    i = tl.arange(0, 8)
    idx = g[:, None] * 8 + i[None, :]
    live = (g < total_bytes)[:, None]
    z = tl.load(x_ptr + idx, mask=live & (idx < n), other=0.0).to(tl.float32)
    z += tl.load(e_ptr + idx, mask=live, other=0.0).to(tl.float32)
    s = _byte_scale(words_ptr, g, g < total_bytes, chunk_bytes, seg_words, scale_word, B)[:, None]
    store_typed_error(e_ptr, idx, tl.where(z < 0, z + s, z - s), s, _WORKER, live & (tl.abs(s) < _INF))


@triton.jit
def _server_sum(
    recv_ptr, recv_words_ptr, e_ptr, g, live, W, inv_w, chunk_bytes, seg_bytes, seg_words, scale_word,
    FULL: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
):
    # m = sum_r sgn_r * (s_{r,b} * (1/W)) + e over the tile's bytes g of this rank's chunk
    i = tl.arange(0, 8)
    m = tl.zeros([NB, 8], dtype=tl.float32)
    for r in range(0, W):
        if FULL:
            byte = tl.load(recv_ptr + r * seg_bytes + g).to(tl.int32)
            s = tl.load(recv_words_ptr + r * seg_words + scale_word + g * 8 // B) * inv_w
        else:
            byte = tl.load(recv_ptr + r * seg_bytes + g, mask=live, other=0).to(tl.int32)
            s = (
                tl.load(recv_words_ptr + r * seg_words + scale_word + g * 8 // B, mask=live, other=0.0)
                * inv_w
            )
        bit = (byte[:, None] >> (7 - i)[None, :]) & 1
        m += tl.where(bit == 1, s[:, None], -s[:, None])
    idx = g[:, None] * 8 + i[None, :]
    if FULL:
        m += tl.load(e_ptr + idx).to(tl.float32)
    else:
        m += tl.load(e_ptr + idx, mask=live[:, None], other=0.0).to(tl.float32)
    return m


@triton.jit
def _server_tile(
    recv_ptr, recv_words_ptr, e_ptr, out_ptr, out_words_ptr, flag_ptr, pid, chunk_bytes, seg_bytes, seg_words,
    scale_word, W, inv_w, UPDATE: tl.constexpr, FULL: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
):
    g = pid * NB + tl.arange(0, NB)
    i = tl.arange(0, 8)
    live = g < chunk_bytes
    m = _server_sum(
        recv_ptr, recv_words_ptr, e_ptr, g, live, W, inv_w, chunk_bytes, seg_bytes, seg_words, scale_word,
        FULL, NB, B,
    )
    idx = g[:, None] * 8 + i[None, :]
    if UPDATE:  # e <- m - s_b * sgn(m) where the block's output scale is finite
        s = tl.load(out_words_ptr + scale_word + g * 8 // B, mask=live, other=0.0)[:, None]
        store_typed_error(e_ptr, idx, tl.where(m < 0, m + s, m - s), s, _SERVER,
                          live[:, None] & (tl.abs(s) < _INF))
    else:
        s = _block_scales(tl.where(live[:, None], m, 0.0), NB, B)
        row = pid * (NB * 8 // B) + tl.arange(0, NB * 8 // B)
        ok = row < chunk_bytes * 8 // B
        tl.store(out_words_ptr + scale_word + row, s, mask=ok)
        if tl.sum(tl.where(ok & ~(tl.abs(s) < _INF), 1, 0), axis=0) > 0:
            tl.atomic_or(flag_ptr, 1)
        _store_packed(out_ptr, m, i, g, chunk_bytes, chunk_bytes, seg_bytes, FULL)  # one segment


@triton.jit
def _server_blocks_kernel(
    recv_ptr, recv_words_ptr, e_ptr, out_ptr, out_words_ptr, flag_ptr, ticket_ptr, chunk_bytes, seg_bytes,
    seg_words, scale_word, W, inv_w, UPDATE: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
    PATHS: tl.constexpr,
):
    # first launch: packed sgn(m) and one scale per block (a received NaN scale, or an overflow,
    # makes all of them NaN); second launch (UPDATE): m recomputed, the error updated
    pid = tl.program_id(0).to(tl.int64)
    if PATHS == _FULL_PATH:
        _server_tile(
            recv_ptr, recv_words_ptr, e_ptr, out_ptr, out_words_ptr, flag_ptr, pid, chunk_bytes, seg_bytes,
            seg_words, scale_word, W, inv_w, UPDATE, True, NB, B,
        )
    elif PATHS == _MASKED_PATH:
        _server_tile(
            recv_ptr, recv_words_ptr, e_ptr, out_ptr, out_words_ptr, flag_ptr, pid, chunk_bytes, seg_bytes,
            seg_words, scale_word, W, inv_w, UPDATE, False, NB, B,
        )
    elif (pid + 1) * NB <= chunk_bytes:
        _server_tile(
            recv_ptr, recv_words_ptr, e_ptr, out_ptr, out_words_ptr, flag_ptr, pid, chunk_bytes, seg_bytes,
            seg_words, scale_word, W, inv_w, UPDATE, True, NB, B,
        )
    else:
        _server_tile(
            recv_ptr, recv_words_ptr, e_ptr, out_ptr, out_words_ptr, flag_ptr, pid, chunk_bytes, seg_bytes,
            seg_words, scale_word, W, inv_w, UPDATE, False, NB, B,
        )
    if not UPDATE:
        _poison(flag_ptr, ticket_ptr, out_words_ptr, 1, seg_words, scale_word, chunk_bytes * 8 // B, 1024)


@triton.jit
def _decompress_tile(
    g_ptr, g_words_ptr, out_ptr, e_ptr, w_words_ptr, pid, ok, n, total_bytes, chunk_bytes, seg_bytes,
    seg_words, scale_word, HAS_ERROR: tl.constexpr, FULL: tl.constexpr, NB: tl.constexpr, B: tl.constexpr,
):
    g = pid * NB + tl.arange(0, NB)
    i = tl.arange(0, 8)
    idx = g[:, None] * 8 + i[None, :]
    j = g // chunk_bytes
    live = g < total_bytes
    if FULL:
        byte = tl.load(g_ptr + j * seg_bytes + g % chunk_bytes).to(tl.int32)
    else:
        byte = tl.load(g_ptr + j * seg_bytes + g % chunk_bytes, mask=live, other=0).to(tl.int32)
    s = tl.load(g_words_ptr + j * seg_words + scale_word + (g % chunk_bytes) * 8 // B, mask=live, other=0.0)
    bit = (byte[:, None] >> (7 - i)[None, :]) & 1
    val = tl.where(bit == 1, s[:, None], -s[:, None]).to(out_ptr.dtype.element_ty)
    in_x = live[:, None] & (idx < n)
    if HAS_ERROR:  # the worker scale of each byte's block
        sw = tl.load(
            w_words_ptr + j * seg_words + scale_word + (g % chunk_bytes) * 8 // B, mask=live, other=0.0
        )[:, None]
    else:
        sw = 0.0
    _store_decompressed(out_ptr, e_ptr, idx, live, in_x, val, sw, ok, HAS_ERROR, FULL)


@triton.jit
def _decompress_blocks_kernel(
    g_ptr, g_words_ptr, out_ptr, e_ptr, w_words_ptr, n, total_bytes, chunk_bytes, seg_bytes, seg_words,
    scale_word, W, HAS_ERROR: tl.constexpr, NB: tl.constexpr, B: tl.constexpr, GATE_BLOCK: tl.constexpr,
    PATHS: tl.constexpr,
):
    # out = s_{j,b} * sgn; with HAS_ERROR the deferred worker error update first, only if every
    # segment's scales are finite (all or none of a segment's scales are: one read per segment)
    pid = tl.program_id(0).to(tl.int64)
    ok = True
    if HAS_ERROR:
        ok = _segments_finite(g_words_ptr, W, seg_words, scale_word, GATE_BLOCK)
    if PATHS == _FULL_PATH:
        _decompress_tile(
            g_ptr, g_words_ptr, out_ptr, e_ptr, w_words_ptr, pid, ok, n, total_bytes, chunk_bytes, seg_bytes,
            seg_words, scale_word, HAS_ERROR, True, NB, B,
        )
    elif PATHS == _MASKED_PATH:
        _decompress_tile(
            g_ptr, g_words_ptr, out_ptr, e_ptr, w_words_ptr, pid, ok, n, total_bytes, chunk_bytes, seg_bytes,
            seg_words, scale_word, HAS_ERROR, False, NB, B,
        )
    elif (pid + 1) * (NB * 8) <= n:
        _decompress_tile(
            g_ptr, g_words_ptr, out_ptr, e_ptr, w_words_ptr, pid, ok, n, total_bytes, chunk_bytes, seg_bytes,
            seg_words, scale_word, HAS_ERROR, True, NB, B,
        )
    else:
        _decompress_tile(
            g_ptr, g_words_ptr, out_ptr, e_ptr, w_words_ptr, pid, ok, n, total_bytes, chunk_bytes, seg_bytes,
            seg_words, scale_word, HAS_ERROR, False, NB, B,
        )


# -- launchers (the same Launch records scripts/compile_check.py compiles ahead of time) --------
def worker_compress_launches(x, e, msg, words, flag, ticket_, n: int, layout: Layout, update_error: bool):
    nb, warps = _tile_bytes(layout.block), _settings()[1]
    total = layout.N // 8
    seg_words, scale_word = layout.segment_bytes // 4, layout.scale_offset // 4
    out = [
        Launch(
            _worker_blocks_kernel,
            triton.cdiv(total, nb),
            (
                x, e, msg, words, flag, ticket_, n, total, layout.chunk_bytes, layout.segment_bytes,
                seg_words, scale_word, layout.blocks, layout.W,
            ),
            dict(NB=nb, B=layout.block, PATHS=BOTH_PATHS),
            warps,
        )
    ]
    if update_error:
        out.append(
            Launch(
                _worker_error_kernel,
                triton.cdiv(total, nb),
                (x, e, words, n, total, layout.chunk_bytes, seg_words, scale_word),
                dict(NB=nb, B=layout.block),
                warps,
            )
        )
    return out


def server_reduce_launches(received, recv_words, e, out, out_words, flag, ticket_, layout: Layout):
    nb, warps = _tile_bytes(layout.block), _settings()[1]
    seg_words, scale_word = layout.segment_bytes // 4, layout.scale_offset // 4
    inv_w = inverse_world(layout.W)
    args = (
        received, recv_words, e, out, out_words, flag, ticket_, layout.chunk_bytes, layout.segment_bytes,
        seg_words, scale_word, layout.W, inv_w,
    )
    return [
        Launch(
            _server_blocks_kernel,
            triton.cdiv(layout.chunk_bytes, nb),
            args,
            dict(UPDATE=update, NB=nb, B=layout.block, PATHS=BOTH_PATHS),
            warps,
        )
        for update in (False, True)
    ]


def decompress_launches(
    gathered, g_words, out, worker_error, w_words, n: int, layout: Layout, has_error: bool
):
    nb, warps = _tile_bytes(layout.block), _settings()[1]
    total = layout.N // 8
    return [
        Launch(
            _decompress_blocks_kernel,
            triton.cdiv(total, nb),
            (
                gathered, g_words, out, worker_error, w_words, n, total, layout.chunk_bytes,
                layout.segment_bytes,
                layout.segment_bytes // 4,
                layout.scale_offset // 4,
                layout.W,
            ),
            dict(HAS_ERROR=has_error, NB=nb, B=layout.block, GATE_BLOCK=128, PATHS=BOTH_PATHS),
            warps,
        )
    ]


_FLAGS: dict[tuple, torch.Tensor] = {}


def flag(device: torch.device) -> torch.Tensor:
    """The non-finite flag (int32 [1], zero between launches) of the current stream on ``device``."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _FLAGS:
        _FLAGS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _FLAGS[key]


def worker_compress(x, e, layout: Layout, out, update_error: bool) -> None:
    for launch in worker_compress_launches(
        x, e, out, out.view(torch.float32), flag(e.device), ticket(e.device), x.numel(), layout, update_error
    ):
        launch()


def server_reduce(received, e, layout: Layout, out) -> None:
    for launch in server_reduce_launches(
        received,
        received.view(torch.float32),
        e,
        out,
        out.view(torch.float32),
        flag(e.device),
        ticket(e.device),
        layout,
    ):
        launch()


def decompress(gathered, layout: Layout, out, worker_error, worker_message) -> None:
    g_words = gathered.view(torch.float32)
    has_error = worker_error is not None
    e, w_words = (worker_error, worker_message.view(torch.float32)) if has_error else (out, g_words)
    for launch in decompress_launches(gathered, g_words, out, e, w_words, out.numel(), layout, has_error):
        launch()
