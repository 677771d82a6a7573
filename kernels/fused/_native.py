"""What the fused steps' C passes share on the Python side: the checks and the call of a worker
pass over every chunk of a bucket, and the passes object that ``compressed_allreduce_passes`` drives
(every chunk in one C call; the chunks' padded rests, fewer than 8 W elements, with the plain path's
arithmetic in :mod:`onebit.kernels._chunks`). Each step's file gives its C calls."""

from __future__ import annotations

import torch

from .. import _chunks, cpu_simd
from ..cpu_simd import _f32, _isa
from ..layout import message_bits, message_scales


def rows_ok(bits: torch.Tensor, C: int, W: int) -> bool:
    """Whether ``bits`` is a message's [W, C / 8] rows, each contiguous."""
    return (bits.dtype == torch.uint8 and bits.dim() == 2 and bits.shape[0] == W and bits.shape[1] == C // 8
            and bits.stride(1) == 1)


def check_step(name: str, bits, scales, e, worker_scales, C: int, n: list[int], flat=None) -> None:
    """A decompress pass's arguments: bits [W, C / 8], W float32 scales, per chunk n (a multiple of
    8) <= C inside ``flat`` (if given) and ``e`` (None: no error update)."""
    W = len(n)
    if not (rows_ok(bits, C, W) and _f32(scales) and scales.numel() == W
            and all(a % 8 == 0 and 0 <= a <= C for a in n)
            and (flat is None or (_f32(flat) and all(a == 0 or j * C + a <= flat.numel()
                                                     for j, a in enumerate(n))))
            and (e is None or (_f32(e) and _f32(worker_scales) and worker_scales.numel() == W
                               and all(a == 0 or j * C + a <= e.numel() for j, a in enumerate(n))))):
        raise ValueError(f"{name}: expected bits [W, C / 8] with contiguous rows, W float32 scales, "
                         "contiguous float32 flat and e, and per chunk n (a multiple of 8) <= C")


def encode_all(name: str, fn, flat: torch.Tensor, e: torch.Tensor, bits: torch.Tensor, C: int,
               n_enc: list[int], n_fold: list[int], table_args: tuple, isa: int | None) -> list[float]:
    """The call of a worker pass over every chunk of a bucket (chunk j's ``[j C, j C + n_enc[j])``
    encoded into ``bits[j]``, its step's maths to ``j C + n_fold[j]``): each chunk's float64 sum of
    squares, its threads' partial sums added in thread order."""
    W = len(n_enc)
    if not (_f32(flat) and _f32(e) and rows_ok(bits, C, W) and len(n_fold) == W
            and all(a % 8 == 0 and 0 <= a <= b <= C and (b == 0 or (j * C + b <= flat.numel()
                                                                  and j * C + a <= e.numel()))
                    for j, (a, b) in enumerate(zip(n_enc, n_fold, strict=True)))):
        raise ValueError(f"{name}: expected contiguous float32 flat and e, bits [W, C / 8] with contiguous "
                         "rows, and per chunk n_enc (a multiple of 8) <= n_fold <= C")
    enc, fold = torch.tensor(n_enc, dtype=torch.int64), torch.tensor(n_fold, dtype=torch.int64)
    threads = torch.get_num_threads()
    sums, part = torch.empty(W, dtype=torch.float64), torch.empty(W * threads, dtype=torch.float64)
    fn(flat.data_ptr(), e.data_ptr(), bits.data_ptr(), bits.stride(0), C, W, enc.data_ptr(), fold.data_ptr(),
       sums.data_ptr(), part.data_ptr(), *table_args, _isa(isa), threads)
    return sums.tolist()


class NativePasses:
    """``compressed_allreduce_passes``' worker and finish for a fused step's C passes. A step's
    subclass gives ``encode_all(flat, e, bits, C, n_enc, n_fold)`` (the worker pass of every chunk:
    the sums), ``step_all(bits, scales, flat, e, ws, C, n)`` (the decompress pass of every chunk) and
    ``tail(flat, a, b)`` (its maths over a padded rest's decoded elements). ``msg``: the message a
    ``prepare`` already built (the worker pass then does nothing)."""

    def __init__(self, table, clip: float, msg: torch.Tensor | None = None) -> None:
        self.table, self.clip = table, clip
        self.gathered = self.layout = None
        if msg is not None:  # the prepared message (collectives._async.worker_message)
            def ready(layout):
                if msg.numel() != layout.message_bytes:
                    raise AssertionError("the prepared message does not fit the call's layout")
                return msg

            self.ready = ready

    @staticmethod
    def decode(gathered, layout, flat) -> None:
        """``flat`` = the decode of ``gathered`` (the decompress pass without the error or the step's
        maths: what ``finish`` wrote into ``flat``, bitwise)."""
        scales, bits, n = message_scales(gathered, layout), message_bits(gathered, layout), flat.numel()
        for j in range(layout.W):
            lo, mid, hi = _chunks.split(layout, n, j)
            if mid > lo:
                cpu_simd.decompress(bits[j, : (mid - lo) // 8], scales[j].view(1), flat[lo:mid], None)
            if hi > mid:
                _chunks.decode_tail(bits, scales, flat, None, None, layout, j, lo, mid, hi)

    def worker(self, flat, worker_error, layout, msg) -> None:
        """``worker_compress(update_error=False)`` of what the step encodes, no block scales, as
        :func:`onebit.kernels.native.codec.worker_compress` computes it (every chunk in one C call)."""
        n, splits = flat.numel(), [_chunks.split(layout, flat.numel(), j) for j in range(layout.W)]
        sums = self.encode_all(flat, worker_error, message_bits(msg, layout), layout.C,
                               [mid - lo for lo, mid, _ in splits],
                               [max(0, min(hi, n) - lo) for lo, _, hi in splits])

        def piece(j: int, lo: int, mid: int, hi: int) -> list:
            return [torch.tensor([sums[j]], dtype=torch.float64)] if mid > lo else []

        _chunks.encode_chunks(flat, worker_error, layout, msg, piece)

    def finish(self, gathered, layout, flat, worker_error, msg) -> None:
        """decompress (with the deferred worker error where the scales are finite) with the step's
        maths inside (every chunk in one C call, then the padded rests)."""
        self.gathered, self.layout = gathered, layout  # kept: a restore decodes them (abandon)
        scales, bits, n = message_scales(gathered, layout), message_bits(gathered, layout), flat.numel()
        update = bool(torch.isfinite(scales).all())
        s_w = message_scales(msg, layout)
        splits = [_chunks.split(layout, n, j) for j in range(layout.W)]
        e, ws = (worker_error, s_w.contiguous()) if update else (None, None)
        self.step_all(bits, scales.contiguous(), flat, e, ws, layout.C, [mid - lo for lo, mid, _ in splits])
        for j, (lo, mid, hi) in enumerate(splits):  # the padded rests: the plain path's arithmetic
            if hi == mid:
                continue
            _chunks.decode_tail(bits, scales, flat, e, s_w, layout, j, lo, mid, hi)
            if mid < n:
                self.tail(flat, mid, min(hi, n))
