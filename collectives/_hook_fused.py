"""The DDP hook's ``freeze_step`` passes (docs/ALGORITHMS.md 8.2) inside the CPU codec's C passes.

Unfused, a compressed iteration of ``onebit_compress_hook`` with ``freeze_step`` makes four passes
over each bucket on this rank: the pre-pass ``x = (g + k m) / d`` (with the local gradient norm),
the worker's encode of ``x + e``, decompress (the deferred worker error and the decode), and the
post-pass ``g~ = out d - k m``. Here the pre-pass runs inside the encode and the post-pass inside
decompress, run by run of about 4096 elements while they are in cache
(:func:`onebit.kernels.cpu_simd_fused.hook_encode`, :func:`~onebit.kernels.cpu_simd_fused.hook_decompress`),
as :mod:`onebit.optimizers._fused_cpu` does for OnebitAdam: two passes instead of four. The
element-wise maths and its order are the unfused passes', so the bucket, the bits and the error
buffers are bitwise the unfused hook's; the local norm's float64 sum of exact squares is added in
another order (tests/test_hook_fused.py). The all-to-all, the server and the all-gather are the
collective's (:func:`onebit.collectives.allreduce.compressed_allreduce_passes`, ``async_op``).

Used where the ``hook`` step's backend on CPU is native (:func:`onebit.kernels.backends.select`), for
float32 buckets whose momenta are contiguous float32 CPU tensors; ``use_backend("plain",
steps=["hook"])`` (tests, A/B) keeps the unfused passes.
"""

from __future__ import annotations

import torch

from ..kernels import _chunks, backends, cpu_simd_fused
from ..kernels.layout import message_bits, message_scales


def applies(buffer: torch.Tensor, d: torch.Tensor, parts: list) -> bool:
    """Whether :class:`HookPasses` takes this bucket (``parts`` as ``frozen_terms`` gives them)."""
    def f32(t: torch.Tensor) -> bool:
        return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()

    return (bool(parts) and f32(buffer) and f32(d) and d.numel() == buffer.numel()
            and all(f32(m) and m.numel() == hi - lo for lo, hi, m, _ in parts)
            and backends.select(buffer.device, "hook").name == "native")


class HookPasses:
    """The worker and decompress passes of one bucket's call (``compressed_allreduce_passes``'s
    protocol); the worker counts the bucket into ``fa``'s local norm."""

    def __init__(self, d: torch.Tensor, parts: list, fa) -> None:
        parts = sorted(parts, key=lambda part: part[0])
        self.table = cpu_simd_fused.hook_table_fill(cpu_simd_fused.hook_table(parts), d)
        self.alive = (d, [m for _, _, m, _ in parts])  # the addresses in the table, until the call ends
        self.fa = fa

    def worker(self, flat: torch.Tensor, worker_error: torch.Tensor, layout, msg: torch.Tensor) -> None:
        """The pre-pass and ``worker_compress(update_error=False)``, as the native codec computes it."""
        bits, n, sq = message_bits(msg, layout), flat.numel(), [0.0]

        def piece(j: int, lo: int, mid: int, hi: int) -> list:
            sums = []
            if mid > lo:
                got, q = cpu_simd_fused.hook_encode(flat, worker_error, bits[j], lo, mid - lo, layout.block,
                                                    self.table)
                sums.append(got if layout.block else torch.tensor([got], dtype=torch.float64))
                sq[0] += q
            if min(hi, n) > mid:  # the padded chunk's data tail: the pre-pass alone, then the plain encode
                sq[0] += cpu_simd_fused.hook_pre_range(flat, mid, min(hi, n), self.table)
            return sums

        _chunks.encode_chunks(flat, worker_error, layout, msg, piece)
        self.fa.add_local(flat, sq[0])

    def finish(self, gathered: torch.Tensor, layout, flat: torch.Tensor, worker_error: torch.Tensor,
               msg: torch.Tensor) -> None:
        """decompress (the deferred worker error where the scales are finite) and the post-pass."""
        scales, bits, n = message_scales(gathered, layout), message_bits(gathered, layout), flat.numel()
        update = bool(torch.isfinite(scales).all())
        s_w = message_scales(msg, layout) if update else None
        piece = _chunks.piece_scales
        for j in range(layout.W):
            lo, mid, hi = _chunks.split(layout, n, j)
            if mid > lo:
                cpu_simd_fused.hook_decompress(bits[j], piece(scales, layout, j, lo, lo, mid), flat,
                                               worker_error if update else None,
                                               piece(s_w, layout, j, lo, lo, mid) if update else None,
                                               lo, mid - lo, layout.block, self.table)
            if hi == mid:
                continue
            e = worker_error if update else None  # the padded rest: the plain path's arithmetic
            _chunks.decode_tail(bits, scales, flat, e, s_w, layout, j, lo, mid, hi)
            if mid < n:
                cpu_simd_fused.hook_post_range(flat, mid, min(hi, n), self.table)
