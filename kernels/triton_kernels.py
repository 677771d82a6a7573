"""Triton kernels for CUDA tensors (and for CPU tensors under ``TRITON_INTERPRET=1``).

Same contracts as :mod:`onebit.kernels.torch_kernels`; launched through
:mod:`onebit.kernels.api`. Nothing here synchronises with the host and nothing allocates
more than the per-block float64 partial sums of the norms (``N/4096`` values).

Norms are accumulated in float64 from per-block partials; the last program of the same launch
to finish (an arrival counter per stream, see ``ticket``) sums them in a fixed order and
writes the scale: deterministic, within half an ulp of the float64 reference in float32, and
no separate finalisation launch. Full blocks (every element below ``n``) take an unmasked
path, so their loads and stores stay 128 bits wide whatever ``n`` is; only the last block
masks (``scripts/compile_check.py`` prints the widths).

Why one file of ~475 lines: the one-scale wire format's three stages (worker, server,
decompress), each a kernel and its launcher, share the arrival counter (``ticket``) and the
tile helpers, and change together whenever the format does (block scales: triton_blocks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .layout import Layout, inverse_world
from .rounding import SERVER, WORKER, store_typed_error

# constexpr so the compiler (and the interpreter) see plain constants
_INF = tl.constexpr(float("inf"))
# No NaN global: Triton (3.6, seen on an H100) re-checks each global a kernel read at every
# launch with ==, and a NaN never equals itself ("Global variable ... has changed since we
# compiled this kernel"). Kernels write NaN as `_INF - _INF`, a constant folded at compile time.

_WORKER, _SERVER = tl.constexpr(WORKER), tl.constexpr(SERVER)  # the error buffers' rounding roles

# Which block paths a kernel contains (constexpr PATHS). Launches use BOTH_PATHS: full blocks
# unmasked, the last block masked. FULL_PATH / MASKED_PATH compile one path alone, so that
# scripts/compile_check.py can print each path's load/store widths (MASKED_PATH is what
# every block ran before the split).
BOTH_PATHS, FULL_PATH, MASKED_PATH = 0, 1, 2
_FULL_PATH, _MASKED_PATH = tl.constexpr(FULL_PATH), tl.constexpr(MASKED_PATH)


def _settings() -> tuple[int, int]:
    """(bytes of packed output per program, num_warps): 4096 elements per program."""
    return 512, 4


@triton.jit
def _pack_byte(z, i):
    # bit 7-i of each byte is set when z >= 0 (also for -0.0 and NaN)
    bit = tl.where(z < 0, 0, 1) << (7 - i)[None, :]
    return tl.sum(bit, axis=1).to(tl.uint8)


@triton.jit
def _store_packed(msg_ptr, z, i, g, total_bytes, chunk_bytes, seg_bytes, FULL: tl.constexpr):
    # the packed signs of the byte rows g of z into their chunks' segments of the message
    dst = (g // chunk_bytes) * seg_bytes + g % chunk_bytes
    if FULL:
        tl.store(msg_ptr + dst, _pack_byte(z, i))
    else:
        tl.store(msg_ptr + dst, _pack_byte(z, i), mask=g < total_bytes)


@triton.jit
def _finish_scale(
    partial_ptr, ticket_ptr, num_partials, length, words_ptr, num_slots, seg_words, scale_word,
    gate_ptr, gate_count, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr,
):
    # Called by every program after it stored its partial norm. The last program to arrive
    # (the ticket counts arrivals) sums all partials in a fixed order, writes the RMS into the
    # scale slot of every segment and resets the ticket for the next launch on this stream.
    # With a gate (the received worker scales), any non-finite gate value makes the scale NaN.
    tl.debug_barrier()  # every thread's part of this program's partial is stored
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == num_partials - 1:
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float64)
        for start in range(0, num_partials, BLOCK):  # .cg: read from L2, where the others wrote
            acc += tl.load(partial_ptr + start + offs, mask=start + offs < num_partials, other=0.0,
                           cache_modifier=".cg")
        scale = tl.sqrt(tl.sum(acc, axis=0) / length).to(tl.float32)
        if HAS_GATE:
            bad = tl.zeros([BLOCK], dtype=tl.int32)
            for start in range(0, gate_count, BLOCK):
                o = (start + offs).to(tl.int64)
                s = tl.load(gate_ptr + o * seg_words + scale_word, mask=o < gate_count, other=0.0)
                bad += tl.where(tl.abs(s) < _INF, 0, 1)
            scale = tl.where(tl.sum(bad, axis=0) > 0, _INF - _INF, scale)
        value = tl.zeros([BLOCK], dtype=tl.float32) + scale
        for start in range(0, num_slots, BLOCK):
            o = (start + offs).to(tl.int64)
            tl.store(words_ptr + o * seg_words + scale_word, value, mask=o < num_slots)
        tl.atomic_xchg(ticket_ptr, 0)


@triton.jit
def _worker_block(
    x_ptr, e_ptr, msg_ptr, partial_ptr, pid, n, total_bytes, chunk_bytes, seg_bytes,
    FULL: tl.constexpr, BLOCK_BYTES: tl.constexpr,
):
    g = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    i = tl.arange(0, 8)
    idx = g[:, None] * 8 + i[None, :]
    if FULL:  # every element of the block is < n: no masks, so loads stay 128-bit wide
        e = tl.load(e_ptr + idx).to(tl.float32)
        x = tl.load(x_ptr + idx).to(tl.float32)
    else:
        live = (g < total_bytes)[:, None]
        e = tl.load(e_ptr + idx, mask=live, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + idx, mask=live & (idx < n), other=0.0).to(tl.float32)
    z = x + e
    zd = z.to(tl.float64)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(zd * zd, axis=1), axis=0))
    _store_packed(msg_ptr, z, i, g, total_bytes, chunk_bytes, seg_bytes, FULL)


@triton.jit
def _worker_pack_kernel(
    x_ptr, e_ptr, msg_ptr, partial_ptr, ticket_ptr, n, total_bytes, chunk_bytes, seg_bytes, length,
    words_ptr, num_slots, seg_words, scale_word, BLOCK_BYTES: tl.constexpr, FINAL_BLOCK: tl.constexpr,
    PATHS: tl.constexpr,
):
    # Packed sgn(pad(x) + e) and one float64 partial norm per program; the last program
    # writes the scale (sqrt of the partials' sum / N) into every segment.
    pid = tl.program_id(0).to(tl.int64)
    if PATHS == _FULL_PATH:
        _worker_block(x_ptr, e_ptr, msg_ptr, partial_ptr, pid, n, total_bytes, chunk_bytes, seg_bytes,
                      True, BLOCK_BYTES)
    elif PATHS == _MASKED_PATH:
        _worker_block(x_ptr, e_ptr, msg_ptr, partial_ptr, pid, n, total_bytes, chunk_bytes, seg_bytes,
                      False, BLOCK_BYTES)
    elif (pid + 1) * (BLOCK_BYTES * 8) <= n:
        _worker_block(x_ptr, e_ptr, msg_ptr, partial_ptr, pid, n, total_bytes, chunk_bytes, seg_bytes,
                      True, BLOCK_BYTES)
    else:
        _worker_block(x_ptr, e_ptr, msg_ptr, partial_ptr, pid, n, total_bytes, chunk_bytes, seg_bytes,
                      False, BLOCK_BYTES)
    _finish_scale(partial_ptr, ticket_ptr, tl.num_programs(0), length, words_ptr, num_slots, seg_words,
                  scale_word, words_ptr, 0, False, FINAL_BLOCK)


@triton.jit
def _error_block(x_ptr, e_ptr, idx, s, n, N, FULL: tl.constexpr, BLOCK: tl.constexpr):
    if FULL:
        z = tl.load(x_ptr + idx).to(tl.float32) + tl.load(e_ptr + idx).to(tl.float32)
        store_typed_error(e_ptr, idx, tl.where(z < 0, z + s, z - s), s, _WORKER, None)
    else:
        live = idx < N
        x = tl.load(x_ptr + idx, mask=live & (idx < n), other=0.0).to(tl.float32)
        z = x + tl.load(e_ptr + idx, mask=live, other=0.0).to(tl.float32)
        store_typed_error(e_ptr, idx, tl.where(z < 0, z + s, z - s), s, _WORKER, live)


@triton.jit
def _error_update_kernel(x_ptr, e_ptr, words_ptr, n, N, scale_word, BLOCK: tl.constexpr, PATHS: tl.constexpr):
    # e <- pad(x) + e - s*sgn(pad(x) + e), skipped entirely when s is not finite
    pid = tl.program_id(0).to(tl.int64)
    s = tl.load(words_ptr + scale_word)
    if tl.abs(s) < _INF:
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        if PATHS == _FULL_PATH:
            _error_block(x_ptr, e_ptr, idx, s, n, N, True, BLOCK)
        elif PATHS == _MASKED_PATH:
            _error_block(x_ptr, e_ptr, idx, s, n, N, False, BLOCK)
        elif (pid + 1) * BLOCK <= n:
            _error_block(x_ptr, e_ptr, idx, s, n, N, True, BLOCK)
        else:
            _error_block(x_ptr, e_ptr, idx, s, n, N, False, BLOCK)


@triton.jit
def _server_block(
    recv_ptr, recv_words_ptr, e_ptr, out_ptr, out_words_ptr, partial_ptr, pid, chunk_bytes, seg_bytes,
    seg_words, scale_word, W, inv_w, UPDATE: tl.constexpr, FULL: tl.constexpr, BLOCK_BYTES: tl.constexpr,
):
    g = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    i = tl.arange(0, 8)
    idx = g[:, None] * 8 + i[None, :]
    live = g < chunk_bytes
    m = tl.zeros([BLOCK_BYTES, 8], dtype=tl.float32)
    for r in range(0, W):
        if FULL:
            byte = tl.load(recv_ptr + r * seg_bytes + g).to(tl.int32)
        else:
            byte = tl.load(recv_ptr + r * seg_bytes + g, mask=live, other=0).to(tl.int32)
        s = tl.load(recv_words_ptr + r * seg_words + scale_word) * inv_w
        bit = (byte[:, None] >> (7 - i)[None, :]) & 1
        m += tl.where(bit == 1, s, -s)
    if FULL:
        m += tl.load(e_ptr + idx).to(tl.float32)
    else:
        m += tl.load(e_ptr + idx, mask=live[:, None], other=0.0).to(tl.float32)
    if UPDATE:
        s = tl.load(out_words_ptr + scale_word)
        if tl.abs(s) < _INF:
            if FULL:
                store_typed_error(e_ptr, idx, tl.where(m < 0, m + s, m - s), s, _SERVER, None)
            else:
                store_typed_error(e_ptr, idx, tl.where(m < 0, m + s, m - s), s, _SERVER, live[:, None])
    else:
        if FULL:
            md = m.to(tl.float64)
        else:
            md = tl.where(live[:, None], m, 0.0).to(tl.float64)  # dead rows summed -s_r above
        tl.store(partial_ptr + pid, tl.sum(tl.sum(md * md, axis=1), axis=0))
        _store_packed(out_ptr, m, i, g, chunk_bytes, chunk_bytes, seg_bytes, FULL)  # one segment


@triton.jit
def _server_kernel(
    recv_ptr, recv_words_ptr, e_ptr, out_ptr, out_words_ptr, partial_ptr, ticket_ptr,
    chunk_bytes, seg_bytes, seg_words, scale_word, W, inv_w, length,
    UPDATE: tl.constexpr, BLOCK_BYTES: tl.constexpr, FINAL_BLOCK: tl.constexpr, PATHS: tl.constexpr,
):
    # m = sum_r sgn_r * (s_r * (1/W)) + e, in rank order. First launch: partial norms, packed
    # sgn(m), and the last program writes the scale (NaN if a received scale is not finite).
    # Second launch (UPDATE): m recomputed, e <- m - s*sgn(m) if s is finite.
    pid = tl.program_id(0).to(tl.int64)
    if PATHS == _FULL_PATH:
        _server_block(recv_ptr, recv_words_ptr, e_ptr, out_ptr, out_words_ptr, partial_ptr, pid, chunk_bytes,
                      seg_bytes, seg_words, scale_word, W, inv_w, UPDATE, True, BLOCK_BYTES)
    elif PATHS == _MASKED_PATH:
        _server_block(recv_ptr, recv_words_ptr, e_ptr, out_ptr, out_words_ptr, partial_ptr, pid, chunk_bytes,
                      seg_bytes, seg_words, scale_word, W, inv_w, UPDATE, False, BLOCK_BYTES)
    elif (pid + 1) * BLOCK_BYTES <= chunk_bytes:
        _server_block(recv_ptr, recv_words_ptr, e_ptr, out_ptr, out_words_ptr, partial_ptr, pid, chunk_bytes,
                      seg_bytes, seg_words, scale_word, W, inv_w, UPDATE, True, BLOCK_BYTES)
    else:
        _server_block(recv_ptr, recv_words_ptr, e_ptr, out_ptr, out_words_ptr, partial_ptr, pid, chunk_bytes,
                      seg_bytes, seg_words, scale_word, W, inv_w, UPDATE, False, BLOCK_BYTES)
    if not UPDATE:
        _finish_scale(partial_ptr, ticket_ptr, tl.num_programs(0), length, out_words_ptr, 1, seg_words,
                      scale_word, recv_words_ptr, W, True, FINAL_BLOCK)


@triton.jit
def _decompress_block(
    g_ptr, g_words_ptr, out_ptr, e_ptr, w_words_ptr, pid, ok, n, total_bytes, chunk_bytes, seg_bytes,
    seg_words, scale_word, HAS_ERROR: tl.constexpr, FULL: tl.constexpr, BLOCK_BYTES: tl.constexpr,
):
    g = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    i = tl.arange(0, 8)
    idx = g[:, None] * 8 + i[None, :]
    j = g // chunk_bytes
    live = g < total_bytes
    if FULL:
        byte = tl.load(g_ptr + j * seg_bytes + g % chunk_bytes).to(tl.int32)
        s = tl.load(g_words_ptr + j * seg_words + scale_word)
    else:
        byte = tl.load(g_ptr + j * seg_bytes + g % chunk_bytes, mask=live, other=0).to(tl.int32)
        s = tl.load(g_words_ptr + j * seg_words + scale_word, mask=live, other=0.0)
    bit = (byte[:, None] >> (7 - i)[None, :]) & 1
    val = tl.where(bit == 1, s[:, None], -s[:, None]).to(out_ptr.dtype.element_ty)
    in_x = live[:, None] & (idx < n)
    if HAS_ERROR:
        sw = tl.load(w_words_ptr + scale_word)
    else:
        sw = 0.0
    _store_decompressed(out_ptr, e_ptr, idx, live, in_x, val, sw, ok, HAS_ERROR, FULL)


@triton.jit
def _segments_finite(words_ptr, W, seg_words, scale_word, GATE_BLOCK: tl.constexpr):
    # whether the (first) scale of each of the W segments is finite
    offs = tl.arange(0, GATE_BLOCK)
    bad = tl.zeros([GATE_BLOCK], dtype=tl.int32)
    for start in range(0, W, GATE_BLOCK):
        o = (start + offs).to(tl.int64)
        sg = tl.load(words_ptr + o * seg_words + scale_word, mask=o < W, other=0.0)
        bad += tl.where(tl.abs(sg) < _INF, 0, 1)
    return tl.sum(bad, axis=0) == 0


@triton.jit
def _store_decompressed(out_ptr, e_ptr, idx, live, in_x, val, sw, ok, HAS_ERROR: tl.constexpr,
                        FULL: tl.constexpr):
    # with HAS_ERROR, first the deferred worker error update (out still holds x; sw: the
    # worker scale, one or one per byte row), if ok; then out <- val
    if HAS_ERROR:
        if FULL:
            z = tl.load(out_ptr + idx).to(tl.float32) + tl.load(e_ptr + idx).to(tl.float32)
        else:
            z = tl.load(out_ptr + idx, mask=in_x, other=0.0).to(tl.float32)
            z += tl.load(e_ptr + idx, mask=live[:, None], other=0.0).to(tl.float32)
        if ok:
            if FULL:
                store_typed_error(e_ptr, idx, tl.where(z < 0, z + sw, z - sw), sw, _WORKER, None)
            else:
                store_typed_error(e_ptr, idx, tl.where(z < 0, z + sw, z - sw), sw, _WORKER, live[:, None])
    if FULL:
        tl.store(out_ptr + idx, val)
    else:
        tl.store(out_ptr + idx, val, mask=in_x)


@triton.jit
def _decompress_kernel(
    g_ptr, g_words_ptr, out_ptr, e_ptr, w_words_ptr, n, total_bytes, chunk_bytes, seg_bytes,
    seg_words, scale_word, W, HAS_ERROR: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    GATE_BLOCK: tl.constexpr, PATHS: tl.constexpr,
):
    # out[i] = s_j * sgn_i for chunk j of i. With HAS_ERROR, the worker error update that the
    # collective deferred is applied first (out still holds x), only if all W scales are finite.
    pid = tl.program_id(0).to(tl.int64)
    ok = True
    if HAS_ERROR:
        ok = _segments_finite(g_words_ptr, W, seg_words, scale_word, GATE_BLOCK)
    if PATHS == _FULL_PATH:
        _decompress_block(g_ptr, g_words_ptr, out_ptr, e_ptr, w_words_ptr, pid, ok, n, total_bytes,
                          chunk_bytes, seg_bytes, seg_words, scale_word, HAS_ERROR, True, BLOCK_BYTES)
    elif PATHS == _MASKED_PATH:
        _decompress_block(g_ptr, g_words_ptr, out_ptr, e_ptr, w_words_ptr, pid, ok, n, total_bytes,
                          chunk_bytes, seg_bytes, seg_words, scale_word, HAS_ERROR, False, BLOCK_BYTES)
    elif (pid + 1) * (BLOCK_BYTES * 8) <= n:
        _decompress_block(g_ptr, g_words_ptr, out_ptr, e_ptr, w_words_ptr, pid, ok, n, total_bytes,
                          chunk_bytes, seg_bytes, seg_words, scale_word, HAS_ERROR, True, BLOCK_BYTES)
    else:
        _decompress_block(g_ptr, g_words_ptr, out_ptr, e_ptr, w_words_ptr, pid, ok, n, total_bytes,
                          chunk_bytes, seg_bytes, seg_words, scale_word, HAS_ERROR, False, BLOCK_BYTES)


# Floating-point contraction (a * b + c as one fused multiply-add, FMA), stated for every launch
# so that no Triton default (on in 3.9, off from 3.10) or environment variable decides it. Off:
# the kernels then round as the plain-torch path (onebit.kernels.torch_kernels) does, op by op.
# From the maths, which products could fuse and whether it would change bits:
# - z * z summed in float64 (worker and server norms): z is a float32, so each product fits
#   float64's 53-bit mantissa exactly (48 bits); fused or not, the same bits.
# - s * sgn(z) (decompression, error updates): written as a selection, tl.where(bit, s, -s),
#   and m + s / m - s: no product to fuse.
# - the server's sum over ranks m += sgn_r * (s_r * (1/W)): s_r * (1/W) rounds to float32 before
#   the add; an FMA would skip that rounding and could change the last bit of m, and then a
#   sign or an error. The torch path rounds it; so contraction must be off.
# The compile check (scripts/compile_check.py) counts the fused floating-point instructions of
# every variant on every target (its fma column) and fails if any appears with this off.
FP_FUSION = False


# ---- shared by the fused steps' passes (onebit/kernels/fused/) ------------------------------

@triton.jit
def decoded_rows(g_ptr, g_words_ptr, pid, total_bytes, chunk_bytes, seg_bytes, seg_words, scale_word,
                 BLOCK_BYTES: tl.constexpr):
    # the program's byte rows of the gathered message, decoded: element indices [BLOCK_BYTES, 8],
    # which rows are live, and +-s of each element (its chunk's scale s)
    g = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    i = tl.arange(0, 8)
    idx = g[:, None] * 8 + i[None, :]
    j = g // chunk_bytes
    live = g < total_bytes
    byte = tl.load(g_ptr + j * seg_bytes + g % chunk_bytes, mask=live, other=0).to(tl.int32)
    s = tl.load(g_words_ptr + j * seg_words + scale_word, mask=live, other=0.0)
    bit = (byte[:, None] >> (7 - i)[None, :]) & 1
    return idx, live, tl.where(bit == 1, s[:, None], -s[:, None])


@triton.jit
def encode_rows(z, live, i, g, pid, msg_ptr, partial_ptr, ticket_ptr, total_bytes, chunk_bytes, seg_bytes,
                length, words_ptr, num_slots, seg_words, scale_word, num_partials, FINAL_BLOCK: tl.constexpr):
    # as _worker_pack_kernel after its z: this program's float64 partial norm, the packed signs,
    # and the last of the message's num_partials programs to arrive writes the scale
    zd = tl.where(live, z, 0.0).to(tl.float64)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(zd * zd, axis=1), axis=0))
    _store_packed(msg_ptr, z, i, g, total_bytes, chunk_bytes, seg_bytes, False)
    _finish_scale(partial_ptr, ticket_ptr, num_partials, length, words_ptr, num_slots, seg_words,
                  scale_word, words_ptr, 0, False, FINAL_BLOCK)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the launchers below make it: the one place that decides each
    kernel's arguments, constexprs, grid and warps. ``scripts/compile_check.py`` builds the
    same launches from mock tensors and compiles them ahead of time for real GPUs."""

    kernel: Any  # a triton JITFunction
    grid: int
    args: tuple
    constexprs: dict
    num_warps: int

    @property
    def name(self) -> str:
        flags = ",".join(f"{k}={v}" for k, v in self.constexprs.items() if isinstance(v, bool))
        return self.kernel.__name__.strip("_").removesuffix("_kernel") + (f"[{flags}]" if flags else "")

    def __call__(self) -> None:
        self.kernel[(self.grid,)](*self.args, **self.constexprs, num_warps=self.num_warps,
                                  enable_fp_fusion=FP_FUSION)


def worker_partials(layout: Layout) -> int:
    """How many float64 partial norms worker_compress needs (one per program)."""
    return triton.cdiv(layout.N // 8, _settings()[0])


def server_partials(layout: Layout) -> int:
    return triton.cdiv(layout.chunk_bytes, _settings()[0])


_FINAL_BLOCK = 1024  # partials the last program sums per step of its fixed-order loop


def worker_compress_launches(x, e, msg, words, partial, ticket, n: int, layout: Layout, update_error: bool):
    """``words`` is ``msg`` viewed as float32, ``partial`` float64 [worker_partials(layout)],
    ``ticket`` an int32 [1] that is zero (see ``ticket``)."""
    bb, warps = _settings()
    total, grid = layout.N // 8, worker_partials(layout)
    seg_words, scale_word = layout.segment_bytes // 4, layout.scale_offset // 4
    out = [Launch(_worker_pack_kernel, grid,
                  (x, e, msg, partial, ticket, n, total, layout.chunk_bytes, layout.segment_bytes, layout.N,
                   words, layout.W, seg_words, scale_word),
                  dict(BLOCK_BYTES=bb, FINAL_BLOCK=_FINAL_BLOCK, PATHS=BOTH_PATHS), warps)]
    if update_error:
        args = (x, e, words, n, layout.N, scale_word)
        out.append(Launch(_error_update_kernel, triton.cdiv(layout.N, 8 * bb), args,
                          dict(BLOCK=8 * bb, PATHS=BOTH_PATHS), warps))
    return out


def server_reduce_launches(received, recv_words, e, out, out_words, partial, ticket, layout: Layout):
    """``*_words``: the messages viewed as float32; ``partial`` float64 [server_partials(layout)];
    ``ticket`` as for worker_compress_launches."""
    bb, warps = _settings()
    grid = server_partials(layout)
    seg_words, scale_word = layout.segment_bytes // 4, layout.scale_offset // 4
    inv_w = inverse_world(layout.W)
    args = (
        received, recv_words, e, out, out_words, partial, ticket, layout.chunk_bytes,
        layout.segment_bytes, seg_words, scale_word, layout.W, inv_w, layout.C,
    )
    return [
        Launch(_server_kernel, grid, args, dict(UPDATE=update, BLOCK_BYTES=bb, FINAL_BLOCK=_FINAL_BLOCK,
                                                PATHS=BOTH_PATHS), warps)
        for update in (False, True)
    ]


def decompress_launches(gathered, g_words, out, worker_error, w_words, n: int, layout: Layout,
                        has_error: bool):
    """Without the deferred error update (``has_error=False``) the kernel never touches
    ``worker_error`` and ``w_words``: pass ``out`` and ``g_words`` in their places."""
    bb, warps = _settings()
    total = layout.N // 8
    return [Launch(_decompress_kernel, triton.cdiv(total, bb), (
        gathered, g_words, out, worker_error, w_words, n, total, layout.chunk_bytes, layout.segment_bytes,
        layout.segment_bytes // 4, layout.scale_offset // 4, layout.W,
    ), dict(HAS_ERROR=has_error, BLOCK_BYTES=bb, GATE_BLOCK=128, PATHS=BOTH_PATHS), warps)]


_TICKETS: dict[tuple, torch.Tensor] = {}


def ticket(device: torch.device) -> torch.Tensor:
    """The arrival counter (int32 [1], zero between launches) of the current stream on ``device``.

    A kernel that folds the scale finalisation into its last program counts its programs'
    arrivals here; the last one resets it to zero. Launches on one stream run one after
    another, so one counter per stream suffices; created once (zeroed) per stream.
    """
    # the raw stream handle (what Triton's launcher asks for): torch.cuda.current_stream(device)
    # costs more host time than the kernel launch it precedes
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        stream = torch._C._cuda_getCurrentRawStream(index)
    else:
        stream = 0
    key = (device, stream)
    t = _TICKETS.get(key)
    if t is None:
        t = _TICKETS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return t


def _partials(count: int, device: torch.device) -> torch.Tensor:
    return torch.empty(count, dtype=torch.float64, device=device)


def bfloat16_errors(layout: Layout) -> bool:
    """Whether the kernels take bfloat16 error buffers as they are (read widened, stored rounded as
    :func:`onebit.kernels.rounding.narrow_` rounds them: ``store_typed_error``, bitwise): always."""
    return True


def worker_compress(
    x: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor, update_error: bool
) -> None:
    partial = _partials(worker_partials(layout), e.device)
    for launch in worker_compress_launches(x, e, out, out.view(torch.float32), partial, ticket(e.device),
                                           x.numel(), layout, update_error):
        launch()


def server_reduce(received: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor) -> None:
    partial = _partials(server_partials(layout), e.device)
    for launch in server_reduce_launches(received, received.view(torch.float32), e, out,
                                         out.view(torch.float32), partial, ticket(e.device), layout):
        launch()


def decompress(
    gathered: torch.Tensor,
    layout: Layout,
    out: torch.Tensor,
    worker_error: torch.Tensor | None,
    worker_message: torch.Tensor | None,
) -> None:
    g_words = gathered.view(torch.float32)
    has_error = worker_error is not None
    if has_error:
        e, w_words = worker_error, worker_message.view(torch.float32)
    else:
        e, w_words = out, g_words
    for launch in decompress_launches(gathered, g_words, out, e, w_words, out.numel(), layout, has_error):
        launch()
