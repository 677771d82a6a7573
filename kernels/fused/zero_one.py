"""ZeroOneAdam's phase-1 compressed step and phase-2 synchronisation inside the codec's two passes,
and its phase-2 local step in one pass over every parameter, in every backend that has them.

Phase 1's step, per bucket (per tensor its gradient ``g``, stale denominator ``d`` (computed from the
variance ``v`` as it is read: :mod:`.table`), momentum ``m`` and
parameter ``p``; per group b1, lr, wd): unfused, it writes ``x = g / d`` (0 without a gradient) into the
accumulator, all-reduces it compressed, folds the mean into the momentum (``m.mul_(b1).addcmul_(mean, d,
value=1 - b1)``), zeroes the accumulator and takes the stale step ``p -= lr * (clamp(m / d) [+ wd p])``
(``onebit.optimizers.zero_one_adam``: the reference these passes are tested against,
tests/test_triton_fused_zoa.py, test_fused_cpu_zoa.py). Here:

- worker pass: reads g, d and the worker error e; writes the packed signs of ``x + e`` and the worker
  scale, nothing else (x is never stored; the accumulator stays zero);
- decompress pass: decodes the mean; computes x again for the deferred worker error (where every
  scale is finite); ``m = b1 m + ((1 - b1) mean) d``; the stale step; writes e, m and p.

The synchronisation (``sync``) encodes ``x = p - sync_params`` and sets ``m = (mean d) / nl`` (nl: minus
the group's learning rates summed since the last one), ``sync_params += mean``, ``p = sync_params``. The
local step (Triton: ``_zoa_local_kernel``) reads g, m, d and p and writes m and p: ``m = b1 m + (1 - b1)
g``, then the stale step.

Rounding (docs/ALGORITHMS.md 6.4): x, the bits and the error are the plain ops' bitwise in both
backends; the momentum fold is ``fma((1 - b1) mean, d, b1 m)`` in both (C ``fmaf``, Triton ``tl.fma``):
what the unfused ``addcmul_`` computes where it fuses its multiply-add (x86 with AVX2, CUDA); the stale
step each operation rounded, as the unfused one.

The table (:mod:`onebit.kernels.fused.table`): address columns ``ADDRESSES`` (``SYNC_ADDRESSES`` when
synchronising: sync_params in the gradient's column), scalar columns ``SCALARS``."""

from __future__ import annotations

import torch

from .._triton import AVAILABLE, constexpr, jit, tl
from ..cpu_simd import _f32, _isa, library
from ..layout import Layout
from ..rounding import WORKER
from . import _native, stage
from .table import (
    BLOCK_BYTES,
    DENOMINATOR,
    WARPS,
    Table,
    address,
    denominator,
    elements,
    elements_at,
    end_to_end_block,
    grad_denom,
    owned,
    programs,
    scalar,
    tiles,
)

if AVAILABLE:
    from ..rounding import load_error, store_error
    from ..triton_kernels import Launch, _partials, _segments_finite, decoded_rows, encode_rows, ticket

ADDRESSES = ("grad", "var", "param", "momentum")
SYNC_ADDRESSES = ("sync_params", "var", "param", "momentum")
SCALARS = ("b1", "w1", "wd", "neg_lr", "nl", *DENOMINATOR)  # b1, 1 - b1, wd, -lr; nl (synchronising): -(sum
# of lr); floor, r, eps
_GRAD, _VAR, _PARAM, _MOM = (constexpr(ADDRESSES.index(c)) for c in ADDRESSES)
_SYNC = constexpr(SYNC_ADDRESSES.index("sync_params"))
_B1, _W1, _WD, _NEG_LR, _NL = (constexpr(SCALARS.index(c)) for c in SCALARS[:5])


def table(offsets: list[int], numels: list[int], device, sync: bool = False) -> Table:
    """A bucket's table for phase 1's step (``sync``: for the synchronisation)."""
    return Table(offsets, numels, SYNC_ADDRESSES if sync else ADDRESSES, SCALARS, device)


def rows(group: dict, denominator: tuple[float, float, float]) -> tuple[float, ...]:
    """A tensor's scalars for phase 1's step and the local step: its group's, then its stale
    denominator's ``(floor, r, eps)``."""
    b1 = group["betas"][0]
    return (b1, 1.0 - b1, group["weight_decay"], -group["lr"], 0.0, *denominator)


def sync_rows(nl: float, denominator: tuple[float, float, float]) -> tuple[float, ...]:
    """A tensor's scalars for the synchronisation (``nl``: minus its group's learning rates summed)."""
    return (0.0, 0.0, 0.0, 0.0, nl, *denominator)


# ---- Triton ------------------------------------------------------------------------------------

@jit
def _x(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, scal_ptr, K,
       BLOCK_BYTES: tl.constexpr):
    # x = g / d of the program's elements (0 where a tensor's gradient is None, and outside every
    # tensor): the accumulator the unfused step all-reduces
    grad, den = grad_denom(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, scal_ptr, K, _GRAD,
                           _VAR,
                           BLOCK_BYTES)
    return tl.div_rn(grad, den)


@jit
def _x_sync(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, BLOCK_BYTES: tl.constexpr):
    # phase 2's synchronisation: x = p - sync_params
    x = tl.zeros([BLOCK_BYTES, 8], dtype=tl.float32)
    for k in range(tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)):
        off, mine = owned(idx, k, start_ptr, count_ptr)
        mine = mine & in_x
        sp = address(addr_ptr, _SYNC, K, k)
        pp = address(addr_ptr, _PARAM, K, k)
        p = tl.load(pp + off, mask=mine, other=0.0)
        x = tl.where(mine, p - tl.load(sp + off, mask=mine, other=0.0), x)
    return x


@jit
def _zoa_worker_kernel(
    e_ptr, msg_ptr, partial_ptr, ticket_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, scal_ptr, K,
    n, total_bytes, chunk_bytes, seg_bytes, length, words_ptr, num_slots, seg_words, scale_word, poison_ptr,
    BLOCK_BYTES: tl.constexpr, FINAL_BLOCK: tl.constexpr, SYNC: tl.constexpr, POISON: tl.constexpr,
):
    # as _worker_pack_kernel on z = x + e, x = g / d (SYNC: p - sync_params) never stored; POISON: z + poison
    # (0, or NaN where this rank's gradients are not all finite: the scale NaN on every rank, issue 57)
    pid = tl.program_id(0)
    g, i, idx, live, in_x = elements(n, total_bytes, BLOCK_BYTES)
    if SYNC:
        x = _x_sync(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, BLOCK_BYTES)
    else:
        x = _x(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, scal_ptr, K, BLOCK_BYTES)
    z = x + tl.load(e_ptr + idx, mask=live, other=0.0)
    if POISON:
        z = z + tl.load(poison_ptr)
    encode_rows(z, live, i, g, pid, msg_ptr, partial_ptr, ticket_ptr, total_bytes, chunk_bytes, seg_bytes,
                length, words_ptr, num_slots, seg_words, scale_word, tl.num_programs(0), FINAL_BLOCK)


@jit
def _zoa_step_kernel(
    g_ptr, g_words_ptr, e_ptr, w_words_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K,
    scal_ptr, n, total_bytes, chunk_bytes, seg_bytes, seg_words, scale_word, W, clip, flag_ptr,
    BLOCK_BYTES: tl.constexpr, GATE_BLOCK: tl.constexpr, SYNC: tl.constexpr, FMA: tl.constexpr,
    GATE: tl.constexpr,
):
    # the mean decoded; the deferred worker error from z = x + e (x again) if every scale is finite;
    # then per tensor m = fma((1 - b1) mean, d, b1 m) and p = p + (-lr) (clamp(m / d) [+ wd p]);
    # SYNC (phase 2's synchronisation): m = (mean d) / nl, sync_params += mean, p = sync_params.
    # GATE: the updates too only if every scale is finite, else the flag (uint8) set (the step skipped on
    # the device, issue 57)
    pid = tl.program_id(0)
    ok = _segments_finite(g_words_ptr, W, seg_words, scale_word, GATE_BLOCK)
    _flag(ok, pid, flag_ptr, GATE)
    idx, live, mean = decoded_rows(g_ptr, g_words_ptr, pid, total_bytes, chunk_bytes, seg_bytes, seg_words,
                                   scale_word, BLOCK_BYTES)
    in_x = live[:, None] & (idx < n)
    if SYNC:
        x = _x_sync(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, BLOCK_BYTES)
    else:
        x = _x(idx, in_x, pid, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, scal_ptr, K, BLOCK_BYTES)
    z = x + tl.load(e_ptr + idx, mask=live[:, None], other=0.0)
    sw = tl.load(w_words_ptr + scale_word)
    if ok:
        tl.store(e_ptr + idx, tl.where(z < 0, z + sw, z - sw), mask=live[:, None])
    if GATE:
        in_x = in_x & (idx * 0 + ok.to(tl.int32) != 0)  # (a tensor: a scalar mask is refused)
    for k in range(tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)):
        _update(idx, in_x, mean, k, start_ptr, count_ptr, addr_ptr, K, scal_ptr, clip, SYNC, FMA)


@jit
def _flag(ok, pid, flag_ptr, GATE: tl.constexpr):
    # GATE: the flag (uint8) set where a gathered scale is not finite (one program of the bucket writes it)
    if GATE:
        if pid == 0:
            if not ok:
                tl.store(flag_ptr, 1)


@jit
def _update(idx, in_x, mean, k, start_ptr, count_ptr, addr_ptr, K, scal_ptr, clip, SYNC: tl.constexpr,
            FMA: tl.constexpr):
    # tensor k's part of the decompress pass: the fold and the stale step (SYNC: the synchronisation's);
    # nothing outside in_x stored
    off, mine = owned(idx, k, start_ptr, count_ptr)
    mine = mine & in_x
    mp = address(addr_ptr, _MOM, K, k) + off
    pp = address(addr_ptr, _PARAM, K, k) + off
    d = denominator(addr_ptr, scal_ptr, _VAR, K, k, off, mine)
    if SYNC:
        sp = address(addr_ptr, _SYNC, K, k) + off
        m = tl.div_rn(mean * d, scalar(scal_ptr, k, _NL))
        s = tl.load(sp, mask=mine, other=0.0) + mean
        tl.store(mp, m, mask=mine)
        tl.store(sp, s, mask=mine)
        tl.store(pp, s, mask=mine)
    else:
        m = tl.load(mp, mask=mine, other=0.0)
        p = tl.load(pp, mask=mine, other=0.0)
        wd = scalar(scal_ptr, k, _WD)
        if FMA:  # the fold's one multiply-add (docs/ALGORITHMS.md 6.4)
            m = tl.fma(scalar(scal_ptr, k, _W1) * mean, d, m * scalar(scal_ptr, k, _B1))
        else:  # the compile check's twin: the same kernel with no FMA written (it must show none)
            m = m * scalar(scal_ptr, k, _B1) + (scalar(scal_ptr, k, _W1) * mean) * d
        v = tl.div_rn(m, d)
        v = tl.minimum(tl.maximum(v, -clip, propagate_nan=tl.PropagateNan.ALL), clip,
                       propagate_nan=tl.PropagateNan.ALL)
        v = tl.where(wd > 0.0, v + wd * p, v)
        p = p + scalar(scal_ptr, k, _NEG_LR) * v
        tl.store(mp, m, mask=mine)
        tl.store(pp, p, mask=mine)


def worker_launches(e, msg, words, partial, ticket_, table: Table, n: int, layout: Layout,
                    sync: bool = False, poison: torch.Tensor | None = None):
    t = tiles(table, layout.N)
    seg_words, scale_word = layout.segment_bytes // 4, layout.scale_offset // 4
    return [Launch(_zoa_worker_kernel, programs(layout.N),
                   (e, msg, partial, ticket_, t.lo, t.hi, table.start, table.count, table.addr, table.scal,
                    table.K, n,
                    layout.N // 8, layout.chunk_bytes, layout.segment_bytes, layout.N, words, layout.W,
                    seg_words, scale_word, partial if poison is None else poison),
                   dict(BLOCK_BYTES=BLOCK_BYTES, FINAL_BLOCK=1024, SYNC=sync, POISON=poison is not None),
                   WARPS)]


def step_launches(gathered, g_words, e, w_words, table: Table, n: int, layout: Layout, clip: float,
                  sync: bool = False, fma: bool = True, flag: torch.Tensor | None = None):
    t = tiles(table, layout.N)
    return [Launch(_zoa_step_kernel, programs(layout.N),
                   (gathered, g_words, e, w_words, t.lo, t.hi, table.start, table.count, table.addr, table.K,
                    table.scal, n, layout.N // 8, layout.chunk_bytes, layout.segment_bytes,
                    layout.segment_bytes // 4, layout.scale_offset // 4, layout.W, clip,
                    gathered if flag is None else flag),
                   dict(BLOCK_BYTES=BLOCK_BYTES, GATE_BLOCK=128, SYNC=sync, FMA=fma, GATE=flag is not None),
                   WARPS)]


def worker(e: torch.Tensor, n: int, layout: Layout, msg: torch.Tensor, table: Table,
           sync: bool = False, poison: torch.Tensor | None = None) -> None:
    """The worker pass over a bucket of n elements in Triton: ``worker_compress(x, e,
    update_error=False)`` of x = g / d (``sync``: of x = p - sync_params); ``poison``: a float32 on the
    device, 0 or NaN, added to every encoded value (the agreement on the device, issue 57)."""
    partial = _partials(programs(layout.N), e.device)
    words = msg.view(torch.float32)
    for launch in worker_launches(e, msg, words, partial, ticket(e.device), table, n, layout, sync, poison):
        launch()


def step(gathered: torch.Tensor, layout: Layout, e: torch.Tensor, msg: torch.Tensor, n: int, table: Table,
         clip: float, sync: bool = False, flag: torch.Tensor | None = None) -> None:
    """The decompress pass over a bucket in Triton: the deferred error, the fold and the stale step
    (``clip``: inf for none); ``sync``: phase 2's synchronisation. ``flag`` (uint8 [1] on the device):
    the gate of the agreement on the device, nothing updated and the flag set to 1 where a gathered scale
    is not finite."""
    for launch in step_launches(gathered, gathered.view(torch.float32), e, msg.view(torch.float32), table, n,
                                layout, clip, sync, flag=flag):
        launch()


class TritonPasses:
    """``compressed_allreduce_passes``' worker and finish in the Triton passes (``sync``: phase 2's
    synchronisation; ``poison``, ``flag``: the agreement on the device, :func:`worker`, :func:`step`)."""

    def __init__(self, table: Table, clip: float, sync: bool = False, poison: torch.Tensor | None = None,
                 flag: torch.Tensor | None = None) -> None:
        self.table, self.clip, self.sync, self.poison, self.flag = table, clip, sync, poison, flag
        self.gathered = self.layout = None

    def worker(self, flat, worker_error, layout, msg) -> None:
        worker(worker_error, flat.numel(), layout, msg, self.table, self.sync, self.poison)

    def finish(self, gathered, layout, flat, worker_error, msg) -> None:
        step(gathered, layout, worker_error, msg, flat.numel(), self.table, self.clip, self.sync, self.flag)
        self.gathered, self.layout = gathered, layout  # kept: the synchronisation's message


# ---- Triton, every bucket of the stage in one launch per pass (kernels/fused/stage.py) ----------

@jit
def _stage_zoa_worker_kernel(
    bt_ptr, map_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, partial_ptr, ticket_ptr, W,
    poison_ptr, BLOCK_BYTES: tl.constexpr, FINAL_BLOCK: tl.constexpr, SYNC: tl.constexpr, EBF16: tl.constexpr,
    POISON: tl.constexpr,
):
    # _zoa_worker_kernel on each program's bucket
    q = tl.program_id(0)
    b, row, pid, n, N, _, _, _ = stage.bucket(bt_ptr, map_ptr, q, stage.P0)
    g, i, idx, live, in_x = elements_at(pid, n, N // 8, BLOCK_BYTES)
    if SYNC:
        x = _x_sync(idx, in_x, q, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, BLOCK_BYTES)
    else:
        x = _x(idx, in_x, q, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, scal_ptr, K, BLOCK_BYTES)
    z = x + load_error(tl.load(row + stage.E), idx, live, EBF16)
    if POISON:
        z = z + tl.load(poison_ptr)
    stage.encode_bucket(z, live, i, g, pid, b, row, partial_ptr, ticket_ptr, W, FINAL_BLOCK)


@jit
def _stage_zoa_step_kernel(
    bt_ptr, map_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, W, clip, role, flag_ptr,
    BLOCK_BYTES: tl.constexpr, GATE_BLOCK: tl.constexpr, SYNC: tl.constexpr, FMA: tl.constexpr,
    EBF16: tl.constexpr, GATE: tl.constexpr,
):
    # _zoa_step_kernel on each program's bucket
    q = tl.program_id(0)
    b, row, pid, n, N, chunk_bytes, seg_bytes, scale_word = stage.bucket(bt_ptr, map_ptr, q, stage.P0)
    ok = stage.gathered_finite(row, W, GATE_BLOCK)
    _flag(ok, pid, flag_ptr, GATE)
    idx, live, mean, in_x = stage.gathered_rows(row, pid, n, N, chunk_bytes, seg_bytes, scale_word,
                                                BLOCK_BYTES)
    if SYNC:
        x = _x_sync(idx, in_x, q, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, BLOCK_BYTES)
    else:
        x = _x(idx, in_x, q, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, scal_ptr, K, BLOCK_BYTES)
    e_addr = tl.load(row + stage.E)
    z = x + load_error(e_addr, idx, live[:, None], EBF16)
    sw = tl.load(tl.load(row + stage.MSG).to(tl.pointer_type(tl.float32)) + scale_word)
    if ok:
        store_error(e_addr, idx, tl.where(z < 0, z + sw, z - sw), sw, role, live[:, None], EBF16)
    if GATE:
        in_x = in_x & (idx * 0 + ok.to(tl.int32) != 0)
    for k in range(tl.load(lo_ptr + q), tl.load(hi_ptr + q)):
        _update(idx, in_x, mean, k, start_ptr, count_ptr, addr_ptr, K, scal_ptr, clip, SYNC, FMA)


def stage_launches(st, table: Table, clip: float, ebf16: bool, sync: bool = False, fma: bool = True,
                   poison: torch.Tensor | None = None, flag: torch.Tensor | None = None) -> dict:
    """The stage's passes over every bucket (as :func:`onebit.kernels.fused.adam.stage_launches`):
    ``worker`` (one launch), ``server`` (two), ``finish`` (one); ``sync``: phase 2's synchronisation;
    ``poison``, ``flag``: the agreement on the device (:func:`worker`, :func:`step`)."""
    common = (st.table, st.map, st.lo, st.hi, table.start, table.count, table.addr, table.K, table.scal)
    worker = Launch(_stage_zoa_worker_kernel, st.P,
                    (*common, st.partials, st.tickets, st.W, st.partials if poison is None else poison),
                    dict(BLOCK_BYTES=BLOCK_BYTES, FINAL_BLOCK=1024, SYNC=sync, EBF16=ebf16,
                         POISON=poison is not None), WARPS)
    finish = Launch(_stage_zoa_step_kernel, st.P,
                    (*common, st.W, clip, WORKER, st.map if flag is None else flag),
                    dict(BLOCK_BYTES=BLOCK_BYTES, GATE_BLOCK=128, SYNC=sync, FMA=fma, EBF16=ebf16,
                         GATE=flag is not None), WARPS)
    return {"worker": [worker], "server": stage.server_launches(st, ebf16), "finish": [finish]}


@jit
def _stage_zoa_wake_kernel(bt_ptr, map_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr,
                           BLOCK_BYTES: tl.constexpr):
    # ZeroOneAdam's wake after a rest: from each bucket's kept synchronisation message (column GATH) the
    # momentum m = (mean d) / nl and sync_params = p, as the synchronisation's pass wrote them
    q = tl.program_id(0)
    b, row, pid, n, N, chunk_bytes, seg_bytes, scale_word = stage.bucket(bt_ptr, map_ptr, q, stage.P0)
    idx, live, mean, in_x = stage.gathered_rows(row, pid, n, N, chunk_bytes, seg_bytes, scale_word,
                                                BLOCK_BYTES)
    for k in range(tl.load(lo_ptr + q), tl.load(hi_ptr + q)):
        off, mine = owned(idx, k, start_ptr, count_ptr)
        mine = mine & in_x
        d = denominator(addr_ptr, scal_ptr, _VAR, K, k, off, mine)
        m = tl.div_rn(mean * d, scalar(scal_ptr, k, _NL))
        tl.store(address(addr_ptr, _MOM, K, k) + off, m, mask=mine)
        p = tl.load(address(addr_ptr, _PARAM, K, k) + off, mask=mine, other=0.0)
        tl.store(address(addr_ptr, _SYNC, K, k) + off, p, mask=mine)


def wake_launches(st, table: Table) -> list:
    """The wake over every bucket of the synchronisation's stage in one launch (``table``: its columns,
    ``SYNC_ADDRESSES``, the scalars of :func:`sync_rows` with the rest's nl)."""
    return [Launch(_stage_zoa_wake_kernel, st.P, (st.table, st.map, st.lo, st.hi, table.start, table.count,
                                                 table.addr, table.K, table.scal),
                   dict(BLOCK_BYTES=BLOCK_BYTES), WARPS)]


LOCAL_BLOCK = BLOCK_BYTES * 8  # elements per program of the local step, over the tensors end to end


@jit
def _zoa_local_kernel(lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, n, clip, agreed_ptr,
                      BLOCK: tl.constexpr, GATE: tl.constexpr):
    # per tensor (laid end to end): m = b1 m + (1 - b1) g (b1 m without a gradient), then
    # p = p + (-lr) (clamp(m / d) [+ wd p]); cpu_fused.local_step_'s operations, each rounded. GATE: nothing
    # stored where the ranks' agreed poison (float32, 0 or NaN) is NaN (the step skipped on the device)
    idx, _, in_x = end_to_end_block(n, agreed_ptr, BLOCK, GATE)
    pid = tl.program_id(0)
    for k in range(tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)):
        off, mine = owned(idx, k, start_ptr, count_ptr)
        mine = mine & in_x
        ga = tl.load(addr_ptr + _GRAD * K + k)
        gp = ga.to(tl.pointer_type(tl.float32)) + off
        pp = address(addr_ptr, _PARAM, K, k) + off
        mp = address(addr_ptr, _MOM, K, k) + off
        g = tl.load(gp, mask=mine & ((off * 0 + ga) != 0), other=0.0)
        m = tl.load(mp, mask=mine, other=0.0)
        d = denominator(addr_ptr, scal_ptr, _VAR, K, k, off, mine)
        p = tl.load(pp, mask=mine, other=0.0)
        m = m * scalar(scal_ptr, k, _B1)
        m = tl.where(ga != 0, m + scalar(scal_ptr, k, _W1) * g, m)
        v = tl.div_rn(m, d)
        v = tl.minimum(tl.maximum(v, -clip, propagate_nan=tl.PropagateNan.ALL), clip,
                       propagate_nan=tl.PropagateNan.ALL)
        wd = scalar(scal_ptr, k, _WD)
        v = tl.where(wd > 0.0, v + wd * p, v)
        tl.store(mp, m, mask=mine)
        tl.store(pp, p + scalar(scal_ptr, k, _NEG_LR) * v, mask=mine)


def local_launches(table: Table, n: int, clip: float, agreed: torch.Tensor | None = None) -> list:
    t = tiles(table, -(-n // 8) * 8, LOCAL_BLOCK)
    return [Launch(_zoa_local_kernel, -(-n // LOCAL_BLOCK),
                   (t.lo, t.hi, table.start, table.count, table.addr, table.K, table.scal, n, clip,
                    table.scal if agreed is None else agreed),
                   dict(BLOCK=LOCAL_BLOCK, GATE=agreed is not None), 8)]


def local_step(table: Table, n: int, clip: float, agreed: torch.Tensor | None = None) -> None:
    """Phase 2's local step of every tensor in the table (laid end to end: n elements in all;
    ``clip``: inf for none), in one Triton launch; ``agreed``: the ranks' agreed poison on the device
    (float32, 0 or NaN: NaN leaves every tensor as it was)."""
    for launch in local_launches(table, n, clip, agreed):
        launch()


# ---- Triton, phase 1's variance step (issue 57: one launch for every bucket, gated on the device) ---

MOMENTS_ADDRESSES = ("grad", "sq", "momentum")  # per tensor its averaged gradient (its slice of its
# bucket's accumulator: zeroed as it is read), its variance and its momentum (float32; ``sq``: the table's
# ``var`` column means a stale denominator's)
MOMENTS_SCALARS = ("b1", "w1", "b2", "w2")  # b1, 1 - b1, b2, 1 - b2
_M_GRAD, _M_SQ, _M_MOM = (constexpr(MOMENTS_ADDRESSES.index(c)) for c in MOMENTS_ADDRESSES)
_M_B1, _M_W1, _M_B2, _M_W2 = (constexpr(MOMENTS_SCALARS.index(c)) for c in MOMENTS_SCALARS)


def moments_table(offsets: list[int], numels: list[int], device) -> Table:
    """The variance step's table over its tensors laid end to end."""
    return Table(offsets, numels, MOMENTS_ADDRESSES, MOMENTS_SCALARS, device)


def moments_rows(group: dict) -> tuple[float, ...]:
    """A tensor's scalars for the variance step's moments (``MOMENTS_SCALARS``), from its group."""
    b1, b2 = group["betas"]
    return (b1, 1.0 - b1, b2, 1.0 - b2)


def stale_rows(group: dict, denominator: tuple[float, float, float]) -> tuple[float, ...]:
    """A tensor's scalars for the variance step's stale step, taken by the local step's kernel with no
    gradient and ``b1 = 1`` (``m * 1`` is ``m``: its fold leaves the momentum as it is)."""
    return (1.0, 0.0, group["weight_decay"], -group["lr"], 0.0, *denominator)


@jit
def _zoa_moments_kernel(lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, n, agreed_ptr,
                        BLOCK: tl.constexpr, GATE: tl.constexpr):
    # per tensor (laid end to end; g its averaged gradient): m = b1 m + (1 - b1) g, v = b2 v + ((1 - b2) g)
    # g, each operation rounded (as the warm-up's, kernels/fused/warmup.py); g zeroed (the accumulator
    # that carried it is zero between phase 1's steps). GATE: m and v not stored where the ranks' agreed
    # poison (float32, 0 or NaN) is NaN (the step skipped on the device); g zeroed all the same
    idx, in_x, keep = end_to_end_block(n, agreed_ptr, BLOCK, GATE)
    pid = tl.program_id(0)
    for k in range(tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)):
        off, mine = owned(idx, k, start_ptr, count_ptr)
        mine = mine & in_x
        gp = address(addr_ptr, _M_GRAD, K, k) + off
        mp = address(addr_ptr, _M_MOM, K, k) + off
        vp = address(addr_ptr, _M_SQ, K, k) + off
        g = tl.load(gp, mask=mine, other=0.0)
        m = tl.load(mp, mask=mine, other=0.0)
        v = tl.load(vp, mask=mine, other=0.0)
        m = m * scalar(scal_ptr, k, _M_B1) + scalar(scal_ptr, k, _M_W1) * g
        v = v * scalar(scal_ptr, k, _M_B2) + (scalar(scal_ptr, k, _M_W2) * g) * g
        tl.store(mp, m, mask=mine & keep)
        tl.store(vp, v, mask=mine & keep)
        tl.store(gp, tl.zeros_like(g), mask=mine)


def moments_launches(table: Table, n: int, agreed: torch.Tensor | None = None) -> list:
    t = tiles(table, -(-n // 8) * 8, LOCAL_BLOCK)
    return [Launch(_zoa_moments_kernel, -(-n // LOCAL_BLOCK),
                   (t.lo, t.hi, table.start, table.count, table.addr, table.K, table.scal, n,
                    table.scal if agreed is None else agreed),
                   dict(BLOCK=LOCAL_BLOCK, GATE=agreed is not None), 8)]


def moments(table: Table, n: int, agreed: torch.Tensor | None = None) -> None:
    """The variance step's moments of every tensor in the table (laid end to end: n elements in all) in
    one Triton launch, each averaged gradient zeroed as it is read; ``agreed``: the ranks' agreed poison
    on the device (NaN: the moments left as they were)."""
    for launch in moments_launches(table, n, agreed):
        launch()


# ---- native C (kernels/fused/zero_one.c) -------------------------------------------------------

def zoa_encode_all(flat: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, C: int, n_enc: list[int],
                   n_fold: list[int], table: Table, isa: int | None = None,
                   sync: bool = False) -> list[float]:
    """Phase 1's worker pass of every chunk of a bucket: :func:`onebit.kernels.fused.adam.fold_encode_all`'s
    contract with ``x = g / d`` (0 without a gradient) encoded instead of the folded momentum and
    ``flat`` left as it is, but over each chunk's ``[j C + n_enc[j], j C + n_fold[j])``, which
    receives ``x`` (the padded rest's data, for the caller's plain encode). ``sync``: phase 2's
    synchronisation, ``x = p - sync_params``."""
    t = table
    args = (t.start.data_ptr(), t.count.data_ptr(), t.addr[0].data_ptr(), t.ptr("var"), t.ptr("param"),
            t.scal.data_ptr(), t.K, int(sync), int(e.dtype == torch.bfloat16))
    return _native.encode_all("zero_one.zoa_encode_all", library().onebit_zoa_encode_all, flat, e, bits, C,
                              n_enc, n_fold, args, isa, bfloat16_errors=True)


def zoa_step_all(bits: torch.Tensor, scales: torch.Tensor, e: torch.Tensor | None,
                 worker_scales: torch.Tensor | None, C: int, n: list[int], table: Table, clip: float,
                 isa: int | None = None, sync: bool = False) -> None:
    """Phase 1's decompress pass of every chunk of a bucket: chunk j's elements ``[j C, j C + n[j])``
    decoded (``scales[j]``), the deferred worker error from ``z = g / d + e`` (``e`` None: not
    updated), ``m = fma((1 - b1) mean, d, b1 m)`` and the stale step ``p = p - lr (clamp(m / d, -clip,
    clip) [+ wd p])`` of the tensors they cover. ``sync``: phase 2's synchronisation instead: the error
    from ``z = p - sync_params + e``, ``m = mean d / nl``, ``sync_params = sync_params + mean``, ``p =
    sync_params``."""
    _native.check_step("zero_one.zoa_step_all", bits, scales, e, worker_scales, C, n, bfloat16_errors=True)
    counts, t = _native.int64(n), table
    library().onebit_zoa_step_all(
        bits.data_ptr(), bits.stride(0), scales.data_ptr(), None if e is None else e.data_ptr(),
        None if worker_scales is None else worker_scales.data_ptr(), C, len(n), counts.data_ptr(),
        t.start.data_ptr(), t.count.data_ptr(), t.addr[0].data_ptr(), t.ptr("var"), t.ptr("momentum"),
        t.ptr("param"), t.scal.data_ptr(), t.K, -clip, clip, int(sync),
        int(e is not None and e.dtype == torch.bfloat16), _isa(isa), torch.get_num_threads())


def zoa_step_range(mean: torch.Tensor, a: int, b: int, table: Table, clip: float,
                   isa: int | None = None, sync: bool = False) -> None:
    """:func:`zoa_step_all`'s updates alone over flat elements ``[a, b)``, their decoded mean in
    ``mean`` (``b - a`` float32; a padded rest, its error updated by the caller)."""
    if not (_f32(mean) and mean.numel() == b - a and 0 <= a <= b):
        raise ValueError("zero_one.zoa_step_range: expected b - a contiguous float32 means")
    t = table
    library().onebit_zoa_step_range(mean.data_ptr(), a, b, t.start.data_ptr(), t.count.data_ptr(),
                                    t.addr[0].data_ptr(), t.ptr("var"), t.ptr("momentum"), t.ptr("param"),
                                    t.scal.data_ptr(), t.K, -clip, clip, int(sync), _isa(isa))


class NativePasses(_native.NativePasses):
    """``compressed_allreduce_passes``' worker and finish in the C passes: the worker encodes ``g / d``
    (every chunk in one C call; the padded rests through the accumulator, which it leaves zero);
    ``SYNC``: the synchronisation's. A bfloat16 worker error is read and stored by the passes themselves,
    run by run (as OnebitAdam's: :class:`onebit.kernels.fused.adam.NativePasses`)."""

    SYNC = False
    BFLOAT16_ERRORS = True

    def encode_all(self, flat, e, bits, C, n_enc, n_fold) -> list[float]:
        return zoa_encode_all(flat, e, bits, C, n_enc, n_fold, self.table, sync=self.SYNC)

    def step_all(self, bits, scales, flat, e, ws, C, n) -> None:
        zoa_step_all(bits, scales, e, ws, C, n, self.table, self.clip, sync=self.SYNC)

    def tail(self, flat, a: int, b: int) -> None:
        """A padded rest's updates from its decoded mean in the accumulator, then the accumulator zero."""
        zoa_step_range(flat[a:b], a, b, self.table, self.clip, sync=self.SYNC)
        flat[a:b].zero_()


class NativeSyncPasses(NativePasses):
    SYNC = True
