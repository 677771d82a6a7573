"""OnebitAdam's warm-up update (full-precision Adam on the averaged gradient) over a bucket in one
Triton launch, gated by the ranks' agreed poison where the step agrees on the device (issue 57).

Per bucket (flat averaged gradient ``g`` and flat momentum ``m``; per tensor its variance ``v`` and
parameter ``p``; per tensor's group b1, b2, lr, wd, eps and the step's bias corrections bc1, bc2, all 1
without ``bias_correction``):

    m = m b1 + (1 - b1) g
    v = v b2 + ((1 - b2) g) g
    d = sqrt(v) / sqrt(bc2) + eps
    p = p (1 - lr wd) + (-lr / bc1) (m / d)

each operation rounded to float32 (contraction off, the division and the square root correctly
rounded; the scalars rounded to float32 as the plain ops round a Python scalar). The unfused step
(``onebit.optimizers._functional.moments_`` and ``adam_update``, or their multi-tensor twins) does the
same operations in this order, except where torch's own kernels fuse a multiply-add (CPU: ``add`` with
``alpha``; CUDA: ``addcdiv``, ``addcmul``, ``add`` with ``alpha``): a few float32 roundings apart
(tests/test_warmup_fused.py bounds it, against a float64 reference too).

``GATE``: nothing stored where the agreed poison (float32 on the device, 0 or NaN: the ranks' verdicts
summed, ``DeviceAgreement.all_reduce``) is NaN: the step skipped on the device, with no read-back.

The table (:mod:`onebit.kernels.fused.table`): address columns ``ADDRESSES`` (the variance is named
``sq``: the table's ``var`` column means a stale denominator's), scalar columns ``SCALARS``."""

from __future__ import annotations

import math

import torch

from .._triton import AVAILABLE, constexpr, jit, tl
from .table import SCALARS as _COLUMNS
from .table import Table, address, owned, scalar, tiles

if AVAILABLE:
    from ..triton_kernels import Launch

ADDRESSES = ("sq", "param")
# b1, 1 - b1, b2, 1 - b2, 1 - lr wd, -lr / bc1, sqrt(bc2), eps
SCALARS = ("b1", "w1", "b2", "w2", "decay", "step", "c2", "eps")
assert len(SCALARS) == _COLUMNS
_SQ, _PARAM = (constexpr(ADDRESSES.index(c)) for c in ADDRESSES)
_B1, _W1, _B2, _W2, _DECAY, _STEP, _C2, _EPS = (constexpr(SCALARS.index(c)) for c in SCALARS)
BLOCK = 1024  # elements per program


def table(offsets: list[int], numels: list[int], device) -> Table:
    """A bucket's table for the warm-up update."""
    return Table(offsets, numels, ADDRESSES, SCALARS, device)


def rows(group: dict, t: int) -> tuple[float, ...]:
    """A tensor's scalars at update ``t`` (``SCALARS``), from its group."""
    (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
    bc1, bc2 = (1.0 - b1**t, 1.0 - b2**t) if group["bias_correction"] else (1.0, 1.0)
    return (b1, 1.0 - b1, b2, 1.0 - b2, 1.0 - lr * wd if wd else 1.0, -lr / bc1, math.sqrt(bc2), group["eps"])


@jit
def _warmup_kernel(g_ptr, m_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, n, agreed_ptr,
                   BLOCK: tl.constexpr, GATE: tl.constexpr):
    # the module's update of the program's BLOCK flat elements; GATE: nothing done where the agreed
    # poison is NaN (a branch on a scalar: the loads and stores keep their width)
    if GATE:
        agreed = tl.load(agreed_ptr)
        if agreed == agreed:
            _update(g_ptr, m_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, n, BLOCK)
    else:
        _update(g_ptr, m_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, n, BLOCK)


@jit
def _update(g_ptr, m_ptr, lo_ptr, hi_ptr, start_ptr, count_ptr, addr_ptr, K, scal_ptr, n,
            BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # int32 indices: the caller keeps n < 2^31
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    in_x = idx < n
    g = tl.load(g_ptr + idx, mask=in_x, other=0.0)
    m = tl.load(m_ptr + idx, mask=in_x, other=0.0)
    b1 = tl.zeros([BLOCK], dtype=tl.float32)
    w1 = tl.zeros([BLOCK], dtype=tl.float32)
    lo, hi = tl.load(lo_ptr + pid), tl.load(hi_ptr + pid)
    for k in range(lo, hi):  # each element's b1 and 1 - b1 (its tensor's): the momentum in one store
        off, mine = owned(idx, k, start_ptr, count_ptr)
        b1 = tl.where(mine, scalar(scal_ptr, k, _B1), b1)
        w1 = tl.where(mine, scalar(scal_ptr, k, _W1), w1)
    m = m * b1 + w1 * g
    tl.store(m_ptr + idx, m, mask=in_x)
    for k in range(lo, hi):
        off, mine = owned(idx, k, start_ptr, count_ptr)
        mine = mine & in_x
        vp = address(addr_ptr, _SQ, K, k) + off
        pp = address(addr_ptr, _PARAM, K, k) + off
        v = tl.load(vp, mask=mine, other=0.0)
        v = v * scalar(scal_ptr, k, _B2) + (scalar(scal_ptr, k, _W2) * g) * g
        d = tl.div_rn(tl.sqrt_rn(v), scalar(scal_ptr, k, _C2)) + scalar(scal_ptr, k, _EPS)
        p = tl.load(pp, mask=mine, other=0.0)
        p = p * scalar(scal_ptr, k, _DECAY) + scalar(scal_ptr, k, _STEP) * tl.div_rn(m, d)
        tl.store(vp, v, mask=mine)
        tl.store(pp, p, mask=mine)


def launches(g: torch.Tensor, m: torch.Tensor, n: int, table: Table,
             agreed: torch.Tensor | None = None) -> list:
    """The update of one bucket (``g``, ``m``: its n flat float32 elements) in one launch; ``agreed``:
    the gate (see the module)."""
    t = tiles(table, -(-n // 8) * 8, BLOCK)
    return [Launch(_warmup_kernel, -(-n // BLOCK),
                   (g, m, t.lo, t.hi, table.start, table.count, table.addr, table.K, table.scal, n,
                    table.scal if agreed is None else agreed),
                   dict(BLOCK=BLOCK, GATE=agreed is not None), 8)]


def update(g: torch.Tensor, m: torch.Tensor, table: Table, agreed: torch.Tensor | None = None) -> None:
    """The warm-up update of one bucket (see the module)."""
    for launch in launches(g, m, m.numel(), table, agreed):
        launch()
