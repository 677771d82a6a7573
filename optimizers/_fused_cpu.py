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
and decoded as :mod:`onebit.kernels.cpu_compiled` does, with plain torch.

Used where :func:`onebit.optimizers._fused.applies` holds on CPU parameters and
:func:`onebit.kernels.cpu_simd.available` (an x86 CPU with AVX2 or AVX-512 and a C compiler).
"""

from __future__ import annotations

import math

import torch

from ..collectives.allreduce import compressed_allreduce_passes
from ..collectives.telemetry import counting
from ..kernels import _chunks, cpu_simd
from ..kernels.layout import message_bits, message_scales


class CpuFusedCompression:
    """The per-reducer tables (one per bucket) and the step."""

    def __init__(self, reducer) -> None:
        self.reducer = reducer
        self.tables = [cpu_simd.Table(list(b.offsets), list(b.numels)) for b in reducer.buckets]

    def _fill(self, opt, pairs, t: int, bucket, table: cpu_simd.Table) -> None:
        g_addr, d_addr, p_addr, rows = [], [], [], []
        for i in bucket.indices:
            p, g = pairs[i]
            g_addr.append(0 if p.grad is None else p.grad.data_ptr())
            d_addr.append(opt.stale_denominator(i, p, g).data_ptr())
            p_addr.append(p.data_ptr())
            b1, lr, wd = g["betas"][0], g["lr"], g["weight_decay"]
            bc1 = 1.0 - b1**t if g["bias_correction"] else 1.0
            rows.append((b1, 1.0 - b1, 1.0 - lr * wd if wd else 1.0, -lr, bc1))
        table.g.copy_(torch.tensor(g_addr, dtype=torch.int64))
        table.d.copy_(torch.tensor(d_addr, dtype=torch.int64))
        table.p.copy_(torch.tensor(p_addr, dtype=torch.int64))
        table.scalars.copy_(torch.tensor(rows, dtype=torch.float64).to(torch.float32))  # cpu_fused rounds so

    def step(self, opt, pairs, t: int) -> None:
        """Fold, all-reduce and update every bucket (the compression stage's step)."""
        reducer = self.reducer
        clip = math.inf if opt.update_clip is None else float(opt.update_clip)
        local = bool(getattr(reducer.allreduce, "local_compute", False))
        for b, table in zip(reducer.buckets, self.tables, strict=True):
            if not b.numel:
                continue
            self._fill(opt, pairs, t, b, table)
            with counting(reducer.traffic):  # the call's seconds (telemetry), as compressed_mean_ counts them
                compressed_allreduce_passes(b.flat, b.worker_error, b.server_error, reducer.group,
                                            _Passes(table, clip), local=local)
            reducer.count_compressed(b)


class _Passes:
    def __init__(self, table: cpu_simd.Table, clip: float) -> None:
        self.table, self.clip = table, clip

    def worker(self, flat, worker_error, layout, msg) -> None:
        """worker_compress(update_error=False) of the folded momentum, no block scales: as
        :func:`onebit.kernels.cpu_compiled.worker_compress` computes it, the fold inside."""
        bits, n = message_bits(msg, layout), flat.numel()

        def piece(j: int, lo: int, mid: int, hi: int) -> list:
            end = min(hi, n)
            if end <= lo:
                return []
            total = cpu_simd.fold_encode(flat, worker_error, bits[j], lo, mid - lo, end - lo, self.table)
            return [torch.tensor([total], dtype=torch.float64)] if mid > lo else []

        _chunks.encode_chunks(flat, worker_error, layout, msg, piece)

    def finish(self, gathered, layout, flat, worker_error, msg) -> None:
        """decompress (with the deferred worker error where the scales are finite), the update
        of every parameter inside."""
        scales, bits, n = message_scales(gathered, layout), message_bits(gathered, layout), flat.numel()
        update = bool(torch.isfinite(scales).all())
        s_w = message_scales(msg, layout)
        for j in range(layout.W):
            lo, mid, hi = _chunks.split(layout, n, j)
            if mid > lo:
                cpu_simd.decompress_update(bits[j], scales[j].view(1), flat, worker_error if update else None,
                                           s_w[j].view(1) if update else None, lo, mid - lo, self.table,
                                           self.clip)
            if hi == mid:
                continue
            e = worker_error if update else None  # the padded rest: the plain path's arithmetic
            _chunks.decode_tail(bits, scales, flat, e, s_w, layout, j, lo, mid, hi)
            if mid < n:
                cpu_simd.update(flat, mid, min(hi, n), self.table, self.clip)
