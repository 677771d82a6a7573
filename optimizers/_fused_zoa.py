"""ZeroOneAdam's phase-1 compressed steps in two fused Triton passes per bucket on a GPU
(kernels/triton_fused_zoa.py), as :mod:`onebit.optimizers._fused` does for OnebitAdam: the worker
pass reads the gradients, denominators and the worker error and writes only the message; the
decompress pass updates the error, the momenta and the parameters. 12 + 28 B per element and the
server's instead of about 104 at W = 4, and two launches per bucket instead of about nine per
parameter. The accumulator is not touched (zero in phase 1).

Used by :class:`onebit.optimizers.ZeroOneAdam` where :func:`applies`: the ``zoa`` step's backend is
``triton`` (CUDA parameters; CPU ones when forced, for the tests under ``TRITON_INTERPRET=1``) and what
:func:`onebit.optimizers._fused_cpu_zoa.eligible` asks of the optimizer and its tensors.
"""

from __future__ import annotations

import math

import torch

from ..collectives.allreduce import compressed_allreduce_passes
from ..collectives.telemetry import counting
from ..kernels import backends
from . import _fused
from ._fused_cpu_zoa import eligible


def applies(opt, reducer, pairs, phase: int = 1) -> bool:
    """Whether ``opt`` (a ZeroOneAdam in ``phase``) can take this compressed step (phase 1) or
    synchronisation (phase 2) in the GPU passes."""
    if not pairs:
        return False
    device = pairs[0][0].device
    if backends.select(device, "zoa").name != "triton":
        return False
    if not (eligible(opt, reducer, pairs, phase) and _fused.int32_indexable(reducer)):
        return False
    try:
        from ..kernels import triton_fused_zoa  # noqa: F401  (triton may be missing)
    except ImportError:
        return False
    return True


class FusedZeroOne:
    """The per-reducer tables of the GPU passes (built once) and the step."""

    SYNC = False

    def __init__(self, reducer) -> None:
        from ..kernels import triton_fused_zoa as tz

        self.tz, self.reducer = tz, reducer
        self.device, self.tiles, self.start, self.count = _fused.bucket_tables(reducer)
        self._addr_key = self._scal_key = self._addr = self._scal = None

    def _inputs(self, opt, pairs) -> list:
        """The table's GRAD row: the gradients (phase 1's x = g / d)."""
        return [p.grad for p, _ in pairs]

    def _rows(self, opt, pairs) -> list:
        return [(g["betas"][0], 1.0 - g["betas"][0], g["weight_decay"], -g["lr"]) for _, g in pairs]

    def _tables(self, opt, pairs):
        tz = self.tz
        grads = self._inputs(opt, pairs)
        denoms = [opt.stale_denominator(k, p, g) for k, (p, g) in enumerate(pairs)]
        moms = [opt.state[p]["exp_avg"] for p, _ in pairs]
        key = tuple(0 if x is None else x.data_ptr() for x in grads) + tuple(
            t.data_ptr() for t in (*denoms, *(p for p, _ in pairs), *moms))
        if key != self._addr_key:  # the caching allocator usually hands back the same addresses
            self._addr = tz.addresses(grads, denoms, [p for p, _ in pairs], moms, self.device)
            self._addr_key = key
        rows = self._rows(opt, pairs)
        if rows != self._scal_key:
            self._scal, self._scal_key = tz.scalars(rows, self.device), rows
        return self._addr, self._scal

    def step(self, opt, pairs, t: int) -> None:
        """The compressed mean of every bucket's g / d, the fold and the stale step."""
        tz, reducer = self.tz, self.reducer
        addr, scal = self._tables(opt, pairs)
        clip = math.inf if opt.update_clip is None else float(opt.update_clip)
        local = getattr(reducer.allreduce, "local_compute", False)  # True or the emulated W (benchmarks)
        for b, tiles in zip(reducer.buckets, self.tiles, strict=True):
            if not b.numel:
                continue
            passes = _Passes(tz, tz.Table(tiles, self.start, self.count, addr, scal), clip, self.SYNC)
            with counting(reducer.traffic):
                compressed_allreduce_passes(b.flat, b.worker_error, b.server_error, reducer.group, passes,
                                            local=local)
            reducer.count_compressed(b)


class FusedZeroOneSync(FusedZeroOne):
    """Phase 2's synchronisation (ZeroOneAdam._sync, preconditioned) in the same two passes: the
    worker encodes x = p - sync_params; the decompress pass updates the error from x + e and sets
    m = (mean d) / (-lrs), sync_params += mean and p = sync_params (the unfused ops, each rounded:
    bitwise). The table's GRAD row holds sync_params, its NEG_LR row -lrs."""

    SYNC = True

    def _inputs(self, opt, pairs) -> list:
        return [opt.state[p]["sync_params"] for p, _ in pairs]

    def _rows(self, opt, pairs) -> list:
        index = {id(g): i for i, g in enumerate(opt.param_groups)}
        return [(g["betas"][0], 1.0 - g["betas"][0], g["weight_decay"], -opt.lrs[index[id(g)]])
                for _, g in pairs]


class _Passes:
    def __init__(self, tz, table, clip: float, sync: bool) -> None:
        self.tz, self.table, self.clip, self.sync = tz, table, clip, sync

    def worker(self, flat, worker_error, layout, msg) -> None:
        self.tz.worker(worker_error, flat.numel(), layout, msg, self.table, self.sync)

    def finish(self, gathered, layout, flat, worker_error, msg) -> None:
        self.tz.step(gathered, layout, worker_error, msg, flat.numel(), self.table, self.clip, self.sync)


def local_applies(opt, pairs, masks) -> bool:
    """Whether ``opt``'s phase-2 local step can run as one Triton launch (kernels/triton_fused_zoa.py
    ``local_step``): the ``local`` step's backend is ``triton`` (CUDA parameters, or forced), the
    default maths, no dead-coordinate masks, float32 contiguous parameters, momenta, gradients and
    denominators on one device, fewer than 2^31 elements in all."""
    if not pairs or opt._reference_maths() or any(d is not None for d in masks):
        return False
    device = pairs[0][0].device
    if backends.select(device, "local").name != "triton":
        return False

    def plain(t) -> bool:
        return _fused._plain(t) and t.device == device

    total = 0
    for k, (p, g) in enumerate(pairs):
        m, d = opt.state[p].get("exp_avg"), opt.stale_denominator(k, p, g)
        if not (plain(p) and m is not None and plain(m) and m.numel() == p.numel() and plain(d)
                and d.numel() == p.numel()):
            return False
        if p.grad is not None and (not plain(p.grad) or p.grad.shape != p.shape):
            return False
        total += p.numel()
    if total >= 2**31:
        return False
    try:
        from ..kernels import triton_fused_zoa  # noqa: F401
    except ImportError:
        return False
    return True


class FusedLocalStep:
    """Phase 2's local step as one launch over every parameter. Its tables are rebuilt only where
    they change: the programs' ranges with the tensors' sizes, the addresses with a tensor's
    (gradients are new tensors each step, usually at the same addresses), the scalars with a group's."""

    def __init__(self) -> None:
        from ..kernels import triton_fused as tf
        from ..kernels import triton_fused_zoa as tz

        self.tf, self.tz = tf, tz
        self._sizes = self._layout = None
        self._addr_key = self._addr = self._rows = self._scal = None

    def step(self, opt, pairs) -> None:
        tz, tf = self.tz, self.tf
        device = pairs[0][0].device
        params = [p for p, _ in pairs]
        sizes = [p.numel() for p in params]
        if sizes != self._sizes:
            offsets = [0]
            for s in sizes[:-1]:
                offsets.append(offsets[-1] + s)
            n = sum(sizes)
            as_i64 = dict(dtype=torch.int64, device=device)
            tiles = tf.tiles(0, offsets, sizes, -(-n // 8) * 8, device)
            self._layout = (tiles, torch.tensor(offsets, **as_i64), torch.tensor(sizes, **as_i64), n)
            self._sizes = sizes
        grads = [p.grad for p in params]
        denoms = [opt.stale_denominator(k, p, g) for k, (p, g) in enumerate(pairs)]
        moms = [opt.state[p]["exp_avg"] for p in params]
        key = tuple(0 if x is None else x.data_ptr() for x in grads) + tuple(
            t.data_ptr() for t in (*denoms, *params, *moms))
        if key != self._addr_key:
            self._addr, self._addr_key = tz.addresses(grads, denoms, params, moms, device), key
        rows = [(g["betas"][0], 1.0 - g["betas"][0], g["weight_decay"], -g["lr"]) for _, g in pairs]
        if rows != self._rows:
            self._scal, self._rows = tz.scalars(rows, device), rows
        tiles, start, count, n = self._layout
        clip = math.inf if opt.update_clip is None else float(opt.update_clip)
        tz.local_step(tz.Table(tiles, start, count, self._addr, self._scal), n, clip)
