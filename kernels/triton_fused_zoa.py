"""ZeroOneAdam's phase-1 compressed step and phase-2 synchronisation in two fused Triton passes per
bucket (as :mod:`onebit.kernels.triton_fused` does for OnebitAdam; the CPU's are the C passes of
optimizers/_fused_cpu_zoa.py), and its phase-2 local step as one launch over every parameter.

Unfused, the step writes ``x = g / d`` into the accumulator, all-reduces it compressed, folds the
mean into the momentum (``m.mul_(b1).addcmul_(mean, d, value=1 - b1)``), zeroes the accumulator and
takes the stale step ``p -= lr * (clamp(m / d) [+ wd * p])``: about nine passes and 104 B per element
at W = 4 with the Triton codec (bench/TRAFFIC.md section 5). Here:

- pass A (``_zoa_worker_kernel``): reads g and d through the address table and e; writes the
  packed sign bits of ``x + e`` and the worker scale (as ``_worker_pack_kernel``), nothing else;
- pass B (``_zoa_step_kernel``): decodes the mean, reads g, d, e, m and p; computes x again for
  the deferred worker error (as ``_decompress_kernel``), ``m = b1 m + ((1 - b1) mean) d`` and the
  stale step; writes e, m and p.

That is 12 + 28 B per element and the server's (about 43 B at W = 4). The accumulator is never
touched (it stays zero in phase 1). Contraction is off (``triton_kernels.FP_FUSION``) and the
divisions correctly rounded, so x, the bits and the error are the plain ops' bitwise; the momentum
and the step ``p + (-lr) * (v [+ wd p])`` take each op rounded (onebit.kernels.cpu_fused's stale
step), within one rounding of plain ops that fuse a multiply-add (``addcmul_`` on CPUs with FMA, the C
passes' ``fmaf``; tests/test_triton_fused_zoa.py). The compile check keeps every launch free of
contraction.

The synchronisation (``SYNC``) encodes ``x = p - sync_params`` and sets ``m = (mean d) / (-lrs)``,
``sync_params += mean`` and ``p = sync_params`` (the unfused ops, each rounded). The local step
(``_zoa_local_kernel``) reads g, m, d and p and writes m and p: ``m = b1 m + (1 - b1) g``, then the
stale step (24 B against 56-68).

The table as triton_fused's (per program its range of parameters; per parameter its offset, size,
the addresses of its gradient (sync_params when synchronising), denominator, parameter and
momentum, and its group's scalars b1, 1 - b1, wd, -lr (-lrs when synchronising)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .layout import Layout
from .triton_fused import Tiles, _decoded, _encode, _owned, _settings, programs
from .triton_kernels import Launch, _partials, _segments_finite, ticket

GRAD, DENOM, PARAM, MOM = range(4)
B1, W1, WD, NEG_LR = range(4)
_GRAD, _DENOM, _PARAM, _MOM = (tl.constexpr(r) for r in range(4))
_B1, _W1, _WD, _NEG_LR = (tl.constexpr(r) for r in range(4))


@triton.jit
def _x(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, num_params, BLOCK_BYTES: tl.constexpr):
    # x = g / d of the program's elements (0 where a parameter's gradient is None, and outside
    # every parameter): the accumulator the unfused step all-reduces
    grad = tl.zeros([BLOCK_BYTES, 8], dtype=tl.float32)
    den = tl.full([BLOCK_BYTES, 8], 1.0, tl.float32)
    for k in range(tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)):
        off, mine = _owned(idx, k, start_ptr, count_ptr)
        mine = mine & in_x
        ga = tl.load(addr_ptr + _GRAD * num_params + k)
        gp = ga.to(tl.pointer_type(tl.float32))
        dp = tl.load(addr_ptr + _DENOM * num_params + k).to(tl.pointer_type(tl.float32))
        grad = tl.where(mine, tl.load(gp + off, mask=mine & ((off * 0 + ga) != 0), other=0.0), grad)
        den = tl.where(mine, tl.load(dp + off, mask=mine, other=1.0), den)
    return tl.div_rn(grad, den)


@triton.jit
def _x_sync(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, num_params,
            BLOCK_BYTES: tl.constexpr):
    # phase 2's synchronisation: x = p - sync_params (the GRAD row holds sync_params' addresses)
    x = tl.zeros([BLOCK_BYTES, 8], dtype=tl.float32)
    for k in range(tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)):
        off, mine = _owned(idx, k, start_ptr, count_ptr)
        mine = mine & in_x
        sp = tl.load(addr_ptr + _GRAD * num_params + k).to(tl.pointer_type(tl.float32))
        pp = tl.load(addr_ptr + _PARAM * num_params + k).to(tl.pointer_type(tl.float32))
        p = tl.load(pp + off, mask=mine, other=0.0)
        x = tl.where(mine, p - tl.load(sp + off, mask=mine, other=0.0), x)
    return x


@triton.jit
def _zoa_worker_kernel(
    e_ptr, msg_ptr, partial_ptr, ticket_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, num_params,
    n, total_bytes, chunk_bytes, seg_bytes, length, words_ptr, num_slots, seg_words, scale_word,
    BLOCK_BYTES: tl.constexpr, FINAL_BLOCK: tl.constexpr, SYNC: tl.constexpr,
):
    # as _worker_pack_kernel on z = x + e, x = g / d (SYNC: p - sync_params) never stored
    pid = tl.program_id(0)  # int32 indices: the caller keeps N < 2^31
    g = pid * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    i = tl.arange(0, 8)
    idx = g[:, None] * 8 + i[None, :]
    live = (g < total_bytes)[:, None]
    in_x = live & (idx < n)
    if SYNC:
        x = _x_sync(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, num_params, BLOCK_BYTES)
    else:
        x = _x(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, num_params, BLOCK_BYTES)
    z = x + tl.load(e_ptr + idx, mask=live, other=0.0)
    _encode(z, live, i, g, pid, msg_ptr, partial_ptr, ticket_ptr, total_bytes, chunk_bytes, seg_bytes, length,
            words_ptr, num_slots, seg_words, scale_word, FINAL_BLOCK)


@triton.jit
def _zoa_step_kernel(
    g_ptr, g_words_ptr, e_ptr, w_words_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, num_params,
    scalar_ptr, n, total_bytes, chunk_bytes, seg_bytes, seg_words, scale_word, W, clip,
    BLOCK_BYTES: tl.constexpr, GATE_BLOCK: tl.constexpr, SYNC: tl.constexpr,
):
    # the mean decoded; the deferred worker error from z = x + e (x again) if every scale is finite;
    # then per parameter m = b1 m + ((1 - b1) mean) d and p = p + (-lr) (clamp(m / d) [+ wd p]);
    # SYNC (phase 2's synchronisation, the NEG_LR row holding -lrs): m = (mean d) / (-lrs),
    # sync_params += mean, p = sync_params
    pid = tl.program_id(0)
    ok = _segments_finite(g_words_ptr, W, seg_words, scale_word, GATE_BLOCK)
    idx, live, mean = _decoded(g_ptr, g_words_ptr, pid, total_bytes, chunk_bytes, seg_bytes, seg_words,
                               scale_word, BLOCK_BYTES)
    in_x = live[:, None] & (idx < n)
    if SYNC:
        x = _x_sync(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, num_params, BLOCK_BYTES)
    else:
        x = _x(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, num_params, BLOCK_BYTES)
    z = x + tl.load(e_ptr + idx, mask=live[:, None], other=0.0)
    sw = tl.load(w_words_ptr + scale_word)
    if ok:
        tl.store(e_ptr + idx, tl.where(z < 0, z + sw, z - sw), mask=live[:, None])
    for k in range(tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)):
        off, mine = _owned(idx, k, start_ptr, count_ptr)
        mine = mine & in_x
        dp = tl.load(addr_ptr + _DENOM * num_params + k).to(tl.pointer_type(tl.float32)) + off
        mp = tl.load(addr_ptr + _MOM * num_params + k).to(tl.pointer_type(tl.float32)) + off
        pp = tl.load(addr_ptr + _PARAM * num_params + k).to(tl.pointer_type(tl.float32)) + off
        d = tl.load(dp, mask=mine, other=1.0)
        if SYNC:
            sp = tl.load(addr_ptr + _GRAD * num_params + k).to(tl.pointer_type(tl.float32)) + off
            m = tl.div_rn(mean * d, tl.load(scalar_ptr + _NEG_LR * num_params + k))
            s = tl.load(sp, mask=mine, other=0.0) + mean
            tl.store(mp, m, mask=mine)
            tl.store(sp, s, mask=mine)
            tl.store(pp, s, mask=mine)
        else:
            m = tl.load(mp, mask=mine, other=0.0)
            p = tl.load(pp, mask=mine, other=0.0)
            b1 = tl.load(scalar_ptr + _B1 * num_params + k)
            w = tl.load(scalar_ptr + _W1 * num_params + k)
            wd = tl.load(scalar_ptr + _WD * num_params + k)
            m = m * b1 + (w * mean) * d
            v = tl.div_rn(m, d)
            v = tl.minimum(tl.maximum(v, -clip, propagate_nan=tl.PropagateNan.ALL), clip,
                           propagate_nan=tl.PropagateNan.ALL)
            v = tl.where(wd > 0.0, v + wd * p, v)
            p = p + tl.load(scalar_ptr + _NEG_LR * num_params + k) * v
            tl.store(mp, m, mask=mine)
            tl.store(pp, p, mask=mine)


def addresses(grads: list[torch.Tensor | None], denoms: list[torch.Tensor], params: list[torch.Tensor],
              moms: list[torch.Tensor], device) -> torch.Tensor:
    """int64 [4, P]: rows GRAD (0 for None), DENOM, PARAM and MOM: the tensors' data addresses."""
    rows = [[0 if t is None else t.data_ptr() for t in grads], [t.data_ptr() for t in denoms],
            [t.data_ptr() for t in params], [t.data_ptr() for t in moms]]
    return torch.tensor(rows, dtype=torch.int64).to(device)


def scalars(rows: list[tuple[float, float, float, float]], device) -> torch.Tensor:
    """float32 [4, P] from one (b1, 1 - b1, wd, -lr) per parameter, rounded to float32 as the plain
    ops round a Python scalar."""
    return torch.tensor(rows, dtype=torch.float32).t().contiguous().to(device)


@dataclass(frozen=True)
class Table:
    """As :class:`onebit.kernels.triton_fused.Table` with four address rows and ZeroOneAdam's scalars."""

    tiles: Tiles
    start: torch.Tensor
    count: torch.Tensor
    addr: torch.Tensor
    scal: torch.Tensor


def worker_launches(e, msg, words, partial, ticket_, t: Tiles, start, count, addr, n: int, layout: Layout,
                    sync: bool = False):
    bb, warps = _settings()
    seg_words, scale_word = layout.segment_bytes // 4, layout.scale_offset // 4
    return [Launch(_zoa_worker_kernel, programs(layout),
                   (e, msg, partial, ticket_, t.lo, t.hi, start, count, addr, addr.shape[-1], n,
                    layout.N // 8, layout.chunk_bytes, layout.segment_bytes, layout.N, words, layout.W,
                    seg_words, scale_word),
                   dict(BLOCK_BYTES=bb, FINAL_BLOCK=1024, SYNC=sync), warps)]


def step_launches(gathered, g_words, e, w_words, t: Tiles, start, count, addr, scal, n: int, layout: Layout,
                  clip: float, sync: bool = False):
    bb, warps = _settings()
    return [Launch(_zoa_step_kernel, programs(layout),
                   (gathered, g_words, e, w_words, t.lo, t.hi, start, count, addr, addr.shape[-1], scal, n,
                    layout.N // 8, layout.chunk_bytes, layout.segment_bytes, layout.segment_bytes // 4,
                    layout.scale_offset // 4, layout.W, clip),
                   dict(BLOCK_BYTES=bb, GATE_BLOCK=128, SYNC=sync), warps)]


def worker(e: torch.Tensor, n: int, layout: Layout, msg: torch.Tensor, table: Table,
           sync: bool = False) -> None:
    """Pass A over a bucket of n elements: ``worker_compress(x, e, update_error=False)`` of x = g / d
    (``sync``: of x = p - sync_params, their addresses in the table's GRAD row)."""
    partial = _partials(programs(layout), e.device)
    t = table
    for launch in worker_launches(e, msg, msg.view(torch.float32), partial, ticket(e.device), t.tiles,
                                  t.start, t.count, t.addr, n, layout, sync):
        launch()


def step(gathered: torch.Tensor, layout: Layout, e: torch.Tensor, msg: torch.Tensor, n: int, table: Table,
         clip: float, sync: bool = False) -> None:
    """Pass B over a bucket: the deferred error, the fold and the stale step (``clip``: inf for none);
    ``sync``: phase 2's synchronisation (the table's NEG_LR row holding -lrs)."""
    t = table
    for launch in step_launches(gathered, gathered.view(torch.float32), e, msg.view(torch.float32), t.tiles,
                                t.start, t.count, t.addr, t.scal, n, layout, clip, sync):
        launch()


# ---- phase 2's local step: one launch over every parameter ---------------------------------------

LOCAL_BLOCK = _settings()[0] * 8  # elements per program: triton_fused's tiles, over the parameters end to end


@triton.jit
def _zoa_local_kernel(lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, num_params, scalar_ptr, n, clip,
                      BLOCK: tl.constexpr):
    # per parameter (laid end to end): m = b1 m + (1 - b1) g (b1 m without a gradient), then
    # p = p + (-lr) (clamp(m / d) [+ wd p]); cpu_fused.local_step_'s operations, each rounded
    pid = tl.program_id(0)  # int32 indices: the caller keeps n < 2^31
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    in_x = idx < n
    for k in range(tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)):
        off = idx - tl.load(start_ptr + k).to(tl.int32)
        mine = in_x & (off >= 0) & (off < tl.load(count_ptr + k))
        ga = tl.load(addr_ptr + _GRAD * num_params + k)
        gp = ga.to(tl.pointer_type(tl.float32)) + off
        dp = tl.load(addr_ptr + _DENOM * num_params + k).to(tl.pointer_type(tl.float32)) + off
        pp = tl.load(addr_ptr + _PARAM * num_params + k).to(tl.pointer_type(tl.float32)) + off
        mp = tl.load(addr_ptr + _MOM * num_params + k).to(tl.pointer_type(tl.float32)) + off
        g = tl.load(gp, mask=mine & ((off * 0 + ga) != 0), other=0.0)
        m = tl.load(mp, mask=mine, other=0.0)
        d = tl.load(dp, mask=mine, other=1.0)
        p = tl.load(pp, mask=mine, other=0.0)
        m = m * tl.load(scalar_ptr + _B1 * num_params + k)
        m = tl.where(ga != 0, m + tl.load(scalar_ptr + _W1 * num_params + k) * g, m)
        v = tl.div_rn(m, d)
        v = tl.minimum(tl.maximum(v, -clip, propagate_nan=tl.PropagateNan.ALL), clip,
                       propagate_nan=tl.PropagateNan.ALL)
        wd = tl.load(scalar_ptr + _WD * num_params + k)
        v = tl.where(wd > 0.0, v + wd * p, v)
        tl.store(mp, m, mask=mine)
        tl.store(pp, p + tl.load(scalar_ptr + _NEG_LR * num_params + k) * v, mask=mine)


def local_launches(t: Tiles, start, count, addr, scal, n: int, clip: float) -> list[Launch]:
    return [Launch(_zoa_local_kernel, triton.cdiv(n, LOCAL_BLOCK),
                   (t.lo, t.hi, start, count, addr, addr.shape[-1], scal, n, clip), dict(BLOCK=LOCAL_BLOCK),
                   8)]


def local_step(table: Table, n: int, clip: float) -> None:
    """Phase 2's local step of every parameter in the table (``table.start``: their offsets laid
    end to end, n elements in all; ``clip``: inf for none)."""
    t = table
    for launch in local_launches(t.tiles, t.start, t.count, t.addr, t.scal, n, clip):
        launch()
