"""Fused Triton passes of OnebitAdam's compression stage: the optimizer maths inside the codec.

Unfused, a compression-stage step is the fold (``u = b1 u + (1-b1) g / d`` per parameter), the
worker pass, the server, the decompress pass, then the update (``p = p (1 - lr wd) - lr
clip(u / bc1)`` per parameter): about 4 launches per parameter and 92 B of memory traffic per
element at W = 4 (bench/TRAFFIC.md section 3). Here each bucket takes two passes around the
unchanged server kernels (section 8, item 1):

- pass A (``_fold_worker_kernel``): reads g, d, u and e; writes u' and the packed sign bits of
  ``u' + e`` and the worker scale (as ``_worker_pack_kernel``);
- pass B (``_decompress_update_kernel``): reads the gathered bits, u' and e; writes e (the
  deferred worker error update, as ``_decompress_kernel``), u (the decompressed momentum) and p.

The momentum u and the error e are flat per bucket; the gradients, denominators and parameters
are separate tensors. A program covers 1024 consecutive elements of the bucket;
a host-made table gives each program the range of parameters its elements belong to
(``lo``/``hi``: usually one), and per parameter its offset in the bucket, its size, the
addresses of its gradient, denominator and data (int64, read with ``pointer_type``) and its
group's scalars (b1, 1 - b1, 1 - lr wd, -lr, bc1). A gradient address of 0 is a None gradient
(a zero one). Contraction off (``triton_kernels.FP_FUSION``) and divisions correctly rounded
(``tl.div_rn``): each element is computed with the plain path's float32 operations in its
order (``cpu_fused``'s formulas), so the fold and the bits are those of the plain ops; the
update differs from the plain ``p.add_`` (which fuses its multiply-add on CPU) by at most one
rounding (tests/test_triton_fused.py).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .layout import Layout
from .triton_kernels import (
    _FINAL_BLOCK,
    Launch,
    _finish_scale,
    _partials,
    _segments_finite,
    _store_decompressed,
    _store_packed,
    ticket,
)

# rows of the per-parameter float32 scalars table, and of the int64 address table (the
# constexpr twins are what the kernels read)
B1, W1, DECAY, NEG_LR, BC1 = range(5)
GRAD, DENOM, PARAM = range(3)
_B1, _W1, _DECAY, _NEG_LR, _BC1 = (tl.constexpr(r) for r in range(5))
_GRAD, _DENOM, _PARAM = (tl.constexpr(r) for r in range(3))


def _settings() -> tuple[int, int]:
    """(bytes of packed bits per program, num_warps): 1024 elements per program (a quarter of
    the codec's: the gathered gradients, denominators and scalars would spill at 4096)."""
    return 128, 4


def programs(layout: Layout) -> int:
    """Programs per pass over a bucket of ``layout.N`` elements (and pass A's partial norms)."""
    return triton.cdiv(layout.N // 8, _settings()[0])


@triton.jit
def _owned(idx, k, start_ptr, count_ptr):
    # the offsets of idx in parameter k and which elements of idx are k's
    off = idx - tl.load(start_ptr + k).to(tl.int32)
    return off, (off >= 0) & (off < tl.load(count_ptr + k))


@triton.jit
def _decoded(g_ptr, g_words_ptr, pid, total_bytes, chunk_bytes, seg_bytes, seg_words, scale_word,
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
def _encode(z, live, i, g, pid, msg_ptr, partial_ptr, ticket_ptr, total_bytes, chunk_bytes, seg_bytes, length,
            words_ptr, num_slots, seg_words, scale_word, FINAL_BLOCK: tl.constexpr):
    # as _worker_pack_kernel after its z: this program's float64 partial norm, the packed signs,
    # and the last program to arrive writes the scale
    zd = tl.where(live, z, 0.0).to(tl.float64)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(zd * zd, axis=1), axis=0))
    _store_packed(msg_ptr, z, i, g, total_bytes, chunk_bytes, seg_bytes, False)
    _finish_scale(partial_ptr, ticket_ptr, tl.num_programs(0), length, words_ptr, num_slots, seg_words,
                  scale_word, words_ptr, 0, False, FINAL_BLOCK)


@triton.jit
def _fold_worker_kernel(
    u_ptr, e_ptr, msg_ptr, partial_ptr, ticket_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr,
    num_params, scalar_ptr, n, total_bytes, chunk_bytes, seg_bytes, length, words_ptr, num_slots, seg_words,
    scale_word,
    BLOCK_BYTES: tl.constexpr, FINAL_BLOCK: tl.constexpr,
):
    # u <- b1 u + ((1 - b1) g) / d for the elements of each parameter (g = 0 where its gradient
    # is None); then as _worker_pack_kernel on z = pad(u) + e: packed sgn(z), one float64
    # partial norm per program, the last program writes the scale
    pid = tl.program_id(0)  # int32 indices: the caller keeps N < 2^31
    g = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    i = tl.arange(0, 8)
    idx = g[:, None] * 8 + i[None, :]
    live = (g < total_bytes)[:, None]
    in_x = live & (idx < n)
    u = tl.load(u_ptr + idx, mask=in_x, other=0.0)
    grad = tl.zeros([BLOCK_BYTES, 8], dtype=tl.float32)
    den = tl.full([BLOCK_BYTES, 8], 1.0, tl.float32)
    b1 = tl.zeros([BLOCK_BYTES, 8], dtype=tl.float32)
    w = tl.zeros([BLOCK_BYTES, 8], dtype=tl.float32)
    for k in range(tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)):
        off, mine = _owned(idx, k, start_ptr, count_ptr)
        mine = mine & in_x
        ga = tl.load(addr_ptr + _GRAD * num_params + k)
        gp = ga.to(tl.pointer_type(tl.float32))
        dp = tl.load(addr_ptr + _DENOM * num_params + k).to(tl.pointer_type(tl.float32))
        grad = tl.where(mine, tl.load(gp + off, mask=mine & ((off * 0 + ga) != 0), other=0.0), grad)
        den = tl.where(mine, tl.load(dp + off, mask=mine, other=1.0), den)
        b1 = tl.where(mine, tl.load(scalar_ptr + _B1 * num_params + k), b1)
        w = tl.where(mine, tl.load(scalar_ptr + _W1 * num_params + k), w)
    u = u * b1 + tl.div_rn(w * grad, den)  # fold_preconditioned_: u.mul_(b1), u + (w * g) / d
    tl.store(u_ptr + idx, u, mask=in_x)
    z = u + tl.load(e_ptr + idx, mask=live, other=0.0)
    _encode(z, live, i, g, pid, msg_ptr, partial_ptr, ticket_ptr, total_bytes, chunk_bytes, seg_bytes, length,
            words_ptr, num_slots, seg_words, scale_word, FINAL_BLOCK)


@triton.jit
def _decompress_update_kernel(
    g_ptr, g_words_ptr, u_ptr, e_ptr, w_words_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, num_params,
    scalar_ptr, n, total_bytes, chunk_bytes, seg_bytes, seg_words, scale_word, W, clip,
    BLOCK_BYTES: tl.constexpr, GATE_BLOCK: tl.constexpr,
):
    # as _decompress_kernel with HAS_ERROR (the deferred worker error update if every scale is
    # finite, then u <- s_j sgn), then p <- p (1 - lr wd) + (-lr) clamp(u / bc1, -clip, clip)
    pid = tl.program_id(0)  # int32 indices: the caller keeps N < 2^31
    ok = _segments_finite(g_words_ptr, W, seg_words, scale_word, GATE_BLOCK)
    idx, live, val = _decoded(g_ptr, g_words_ptr, pid, total_bytes, chunk_bytes, seg_bytes, seg_words,
                              scale_word, BLOCK_BYTES)
    in_x = live[:, None] & (idx < n)
    sw = tl.load(w_words_ptr + scale_word)
    _store_decompressed(u_ptr, e_ptr, idx, live, in_x, val, sw, ok, True, False)
    for k in range(tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)):
        off, mine = _owned(idx, k, start_ptr, count_ptr)
        mine = mine & in_x
        pp = tl.load(addr_ptr + _PARAM * num_params + k).to(tl.pointer_type(tl.float32)) + off
        step = tl.div_rn(val, tl.load(scalar_ptr + _BC1 * num_params + k))
        step = tl.minimum(tl.maximum(step, -clip, propagate_nan=tl.PropagateNan.ALL), clip,
                          propagate_nan=tl.PropagateNan.ALL)
        p = tl.load(pp, mask=mine, other=0.0)
        decay = tl.load(scalar_ptr + _DECAY * num_params + k)
        p = p * decay + tl.load(scalar_ptr + _NEG_LR * num_params + k) * step
        tl.store(pp, p, mask=mine)


@dataclass(frozen=True)
class Tiles:
    """Which parameters each program of a bucket's passes touches (static per bucket layout):
    ``lo[t] <= k < hi[t]`` are the parameters with elements in program t's 1024 (k numbers the
    parameters of all buckets together; their offsets and sizes are :class:`Table`'s)."""

    lo: torch.Tensor  # int32 [programs]
    hi: torch.Tensor  # int32 [programs]


def tiles(first: int, offsets: list[int], numels: list[int], N: int, device) -> Tiles:
    """The program -> parameter ranges of a bucket whose parameters ``first + i`` lie at
    ``offsets[i]`` (consecutive, ``numels[i]`` elements each), padded to N elements."""
    per = _settings()[0] * 8
    count = triton.cdiv(N // 8, _settings()[0])
    ends = [o + c for o, c in zip(offsets, numels, strict=True)]
    lo, hi = [], []
    for t in range(count):
        a, b = t * per, (t + 1) * per
        k0 = bisect.bisect_right(ends, a)  # the first parameter ending after a
        k1 = bisect.bisect_left(offsets, b)  # the first starting at or after b
        k1 = max(k0, k1)
        lo.append(first + k0)
        hi.append(first + k1)
    as_i32 = dict(dtype=torch.int32, device=device)
    return Tiles(torch.tensor(lo, **as_i32), torch.tensor(hi, **as_i32))


def addresses(grads: list[torch.Tensor | None], denoms: list[torch.Tensor], params: list[torch.Tensor],
              device) -> torch.Tensor:
    """int64 [3, P]: rows GRAD (0 for None), DENOM and PARAM: the tensors' data addresses."""
    rows = [[0 if t is None else t.data_ptr() for t in grads], [t.data_ptr() for t in denoms],
            [t.data_ptr() for t in params]]
    return torch.tensor(rows, dtype=torch.int64).to(device)


def scalars(rows: list[tuple[float, float, float, float, float]], device) -> torch.Tensor:
    """float32 [SCALARS, P] from one (b1, 1 - b1, 1 - lr wd, -lr, bc1) per parameter, each
    rounded to float32 as the plain ops round a Python scalar."""
    return torch.tensor(rows, dtype=torch.float32).t().contiguous().to(device)


def fold_worker_launches(u, e, msg, words, partial, ticket, t: Tiles, start, count, addr, scal, n: int,
                         layout: Layout):
    bb, warps = _settings()
    seg_words, scale_word = layout.segment_bytes // 4, layout.scale_offset // 4
    return [Launch(_fold_worker_kernel, programs(layout),
                   (u, e, msg, partial, ticket, t.lo, t.hi, start, count, addr, addr.shape[-1], scal, n,
                    layout.N // 8, layout.chunk_bytes, layout.segment_bytes, layout.N, words, layout.W,
                    seg_words, scale_word),
                   dict(BLOCK_BYTES=bb, FINAL_BLOCK=_FINAL_BLOCK), warps)]


def decompress_update_launches(gathered, g_words, u, e, w_words, t: Tiles, start, count, addr, scal, n: int,
                               layout: Layout, clip: float):
    bb, warps = _settings()
    total = layout.N // 8
    return [Launch(_decompress_update_kernel, programs(layout),
                   (gathered, g_words, u, e, w_words, t.lo, t.hi, start, count, addr, addr.shape[-1], scal, n,
                    total, layout.chunk_bytes, layout.segment_bytes, layout.segment_bytes // 4,
                    layout.scale_offset // 4, layout.W, clip),
                   dict(BLOCK_BYTES=bb, GATE_BLOCK=128), warps)]


@dataclass(frozen=True)
class Table:
    """What both passes of one bucket read besides the codec's buffers: its program -> parameter
    ranges, and for all parameters (of every bucket) their offsets in their bucket and sizes
    (int64 [P]), addresses (int64 [3, P], :func:`addresses`) and scalars (float32 [5, P],
    :func:`scalars`)."""

    tiles: Tiles
    start: torch.Tensor
    count: torch.Tensor
    addr: torch.Tensor
    scal: torch.Tensor


def fold_worker(u: torch.Tensor, e: torch.Tensor, layout: Layout, msg: torch.Tensor, table: Table) -> None:
    """Pass A over a bucket: fold every parameter's gradient into u (flat, n elements), then
    compress ``pad(u) + e`` into ``msg`` as ``worker_compress(update_error=False)`` does."""
    partial = _partials(programs(layout), e.device)
    t = table
    for launch in fold_worker_launches(u, e, msg, msg.view(torch.float32), partial, ticket(e.device), t.tiles,
                                       t.start, t.count, t.addr, t.scal, u.numel(), layout):
        launch()


def decompress_update(gathered: torch.Tensor, layout: Layout, u: torch.Tensor, e: torch.Tensor,
                      msg: torch.Tensor, table: Table, clip: float) -> None:
    """Pass B over a bucket: ``decompress(gathered, u, worker_error=e, worker_message=msg)``,
    then every parameter's update from its part of u (``clip``: inf for none)."""
    t, words = table, msg.view(torch.float32)
    for launch in decompress_update_launches(gathered, gathered.view(torch.float32), u, e, words, t.tiles,
                                             t.start, t.count, t.addr, t.scal, u.numel(), layout, clip):
        launch()
