"""Triton kernels for CUDA tensors (and for CPU tensors under ``TRITON_INTERPRET=1``).

Same contracts as :mod:`onebit.kernels.torch_kernels`; launched through
:mod:`onebit.kernels.api`. Nothing here synchronises with the host and nothing allocates
more than the per-block float64 partial sums of the norms (``N/4096`` values).

Norms are accumulated in float64 from per-block partials that one small kernel sums in a
fixed order: deterministic, and within half an ulp of the float64 reference in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .layout import Layout

# constexpr so the compiler (and the interpreter) see plain constants
_INF = tl.constexpr(float("inf"))
_NAN = tl.constexpr(float("nan"))


def _settings() -> tuple[int, int]:
    """(bytes of packed output per program, num_warps): 4096 elements per program."""
    return 512, 4


@triton.jit
def _pack_byte(z, i):
    # bit 7-i of each byte is set when z >= 0 (also for -0.0 and NaN)
    bit = tl.where(z < 0, 0, 1) << (7 - i)[None, :]
    return tl.sum(bit, axis=1).to(tl.uint8)


@triton.jit
def _worker_pack_kernel(
    x_ptr, e_ptr, msg_ptr, partial_ptr, n, total_bytes, chunk_bytes, seg_bytes,
    BLOCK_BYTES: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    g = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    i = tl.arange(0, 8)
    idx = g[:, None] * 8 + i[None, :]
    live = (g < total_bytes)[:, None]
    e = tl.load(e_ptr + idx, mask=live, other=0.0)
    x = tl.load(x_ptr + idx, mask=live & (idx < n), other=0.0).to(tl.float32)
    z = x + e
    zd = z.to(tl.float64)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(zd * zd, axis=1), axis=0))
    dst = (g // chunk_bytes) * seg_bytes + g % chunk_bytes
    tl.store(msg_ptr + dst, _pack_byte(z, i), mask=g < total_bytes)


@triton.jit
def _finalize_scale_kernel(
    partial_ptr, num_partials, length, words_ptr, num_slots, seg_words, scale_word,
    gate_ptr, gate_count, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr,
):
    # RMS from the partial sums; written into the scale slot of every segment. With a gate
    # (the received worker scales), any non-finite gate value makes the scale NaN.
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for start in range(0, num_partials, BLOCK):
        acc += tl.load(partial_ptr + start + offs, mask=start + offs < num_partials, other=0.0)
    scale = tl.sqrt(tl.sum(acc, axis=0) / length).to(tl.float32)
    if HAS_GATE:
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, gate_count, BLOCK):
            o = (start + offs).to(tl.int64)
            s = tl.load(gate_ptr + o * seg_words + scale_word, mask=o < gate_count, other=0.0)
            bad += tl.where(tl.abs(s) < _INF, 0, 1)
        scale = tl.where(tl.sum(bad, axis=0) > 0, _NAN, scale)
    value = tl.zeros([BLOCK], dtype=tl.float32) + scale
    for start in range(0, num_slots, BLOCK):
        o = (start + offs).to(tl.int64)
        tl.store(words_ptr + o * seg_words + scale_word, value, mask=o < num_slots)


@triton.jit
def _error_update_kernel(x_ptr, e_ptr, words_ptr, n, N, scale_word, BLOCK: tl.constexpr):
    # e <- pad(x) + e - s*sgn(pad(x) + e), skipped entirely when s is not finite
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(words_ptr + scale_word)
    # predicates are built at block shape: the interpreter cannot `&` a scalar into a block
    live = (idx < N) & (tl.abs(s + tl.zeros([BLOCK], tl.float32)) < _INF)
    x = tl.load(x_ptr + idx, mask=live & (idx < n), other=0.0).to(tl.float32)
    z = x + tl.load(e_ptr + idx, mask=live, other=0.0)
    tl.store(e_ptr + idx, tl.where(z < 0, z + s, z - s), mask=live)


@triton.jit
def _server_kernel(
    recv_ptr, recv_words_ptr, e_ptr, out_ptr, out_words_ptr, partial_ptr,
    chunk_bytes, seg_bytes, seg_words, scale_word, W, inv_w,
    UPDATE: tl.constexpr, BLOCK_BYTES: tl.constexpr,
):
    # m = sum_r sgn_r * (s_r * (1/W)) + e, in rank order. First launch: partial norms and
    # packed sgn(m). Second launch (UPDATE): m recomputed, e <- m - s*sgn(m) if s is finite.
    pid = tl.program_id(0).to(tl.int64)
    g = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    i = tl.arange(0, 8)
    idx = g[:, None] * 8 + i[None, :]
    live = g < chunk_bytes
    m = tl.zeros([BLOCK_BYTES, 8], dtype=tl.float32)
    for r in range(0, W):
        byte = tl.load(recv_ptr + r * seg_bytes + g, mask=live, other=0).to(tl.int32)
        s = tl.load(recv_words_ptr + r * seg_words + scale_word) * inv_w
        bit = (byte[:, None] >> (7 - i)[None, :]) & 1
        m += tl.where(bit == 1, s, -s)
    m += tl.load(e_ptr + idx, mask=live[:, None], other=0.0)
    if UPDATE:
        s = tl.load(out_words_ptr + scale_word)
        ok = tl.abs(s + tl.zeros([BLOCK_BYTES, 8], tl.float32)) < _INF
        tl.store(e_ptr + idx, tl.where(m < 0, m + s, m - s), mask=live[:, None] & ok)
    else:
        md = tl.where(live[:, None], m, 0.0).to(tl.float64)  # dead rows summed -s_r above
        tl.store(partial_ptr + pid, tl.sum(tl.sum(md * md, axis=1), axis=0))
        tl.store(out_ptr + g, _pack_byte(m, i), mask=live)


@triton.jit
def _decompress_kernel(
    g_ptr, g_words_ptr, out_ptr, e_ptr, w_words_ptr, n, total_bytes, chunk_bytes, seg_bytes,
    seg_words, scale_word, W, HAS_ERROR: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    GATE_BLOCK: tl.constexpr,
):
    # out[i] = s_j * sgn_i for chunk j of i. With HAS_ERROR, the worker error update that the
    # collective deferred is applied first (out still holds x), only if all W scales are finite.
    pid = tl.program_id(0).to(tl.int64)
    g = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    i = tl.arange(0, 8)
    idx = g[:, None] * 8 + i[None, :]
    live = g < total_bytes
    j = g // chunk_bytes
    byte = tl.load(g_ptr + j * seg_bytes + g % chunk_bytes, mask=live, other=0).to(tl.int32)
    s = tl.load(g_words_ptr + j * seg_words + scale_word, mask=live, other=0.0)
    bit = (byte[:, None] >> (7 - i)[None, :]) & 1
    val = tl.where(bit == 1, s[:, None], -s[:, None])
    in_x = live[:, None] & (idx < n)
    if HAS_ERROR:
        offs = tl.arange(0, GATE_BLOCK)
        bad = tl.zeros([GATE_BLOCK], dtype=tl.int32)
        for start in range(0, W, GATE_BLOCK):
            o = (start + offs).to(tl.int64)
            sg = tl.load(g_words_ptr + o * seg_words + scale_word, mask=o < W, other=0.0)
            bad += tl.where(tl.abs(sg) < _INF, 0, 1)
        ok = (tl.sum(bad, axis=0) + tl.zeros([BLOCK_BYTES, 8], tl.int32)) == 0
        x = tl.load(out_ptr + idx, mask=in_x, other=0.0).to(tl.float32)
        z = x + tl.load(e_ptr + idx, mask=live[:, None], other=0.0)
        sw = tl.load(w_words_ptr + scale_word)
        tl.store(e_ptr + idx, tl.where(z < 0, z + sw, z - sw), mask=live[:, None] & ok)
    tl.store(out_ptr + idx, val.to(out_ptr.dtype.element_ty), mask=in_x)


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
        self.kernel[(self.grid,)](*self.args, **self.constexprs, num_warps=self.num_warps)


def worker_partials(layout: Layout) -> int:
    """How many float64 partial norms worker_compress needs (one per program)."""
    return triton.cdiv(layout.N // 8, _settings()[0])


def server_partials(layout: Layout) -> int:
    return triton.cdiv(layout.chunk_bytes, _settings()[0])


def worker_compress_launches(x, e, msg, words, partial, n: int, layout: Layout, update_error: bool):
    """``words`` is ``msg`` viewed as float32, ``partial`` float64 [worker_partials(layout)]."""
    bb, warps = _settings()
    total, grid = layout.N // 8, worker_partials(layout)
    seg_words, scale_word = layout.segment_bytes // 4, layout.scale_offset // 4
    out = [
        Launch(_worker_pack_kernel, grid,
               (x, e, msg, partial, n, total, layout.chunk_bytes, layout.segment_bytes),
               dict(BLOCK_BYTES=bb), warps),
        Launch(_finalize_scale_kernel, 1,
               (partial, grid, layout.N, words, layout.W, seg_words, scale_word, words, 0),
               dict(HAS_GATE=False, BLOCK=1024), 4),
    ]
    if update_error:
        out.append(Launch(_error_update_kernel, triton.cdiv(layout.N, 8 * bb),
                          (x, e, words, n, layout.N, scale_word), dict(BLOCK=8 * bb), warps))
    return out


def server_reduce_launches(received, recv_words, e, out, out_words, partial, layout: Layout):
    """``*_words``: the messages viewed as float32; ``partial`` float64 [server_partials(layout)]."""
    bb, warps = _settings()
    grid = server_partials(layout)
    seg_words, scale_word = layout.segment_bytes // 4, layout.scale_offset // 4
    inv_w = float(torch.tensor(1.0 / layout.W, dtype=torch.float32))
    args = (
        received, recv_words, e, out, out_words, partial, layout.chunk_bytes,
        layout.segment_bytes, seg_words, scale_word, layout.W, inv_w,
    )
    return [
        Launch(_server_kernel, grid, args, dict(UPDATE=False, BLOCK_BYTES=bb), warps),
        Launch(_finalize_scale_kernel, 1, (partial, grid, layout.C, out_words, 1, seg_words, scale_word,
                                           recv_words, layout.W), dict(HAS_GATE=True, BLOCK=1024), 4),
        Launch(_server_kernel, grid, args, dict(UPDATE=True, BLOCK_BYTES=bb), warps),
    ]


def decompress_launches(gathered, g_words, out, worker_error, w_words, n: int, layout: Layout):
    """Without a worker error, pass ``worker_error=out`` and ``w_words=g_words`` (unused)
    and the kernel is specialised with HAS_ERROR=False; see decompress."""
    bb, warps = _settings()
    total = layout.N // 8
    has_error = worker_error is not out
    return [Launch(_decompress_kernel, triton.cdiv(total, bb), (
        gathered, g_words, out, worker_error, w_words, n, total, layout.chunk_bytes, layout.segment_bytes,
        layout.segment_bytes // 4, layout.scale_offset // 4, layout.W,
    ), dict(HAS_ERROR=has_error, BLOCK_BYTES=bb, GATE_BLOCK=128), warps)]


def _partials(count: int, device: torch.device) -> torch.Tensor:
    return torch.empty(count, dtype=torch.float64, device=device)


def worker_compress(
    x: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor, update_error: bool
) -> None:
    partial = _partials(worker_partials(layout), e.device)
    for launch in worker_compress_launches(x, e, out, out.view(torch.float32), partial, x.numel(), layout,
                                           update_error):
        launch()


def server_reduce(received: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor) -> None:
    partial = _partials(server_partials(layout), e.device)
    for launch in server_reduce_launches(received, received.view(torch.float32), e, out,
                                         out.view(torch.float32), partial, layout):
        launch()


def decompress(
    gathered: torch.Tensor,
    layout: Layout,
    out: torch.Tensor,
    worker_error: torch.Tensor | None,
    worker_message: torch.Tensor | None,
) -> None:
    g_words = gathered.view(torch.float32)
    if worker_error is None:
        launches = decompress_launches(gathered, g_words, out, out, g_words, out.numel(), layout)
    else:
        w_words = worker_message.view(torch.float32)
        launches = decompress_launches(gathered, g_words, out, worker_error, w_words, out.numel(), layout)
    for launch in launches:
        launch()
