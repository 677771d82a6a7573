"""OnebitAdam's compression stage with its element-wise maths inside the CPU codec's C passes
(onebit.kernels.cpu_simd), as :mod:`onebit.optimizers._fused` does with Triton on a GPU.

The fold of every gradient into the preconditioned momentum runs inside the worker's encode, run
by run of 4096 elements while they are in cache, and the update of every parameter inside
decompress: per bucket one pass over the gradients, denominators and momentum before the
all-to-all and one over the parameters after the all-gather, instead of a compiled pass per
parameter on each side. The all-to-all, the server and the all-gather are the collective's
(:func:`onebit.collectives.allreduce.compressed_allreduce_passes`). The maths and its order are
:mod:`onebit.kernels.cpu_fused`'s, so the momentum and the error buffers are bitwise those of the
unfused step and the parameters too where the unfused step runs the compiled update (tensors from
its ``MIN_NUMEL`` elements; below, the plain ops round ``p + (-lr) * step`` once: one float32
ulp) (tests/test_cpu_fused.py). The chunks' padded tails (fewer than 8 W elements) are encoded
and decoded as :mod:`onebit.kernels.native.codec` does, with plain torch.

Used where :func:`onebit.optimizers._fused.applies` holds on CPU parameters and
:func:`onebit.kernels.cpu_simd.available` (an x86 CPU with AVX2 or AVX-512 and a C compiler).
"""

from __future__ import annotations

import math

import torch

from ..collectives.allreduce import compressed_allreduce_passes
from ..collectives.telemetry import counting
from ..kernels import _chunks, cpu_simd, cpu_simd_fused
from ..kernels.layout import Layout, empty_message, message_bits, message_scales


def prepared_verdict(opt, plan, pairs) -> bool | None:
    """``plan.prepare`` for ``opt``'s next step, and with it this rank's verdict on its gradients
    (those of the groups that are not compressed read as before); None: not prepared."""
    others = [p.grad for g in opt.param_groups if g.get("non_freeze", False) for p in g["params"]
              if p.grad is not None]
    ok = plan.prepare(opt, pairs, opt.updates + 1)
    if ok is None or not others:
        return ok
    return ok and opt._grads_finite(others)


class CpuFusedCompression:
    """The per-reducer tables (one per bucket) and the step.

    The step's first phase (``prepare``: every bucket folded and encoded, nothing sent) can run
    before the ranks agree that the gradients are finite, the agreement reading its verdict from
    the messages' scales instead of a pass over the gradients: a non-finite gradient makes its
    chunk's float64 sum of squares non-finite. It overwrites only the momentum, which ``abandon``
    restores bitwise where the ranks then skip the step: after a fused compression step the
    momentum is exactly the decode of that step's gathered message (sign times its chunk's scale),
    kept per bucket (1/32 of the momentum's bytes). ``prepare`` declines (None) where that does
    not hold: before the first fused step, or once anything else has written the momentum
    (``flat._version``: a checkpoint's load, an unfused step)."""

    def __init__(self, reducer) -> None:
        self.reducer = reducer
        self.tables = [cpu_simd_fused.Table(list(b.offsets), list(b.numels)) for b in reducer.buckets]
        self.last: list = [None] * len(reducer.buckets)  # (gathered, layout, flat._version) per bucket
        self.ready: list | None = None  # the prepared messages, until step or abandon

    def _fill(self, opt, pairs, t: int, bucket, table: cpu_simd_fused.Table) -> None:
        g_addr, d_addr, p_addr, rows = [], [], [], []
        for i in bucket.indices:
            p, g = pairs[i]
            g_addr.append(0 if p.grad is None else p.grad.data_ptr())
            d_addr.append(opt.stale_denominator(i, p, g).data_ptr())
            p_addr.append(p.data_ptr())
            b1, lr, wd = g["betas"][0], g["lr"], g["weight_decay"]
            bc1 = 1.0 - b1**t if g["bias_correction"] else 1.0
            rows.append((b1, 1.0 - b1, 1.0 - lr * wd if wd else 1.0, -lr, bc1))
        old = table.key or (None, None)  # what the last step filled in: usually the same tensors
        if old[0] != (g_addr, d_addr, p_addr):
            table.g.copy_(torch.tensor(g_addr, dtype=torch.int64))
            table.d.copy_(torch.tensor(d_addr, dtype=torch.int64))
            table.p.copy_(torch.tensor(p_addr, dtype=torch.int64))
        if old[1] != rows:  # float64 rounded to float32, as cpu_fused rounds them
            table.scalars.copy_(torch.tensor(rows, dtype=torch.float64).to(torch.float32))
        table.key = ((g_addr, d_addr, p_addr), rows)

    def forget(self) -> None:
        """The momentum was written elsewhere (the unfused step): no message restores it now."""
        self.last = [None] * len(self.reducer.buckets)

    def _restorable(self) -> bool:
        return all(last is not None and last[2] == b.flat._version
                   for b, last in zip(self.reducer.buckets, self.last, strict=True) if b.numel)

    def _W(self) -> int:
        local = getattr(self.reducer.allreduce, "local_compute", False)  # True or the emulated W
        return int(local) if local else self.reducer.world_size

    def prepare(self, opt, pairs, t: int) -> bool | None:
        """Fold and encode every bucket for step ``t``; returns whether this rank's gradients are
        all finite, or None (nothing done) where the momentum could not be restored."""
        if not self._restorable():
            return None
        W, ready, finite = self._W(), [], True
        self.ready = ready  # filled bucket by bucket: abandon undoes a prepare that raised halfway
        for b, table in zip(self.reducer.buckets, self.tables, strict=True):
            if not b.numel:
                ready.append(None)
                continue
            self._fill(opt, pairs, t, b, table)
            layout = Layout(b.worker_error.numel(), W, None)
            msg = empty_message(layout, W, b.flat.device)
            self.PASSES(table, 0.0).worker(b.flat, b.worker_error, layout, msg)
            finite = finite and bool(torch.isfinite(message_scales(msg, layout)).all())
            ready.append(msg)
        if finite:
            return True
        # a non-finite sum: a non-finite gradient, or finite ones whose fold overflowed (the
        # exact test decides, as the unfused check's does)
        return all(bool(torch.isfinite(p.grad).all()) for p, _ in pairs if p.grad is not None)

    def abandon(self) -> None:
        """The ranks skip the prepared step: every momentum bucket back to what it was."""
        if self.ready is None:
            return
        self.ready = None
        for k, (b, last) in enumerate(zip(self.reducer.buckets, self.last, strict=True)):
            if b.numel:
                gathered, layout, _ = last
                _Passes.decode(gathered, layout, b.flat)
                self.last[k] = (gathered, layout, b.flat._version)

    def step(self, opt, pairs, t: int) -> None:
        """Fold, all-reduce and update every bucket (the compression stage's step); the fold and
        encode already done where ``prepare`` ran."""
        reducer, ready = self.reducer, self.ready
        self.ready = None
        clip = math.inf if opt.update_clip is None else float(opt.update_clip)
        local = getattr(reducer.allreduce, "local_compute", False)  # True or the emulated W (benchmarks)
        for k, (b, table) in enumerate(zip(reducer.buckets, self.tables, strict=True)):
            if not b.numel:
                continue
            if ready is None:
                self._fill(opt, pairs, t, b, table)
            passes = self.PASSES(table, clip, None if ready is None else ready[k])
            with counting(reducer.traffic):  # the call's seconds (telemetry), as compressed_mean_ counts them
                compressed_allreduce_passes(b.flat, b.worker_error, b.server_error, reducer.group,
                                            passes, local=local)
            reducer.count_compressed(b)
            self.last[k] = (passes.gathered, passes.layout, b.flat._version)


class _Passes:
    ENCODE = staticmethod(cpu_simd_fused.fold_encode_all)  # the worker pass over every chunk
    STEP = staticmethod(cpu_simd_fused.decompress_update_all)  # the decompress pass over every chunk
    def __init__(self, table: cpu_simd_fused.Table, clip: float, msg: torch.Tensor | None = None) -> None:
        self.table, self.clip = table, clip
        self.gathered = self.layout = None
        if msg is not None:  # the message prepare built (collectives._async.worker_message)
            def ready(layout):
                if msg.numel() != layout.message_bytes:
                    raise AssertionError("the prepared message does not fit the call's layout")
                return msg

            self.ready = ready

    @staticmethod
    def decode(gathered, layout, flat) -> None:
        """``flat`` = the decode of ``gathered`` (the update's first half without the error or the
        update: what ``finish`` wrote into ``flat``, bitwise)."""
        scales, bits, n = message_scales(gathered, layout), message_bits(gathered, layout), flat.numel()
        for j in range(layout.W):
            lo, mid, hi = _chunks.split(layout, n, j)
            if mid > lo:
                cpu_simd.decompress(bits[j, : (mid - lo) // 8], scales[j].view(1), flat[lo:mid], None)
            if hi > mid:
                _chunks.decode_tail(bits, scales, flat, None, None, layout, j, lo, mid, hi)

    def worker(self, flat, worker_error, layout, msg) -> None:
        """worker_compress(update_error=False) of the folded momentum, no block scales: as
        :func:`onebit.kernels.native.codec.worker_compress` computes it, the fold inside (every
        chunk in one C call)."""
        n, splits = flat.numel(), [_chunks.split(layout, flat.numel(), j) for j in range(layout.W)]
        sums = self.ENCODE(flat, worker_error, message_bits(msg, layout), layout.C,
                           [mid - lo for lo, mid, _ in splits],
                           [max(0, min(hi, n) - lo) for lo, _, hi in splits], self.table)

        def piece(j: int, lo: int, mid: int, hi: int) -> list:
            return [torch.tensor([sums[j]], dtype=torch.float64)] if mid > lo else []

        _chunks.encode_chunks(flat, worker_error, layout, msg, piece)

    def finish(self, gathered, layout, flat, worker_error, msg) -> None:
        """decompress (with the deferred worker error where the scales are finite), the update
        of every parameter inside (every chunk in one C call, then the padded rests)."""
        self.gathered, self.layout = gathered, layout  # kept: the momentum is their decode (abandon)
        scales, bits, n = message_scales(gathered, layout), message_bits(gathered, layout), flat.numel()
        update = bool(torch.isfinite(scales).all())
        s_w = message_scales(msg, layout)
        splits = [_chunks.split(layout, n, j) for j in range(layout.W)]
        e, ws = (worker_error, s_w.contiguous()) if update else (None, None)
        self.STEP(bits, scales.contiguous(), flat, e, ws, layout.C, [mid - lo for lo, mid, _ in splits],
                  self.table, self.clip)
        # the padded rests: the plain path's arithmetic
        for j, (lo, mid, hi) in enumerate(splits):
            if hi == mid:
                continue
            _chunks.decode_tail(bits, scales, flat, e, s_w, layout, j, lo, mid, hi)
            if mid < n:
                self.tail(flat, mid, min(hi, n))

    def tail(self, flat, a: int, b: int) -> None:
        """The update of flat elements [a, b) (a padded rest's data, decoded)."""
        cpu_simd_fused.update(flat, a, b, self.table, self.clip)


CpuFusedCompression.PASSES = _Passes
