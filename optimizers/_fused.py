"""OnebitAdam's compression stage in two fused passes per bucket on a GPU (kernels/triton_fused.py).

The fold of every gradient into the preconditioned momentum runs inside the worker pass, and
the update of every parameter inside the decompress pass: per bucket two launches instead of
about 4 per parameter, and 51.7 B of memory traffic per element at W = 4 instead of 92 (bench/
TRAFFIC.md section 3d). The all-to-all, the server and the all-gather are the collective's
(:func:`onebit.collectives.allreduce.compressed_allreduce_passes`). The maths is the plain
path's, element by element (tests/test_triton_fused.py).

Used by :class:`onebit.optimizers.OnebitAdam` where :func:`applies`: the backend selected for the
``adam`` step (:func:`onebit.kernels.backends.select`) is ``triton`` (CUDA parameters; CPU ones when
forced, for the tests under ``TRITON_INTERPRET=1``) or ``native`` (CPU parameters: the C passes of
:mod:`onebit.optimizers._fused_cpu`), the default ``compression="preconditioned"``, no block
scales, no mesh, no ``overlap``, no masks, float32 contiguous parameters and gradients, more than
one rank (or the benchmarks' local collective).
Elsewhere the optimizer takes its unfused path, with the same results.
"""

from __future__ import annotations

import math

import torch

from ..collectives.allreduce import compressed_allreduce, compressed_allreduce_passes
from ..collectives.telemetry import counting
from ..kernels import backends


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == torch.float32 and t.is_contiguous()


def applies(opt, reducer, pairs) -> bool:
    """Whether ``opt`` (an OnebitAdam) can take this compression-stage step fused."""
    if not (pairs and opt.compressing and opt.preconditioned):
        return False
    if opt.block is not None or reducer.mesh is not None:
        return False
    if opt._overlapped or opt.auto_mask is not None or any(g.get("exp_avg_mask") is not None
                                                           for _, g in pairs):
        return False
    local = bool(getattr(reducer.allreduce, "local_compute", False))
    if not local and (reducer.allreduce is not compressed_allreduce or reducer.world_size < 2):
        return False
    device = pairs[0][0].device
    name = backends.select(device, "adam").name
    if name == "plain":
        return False
    cpu = name == "native"  # the C passes (optimizers/_fused_cpu.py); else the Triton ones
    for k, (p, g) in enumerate(pairs):
        if not _plain(p) or p.device != device:
            return False
        if p.grad is not None and (not _plain(p.grad) or p.grad.shape != p.shape):
            return False
        d = opt.stale_denominator(k, p, g)  # cached: the step reads the same tensor
        if not _plain(d) or d.numel() != p.numel() or d.device != device:
            return False
    if cpu:
        return True
    if not int32_indexable(reducer):
        return False
    try:
        from ..kernels import triton_fused  # noqa: F401  (triton may be missing on a CPU machine)
    except ImportError:
        return False
    return True


def int32_indexable(reducer) -> bool:
    """Whether every bucket's padded length fits the Triton passes' int32 element indices (a
    parameter of 2^31 elements or more gets a bucket of its own: the unfused path takes it)."""
    return all(b.worker_error.numel() < 2**31 for b in reducer.buckets)


def plan(reducer):
    """The fused step's tables for ``reducer``'s buckets: the C passes' where the ``adam`` step's
    backend is native, the Triton passes' elsewhere."""
    device = reducer.buckets[0].flat.device if reducer.buckets else torch.device("cpu")
    if backends.select(device, "adam").name == "native":
        from ._fused_cpu import CpuFusedCompression

        return CpuFusedCompression(reducer)
    return FusedCompression(reducer)


def bucket_tables(reducer):
    """``(device, tiles, start, count)`` of the Triton passes over ``reducer``'s buckets: each
    bucket's program -> parameter ranges, and every parameter's offset in its bucket and size."""
    from ..kernels import triton_fused as tf

    device = reducer.buckets[0].flat.device if reducer.buckets else torch.device("cpu")
    starts, counts = [0] * len(reducer.views), [0] * len(reducer.views)
    tiles = []
    for b in reducer.buckets:
        if b.indices != list(range(b.indices[0], b.indices[0] + len(b.indices))):
            raise AssertionError("bucket indices must be consecutive")  # plan_buckets makes them so
        for i, off, size in zip(b.indices, b.offsets, b.numels, strict=True):
            starts[i], counts[i] = off, size
        tiles.append(tf.tiles(b.indices[0], b.offsets, b.numels, b.worker_error.numel(), device))
    as_i64 = dict(dtype=torch.int64, device=device)
    return device, tiles, torch.tensor(starts, **as_i64), torch.tensor(counts, **as_i64)


class FusedCompression:
    """The per-reducer tables of the fused passes (built once) and the step."""

    def __init__(self, reducer) -> None:
        from ..kernels import triton_fused as tf

        self.tf = tf
        self.reducer = reducer
        self.device, self.tiles, self.start, self.count = bucket_tables(reducer)
        self._addr_key = self._scal_key = None
        self._addr = self._scal = None

    def _tables(self, opt, pairs, t: int):
        tf = self.tf
        grads = [p.grad for p, _ in pairs]
        denoms = [opt.stale_denominator(k, p, g) for k, (p, g) in enumerate(pairs)]
        key = (tuple(0 if x is None else x.data_ptr() for x in grads) + tuple(d.data_ptr() for d in denoms)
               + tuple(p.data_ptr() for p, _ in pairs))
        if key != self._addr_key:  # the caching allocator usually hands back the same addresses
            self._addr, self._addr_key = tf.addresses(grads, denoms, [p for p, _ in pairs], self.device), key
        rows = []
        for _, g in pairs:
            b1, lr, wd = g["betas"][0], g["lr"], g["weight_decay"]
            bc1 = 1.0 - b1**t if g["bias_correction"] else 1.0
            rows.append((b1, 1.0 - b1, 1.0 - lr * wd if wd else 1.0, -lr, bc1))
        if rows != self._scal_key:
            self._scal, self._scal_key = tf.scalars(rows, self.device), rows
        return self._addr, self._scal

    def step(self, opt, pairs, t: int) -> None:
        """Fold, all-reduce and update every bucket (the compression stage's step)."""
        tf, reducer = self.tf, self.reducer
        addr, scal = self._tables(opt, pairs, t)
        clip = math.inf if opt.update_clip is None else float(opt.update_clip)
        local = getattr(reducer.allreduce, "local_compute", False)  # True or the emulated W (benchmarks)
        for b, tiles in zip(reducer.buckets, self.tiles, strict=True):
            if not b.numel:
                continue
            table = tf.Table(tiles, self.start, self.count, addr, scal)
            passes = _Passes(tf, table, clip)
            with counting(reducer.traffic):  # the call's seconds (telemetry), as compressed_mean_ counts them
                compressed_allreduce_passes(b.flat, b.worker_error, b.server_error, reducer.group, passes,
                                            local=local)
            reducer.count_compressed(b)


class _Passes:
    def __init__(self, tf, table, clip: float) -> None:
        self.tf, self.table, self.clip = tf, table, clip

    def worker(self, flat, worker_error, layout, msg) -> None:
        self.tf.fold_worker(flat, worker_error, layout, msg, self.table)

    def finish(self, gathered, layout, flat, worker_error, msg) -> None:
        self.tf.decompress_update(gathered, layout, flat, worker_error, msg, self.table, self.clip)
