"""What the fused steps' C passes share on the Python side: the checks and the call of a worker
pass over every chunk of a bucket, and the passes object that ``compressed_allreduce_passes`` drives
(every chunk in one C call; the chunks' padded rests, fewer than 8 W elements, with the plain path's
arithmetic in :mod:`onebit.kernels._chunks`). Each step's file gives its C calls."""

from __future__ import annotations

import functools
import math
import threading

import torch

from .. import _chunks, cpu_simd
from ..cpu_simd import _f32, _isa
from ..layout import message_bits, message_scales


@functools.lru_cache(maxsize=4096)
def _int64(values: tuple[int, ...]) -> torch.Tensor:
    """``values`` as an int64 CPU tensor, made once per tuple (the C reads it; nothing writes it)."""
    return torch.tensor(values, dtype=torch.int64)


def int64(values) -> torch.Tensor:
    """The per-chunk counts a C pass reads, as a cached int64 tensor (never written)."""
    return _int64(tuple(values))


def rows_ok(bits: torch.Tensor, C: int, W: int) -> bool:
    """Whether ``bits`` is a message's [W, C / 8] rows, each contiguous."""
    return (bits.dtype == torch.uint8 and bits.dim() == 2 and bits.shape[0] == W and bits.shape[1] == C // 8
            and bits.stride(1) == 1)


def _error_ok(e: torch.Tensor, bfloat16_errors: bool) -> bool:
    """A contiguous float32 error buffer (bfloat16 too where the pass reads and stores that)."""
    return _f32(e) or (bfloat16_errors and e.dtype == torch.bfloat16 and e.is_contiguous()
                       and e.device.type == "cpu")


def check_step(name: str, bits, scales, e, worker_scales, C: int, n: list[int], flat=None,
               bfloat16_errors: bool = False) -> None:
    """A decompress pass's arguments: bits [W, C / 8], W float32 scales, per chunk n (a multiple of
    8) <= C inside ``flat`` (if given) and ``e`` (None: no error update; bfloat16 where
    ``bfloat16_errors``)."""
    W = len(n)
    if not (rows_ok(bits, C, W) and _f32(scales) and scales.numel() == W
            and all(a % 8 == 0 and 0 <= a <= C for a in n)
            and (flat is None or (_f32(flat) and all(a == 0 or j * C + a <= flat.numel()
                                                     for j, a in enumerate(n))))
            and (e is None or (_error_ok(e, bfloat16_errors) and _f32(worker_scales)
                               and worker_scales.numel() == W
                               and all(a == 0 or j * C + a <= e.numel() for j, a in enumerate(n))))):
        raise ValueError(f"{name}: expected bits [W, C / 8] with contiguous rows, W float32 scales, "
                         "contiguous float32 flat and e, and per chunk n (a multiple of 8) <= C")


def encode_all(name: str, fn, flat: torch.Tensor | None, e: torch.Tensor, bits: torch.Tensor, C: int,
               n_enc: list[int], n_fold: list[int], table_args: tuple, isa: int | None,
               n: int | None = None, bfloat16_errors: bool = False) -> list[float]:
    """The call of a worker pass over every chunk of a bucket (chunk j's ``[j C, j C + n_enc[j])``
    encoded into ``bits[j]``, its step's maths to ``j C + n_fold[j]``): each chunk's float64 sum of
    squares, its threads' partial sums added in thread order. ``flat`` None: the pass holds no float
    values (a momentum kept as a message, in ``table_args``), the bucket's ``n`` elements."""
    W = len(n_enc)
    size = flat.numel() if flat is not None else n
    if not ((flat is None or _f32(flat)) and size is not None and _error_ok(e, bfloat16_errors)
            and rows_ok(bits, C, W)
            and len(n_fold) == W
            and all(a % 8 == 0 and 0 <= a <= b <= C and (b == 0 or (j * C + b <= size
                                                                  and j * C + a <= e.numel()))
                    for j, (a, b) in enumerate(zip(n_enc, n_fold, strict=True)))):
        raise ValueError(f"{name}: expected contiguous float32 flat and e, bits [W, C / 8] with contiguous "
                         "rows, and per chunk n_enc (a multiple of 8) <= n_fold <= C")
    enc, fold = int64(n_enc), int64(n_fold)
    threads = torch.get_num_threads()
    sums, part = _sums(W, threads)
    fn(None if flat is None else flat.data_ptr(), e.data_ptr(), bits.data_ptr(), bits.stride(0), C, W,
       enc.data_ptr(), fold.data_ptr(), sums.data_ptr(), part.data_ptr(), *table_args, _isa(isa), threads)
    return sums.tolist()


_scratch = threading.local()  # ctypes lets go of the GIL: one set of sums per thread


def _sums(W: int, threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's float64 ``sums`` [W] and per-thread partial sums [W threads] for a worker pass,
    made once per (W, threads): the C writes them, the caller reads ``sums`` before the next pass."""
    cache = _scratch.__dict__.setdefault("sums", {})
    found = cache.get((W, threads))
    if found is None:
        found = cache[(W, threads)] = (torch.empty(W, dtype=torch.float64),
                                       torch.empty(W * threads, dtype=torch.float64))
    return found


class Tails:
    """A bucket's values where only its padded rests' data (fewer than 8 elements per chunk, at
    ``[mid, min(hi, n))`` of :func:`onebit.kernels._chunks.split`) are held, 8 floats per chunk: what
    the padded rests' code reads and writes in place of the flat buffer where the fused passes hold
    no float values (a momentum kept as a message)."""

    def __init__(self, layout, n: int) -> None:
        self.n, self.values = n, torch.zeros(8 * layout.W, dtype=torch.float32)
        self.starts = {mid: j for j, (_, mid, _) in enumerate(_chunks.splits(layout, n))}

    def numel(self) -> int:
        return self.n

    def _part(self, key: slice) -> torch.Tensor:
        j = self.starts.get(key.start)
        if j is None or key.stop - key.start > 8 or key.step not in (None, 1):
            raise IndexError(f"Tails: [{key.start}, {key.stop}) is not a padded rest's data")
        return self.values[8 * j : 8 * j + key.stop - key.start]

    def __getitem__(self, key: slice) -> torch.Tensor:
        return self._part(key)

    def __setitem__(self, key: slice, value) -> None:
        self._part(key).copy_(value)


class NativePasses:
    """``compressed_allreduce_passes``' worker and finish for a fused step's C passes. A step's
    subclass gives ``encode_all(flat, e, bits, C, n_enc, n_fold)`` (the worker pass of every chunk:
    the sums), ``step_all(bits, scales, flat, e, ws, C, n)`` (the decompress pass of every chunk) and
    ``tail(values, a, b)`` (its maths over a padded rest's decoded elements ``values[a:b]``). ``msg``:
    the message a ``prepare`` already built (the worker pass then does nothing). ``kept``: the
    ``(gathered, layout)`` that holds the values instead of the flat buffer (the call's ``flat`` is
    then empty; ``n`` the bucket's elements): the passes decode it as they read it (OnebitAdam's
    momentum kept as its last message, optimizers/_fused.py); ``tails``: the :class:`Tails` that a
    ``prepare``'s worker pass filled for such a message."""

    def __init__(self, table, clip: float, msg: torch.Tensor | None = None, kept=None,
                 n: int | None = None, tails=None) -> None:
        self.table, self.clip = table, clip
        self.gathered = self.layout = self.scale = None
        self.kept, self.n, self.tails = kept, n, tails
        self._old = None  # old()'s answer, made on its first call (the worker's and the finish's)
        if msg is not None:  # the prepared message (collectives._async.worker_message)
            def ready(layout):
                if msg.numel() != layout.message_bytes:
                    raise AssertionError("the prepared message does not fit the call's layout")
                return msg

            self.ready = ready

    def old(self):
        """The kept message's (bits [W, C / 8], scales [W] contiguous), or None."""
        if self.kept is None:
            return None
        if self._old is None:
            gathered, layout = self.kept
            self._old = message_bits(gathered, layout), message_scales(gathered, layout).contiguous()
        return self._old

    @staticmethod
    def decode(gathered, layout, flat) -> None:
        """``flat`` = the decode of ``gathered`` (the decompress pass without the error or the step's
        maths: what ``finish`` wrote into ``flat``, bitwise)."""
        scales, bits, n = message_scales(gathered, layout), message_bits(gathered, layout), flat.numel()
        for j, (lo, mid, hi) in enumerate(_chunks.splits(layout, n)):
            if mid > lo:
                cpu_simd.decompress(bits[j, : (mid - lo) // 8], scales[j].view(1), flat[lo:mid], None)
            if hi > mid:
                _chunks.decode_tail(bits, scales, flat, None, None, layout, j, lo, mid, hi)

    def _values(self, flat, layout):
        """What the padded rests' code reads: ``flat``, or this call's :class:`Tails`."""
        if self.kept is None:
            return flat
        if self.tails is None:
            self.tails = Tails(layout, self.n)
        return self.tails

    def worker(self, flat, worker_error, layout, msg) -> None:
        """``worker_compress(update_error=False)`` of what the step encodes, no block scales, as
        :func:`onebit.kernels.native.codec.worker_compress` computes it (every chunk in one C call)."""
        values = self._values(flat, layout)
        n = values.numel()
        splits = _chunks.splits(layout, n)
        source = None if self.kept is not None else flat
        sums = self.encode_all(source, worker_error, message_bits(msg, layout), layout.C,
                               [mid - lo for lo, mid, _ in splits],
                               [max(0, min(hi, n) - lo) for lo, _, hi in splits])

        def piece(j: int, lo: int, mid: int, hi: int) -> list:
            return [sums[j]] if mid > lo else []

        self.scale = _chunks.encode_chunks(values, worker_error, layout, msg, piece)  # (a float: no read)

    def finish(self, gathered, layout, flat, worker_error, msg) -> None:
        """decompress (with the deferred worker error where the scales are finite) with the step's
        maths inside (every chunk in one C call, then the padded rests)."""
        self.gathered, self.layout = gathered, layout  # kept: a restore decodes them (abandon)
        values = self._values(flat, layout)
        scales, bits = message_scales(gathered, layout).contiguous(), message_bits(gathered, layout)
        n = values.numel()
        update = all(math.isfinite(s) for s in scales.tolist())  # W floats read: no torch op
        s_w = message_scales(msg, layout).contiguous()
        splits = _chunks.splits(layout, n)
        e, ws = (worker_error, s_w) if update else (None, None)
        counts = [mid - lo for lo, mid, _ in splits]
        if self.kept is None:
            self.step_all(bits, scales, flat, e, ws, layout.C, counts)
        else:  # the pass folds the worker's u again from the kept message: it reads the error either way
            self.step_all(bits, scales, None, worker_error, s_w, layout.C, counts, update=update)
        for j, (lo, mid, hi) in enumerate(splits):  # the padded rests: the plain path's arithmetic
            if hi == mid:
                continue
            _chunks.decode_tail(bits, scales, values, e, s_w, layout, j, lo, mid, hi)
            if mid < n:
                self.tail(values, mid, min(hi, n))
