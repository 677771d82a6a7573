"""ZeroOneAdam's phase-1 compressed steps with their element-wise maths inside the CPU codec's C
passes (onebit.kernels.cpu_simd ``zoa_*``), as :mod:`onebit.optimizers._fused_cpu` does for
OnebitAdam.

The unfused step writes ``g / d`` into the accumulator, all-reduces it compressed, folds the mean
into the momentum (``m.mul_(b1).addcmul_(mean, d, value=1 - b1)``), zeroes the accumulator and takes
the stale step (``p -= lr * (clamp(m / d) [+ wd * p])``): about nine passes over memory. Here the
worker pass reads g, d and the worker error and writes only the bits (``x = g / d`` lives in a
scratch run), and the decompress pass reads g, d, e, m and p once, recomputes ``x`` for the
deferred error and writes e, m and p: 44 B per element and the server's, against about 150 with
the C codec. The accumulator stays zero (the chunks' padded rests, a few elements, go through it
with the plain path's arithmetic, as in :mod:`onebit.kernels.native.codec`).

Since the worker pass changes no state, the non-finite agreement reads its verdict from the
messages' scales (as OnebitAdam's fused step does) and a skip has nothing to restore but those
padded rests. The momentum is ``fma((1 - b1) * mean, d, b1 * m)``: what torch's ``addcmul_`` computes
on CPUs with FMA (x86 since Haswell); the error, the bits and the scales are the unfused step's
bitwise, the momentum and the parameters to float32 rounding (tests/test_fused_cpu_zoa.py).

Used where :func:`applies`: a CPU with the C passes, phase 1's compressed (not variance) steps,
the default preconditioned compression, no block scales, mesh, masks or ``overlap``, float32
contiguous parameters, gradients, denominators and momenta, more than one rank (or the
benchmarks' local collective).
"""

from __future__ import annotations

from functools import partial

import torch

from ..collectives.allreduce import compressed_allreduce
from ..kernels import backends, cpu_simd_fused
from . import _fused
from ._fused_cpu import CpuFusedCompression, _Passes


def applies(opt, reducer, pairs, phase: int = 1) -> bool:
    """Whether ``opt`` (a ZeroOneAdam in ``phase``) can take this compressed step (phase 1) or
    synchronisation (phase 2) fused."""
    return (bool(pairs) and backends.select(pairs[0][0].device, "zoa").name == "native"
            and eligible(opt, reducer, pairs, phase))


def eligible(opt, reducer, pairs, phase: int = 1) -> bool:
    """:func:`applies` but for the device: the optimizer's settings, the tensors' kinds (float32,
    contiguous, on the parameters' device) and the collective (also the GPU passes',
    optimizers/_fused_zoa.py)."""
    if not (pairs and opt.preconditioned and opt.phase == phase):
        return False
    if opt.block is not None or reducer.mesh is not None or opt._overlap is not None:
        return False
    if opt.auto_mask is not None or any(g.get("exp_avg_mask") is not None for _, g in pairs):
        return False
    local = bool(getattr(reducer.allreduce, "local_compute", False))
    if not local and (reducer.allreduce is not compressed_allreduce or reducer.world_size < 2):
        return False
    device = pairs[0][0].device

    def plain(t: torch.Tensor) -> bool:
        return _fused._plain(t) and t.device == device

    for k, (p, g) in enumerate(pairs):
        m, sync = opt.state[p].get("exp_avg"), opt.state[p].get("sync_params")
        if not plain(p) or m is None or not plain(m) or m.numel() != p.numel():
            return False
        if phase == 2 and (sync is None or not plain(sync) or sync.numel() != p.numel()):
            return False
        if p.grad is not None and (not plain(p.grad) or p.grad.shape != p.shape):
            return False
        d = opt.stale_denominator(k, p, g)
        if not plain(d) or d.numel() != p.numel():
            return False
    return True


class CpuFusedZeroOne(CpuFusedCompression):
    """The per-reducer tables and the phase-1 compressed step (``prepare``, ``abandon``, ``step``
    as :class:`CpuFusedCompression`'s; nothing to restore but the accumulator's padded rests)."""

    def _fill(self, opt, pairs, t: int, bucket, table: cpu_simd_fused.Table) -> None:
        g_addr, d_addr, m_addr, p_addr, rows = [], [], [], [], []
        for i in bucket.indices:
            p, g = pairs[i]
            g_addr.append(0 if p.grad is None else p.grad.data_ptr())
            d_addr.append(opt.stale_denominator(i, p, g).data_ptr())
            m_addr.append(opt.state[p]["exp_avg"].data_ptr())
            p_addr.append(p.data_ptr())
            b1 = g["betas"][0]
            rows.append((b1, 1.0 - b1, g["weight_decay"], -g["lr"], 0.0))
        old = table.key or (None, None)
        if old[0] != (g_addr, d_addr, m_addr, p_addr):
            for dst, src in ((table.g, g_addr), (table.d, d_addr), (table.m, m_addr), (table.p, p_addr)):
                dst.copy_(torch.tensor(src, dtype=torch.int64))
        if old[1] != rows:  # float64 rounded to float32, as torch's scalar arguments are
            table.scalars.copy_(torch.tensor(rows, dtype=torch.float64).to(torch.float32))
        table.key = ((g_addr, d_addr, m_addr, p_addr), rows)

    def _restorable(self) -> bool:
        return True  # the worker pass writes no state

    def abandon(self) -> None:
        if self.ready is None:
            return
        self.ready = None
        for b in self.reducer.buckets:
            b.flat.zero_()  # the padded rests' x (the accumulator is zero in phase 1)


class _ZoaPasses(_Passes):
    """:class:`onebit.optimizers._fused_cpu._Passes` with ZeroOneAdam's maths: the worker encodes
    ``g / d`` (every chunk in one C call; the padded rests through the accumulator)."""

    ENCODE = staticmethod(cpu_simd_fused.zoa_encode_all)

    @staticmethod
    def STEP(bits, scales, flat, e, ws, C, n, table, clip) -> None:  # noqa: N802 (as _Passes.STEP)
        """The decompress pass: the error, the momentum and the stale step (the accumulator stays zero)."""
        cpu_simd_fused.zoa_step_all(bits, scales, e, ws, C, n, table, clip)

    def tail(self, flat, a: int, b: int) -> None:
        """A padded rest's updates from its decoded mean in the accumulator, then the accumulator zero."""
        cpu_simd_fused.zoa_step_range(flat[a:b], a, b, self.table, self.clip)
        flat[a:b].zero_()


CpuFusedZeroOne.PASSES = _ZoaPasses


class CpuFusedZeroOneSync(CpuFusedZeroOne):
    """Phase 2's synchronisation (ZeroOneAdam._sync, preconditioned) in the same two passes: the
    worker encodes ``x = p - sync_params``; the decompress pass updates the error from ``x + e``, sets
    ``m = mean d / (-lrs)``, ``sync_params += mean`` and ``p = sync_params`` (the unfused step's
    operations: bitwise). The table's gradient column holds ``sync_params``, its last scalar ``-lrs``."""

    def _fill(self, opt, pairs, t: int, bucket, table: cpu_simd_fused.Table) -> None:
        index = {id(g): i for i, g in enumerate(opt.param_groups)}
        s_addr, d_addr, m_addr, p_addr, rows = [], [], [], [], []
        for i in bucket.indices:
            p, g = pairs[i]
            s_addr.append(opt.state[p]["sync_params"].data_ptr())
            d_addr.append(opt.stale_denominator(i, p, g).data_ptr())
            m_addr.append(opt.state[p]["exp_avg"].data_ptr())
            p_addr.append(p.data_ptr())
            rows.append((0.0, 0.0, 0.0, 0.0, -opt.lrs[index[id(g)]]))
        old = table.key or (None, None)
        if old[0] != (s_addr, d_addr, m_addr, p_addr):
            for dst, src in ((table.g, s_addr), (table.d, d_addr), (table.m, m_addr), (table.p, p_addr)):
                dst.copy_(torch.tensor(src, dtype=torch.int64))
        if old[1] != rows:
            table.scalars.copy_(torch.tensor(rows, dtype=torch.float64).to(torch.float32))
        table.key = ((s_addr, d_addr, m_addr, p_addr), rows)


class _ZosPasses(_ZoaPasses):
    ENCODE = staticmethod(partial(cpu_simd_fused.zoa_encode_all, sync=True))

    @staticmethod
    def STEP(bits, scales, flat, e, ws, C, n, table, clip) -> None:  # noqa: N802 (as _Passes.STEP)
        cpu_simd_fused.zoa_step_all(bits, scales, e, ws, C, n, table, clip, sync=True)

    def tail(self, flat, a: int, b: int) -> None:
        cpu_simd_fused.zoa_step_range(flat[a:b], a, b, self.table, self.clip, sync=True)
        flat[a:b].zero_()


CpuFusedZeroOneSync.PASSES = _ZosPasses
