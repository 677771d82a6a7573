"""A chunk's pieces for the native C passes (the codec, :mod:`onebit.kernels.native.codec`, and the fused
steps' passes, :mod:`onebit.kernels.fused`): where chunk j splits into the part its data covers in whole
units and the padded rest, its scales for a piece, and the rest's encode and decode in C on a small
zero-padded float32 copy (fewer than 8 W elements, or a block, per chunk), so that no stage leaves C."""

from __future__ import annotations

import functools
import math
import struct

import torch

from . import cpu_simd
from .layout import Layout, message_bits, message_scales
from .rounding import WORKER, narrow_plain, widen


def split(layout: Layout, n: int, j: int) -> tuple[int, int, int]:
    """(lo, mid, hi) of chunk j: [lo, mid) covered by the n elements, in whole scale blocks (the
    C passes' part); [mid, hi) the padded rest."""
    unit = 8 if layout.block is None else layout.block
    lo, hi = j * layout.C, (j + 1) * layout.C
    mid = max(lo, min(hi, lo + (n - lo) // unit * unit))
    return lo, mid, hi


@functools.lru_cache(maxsize=1024)
def splits(layout: Layout, n: int) -> tuple[tuple[int, int, int], ...]:
    """Every chunk's :func:`split`, made once per (layout, n) (the passes ask for them per bucket and
    step)."""
    return tuple(split(layout, n, j) for j in range(layout.W))


def piece_scales(scales: torch.Tensor, layout: Layout, j: int, lo: int, a: int, b: int) -> torch.Tensor:
    """Chunk j's scales for its elements [a, b) (chunk starts at lo): a 1-element view without
    block scales."""
    if layout.block is None:
        return scales[j].view(1)
    return scales[j, (a - lo) // layout.block : (b - lo) // layout.block]


def padded(src: torch.Tensor, mid: int, end: int, hi: int) -> torch.Tensor:
    """float32 ``[mid, hi)`` of ``src``, zero from ``end`` (the padding)."""
    t = torch.zeros(hi - mid, dtype=torch.float32)
    if end > mid:
        t[: end - mid] = src[mid:end]
    return t


def encode_tail(x: torch.Tensor, e: torch.Tensor, layout: Layout, bits: torch.Tensor, j: int, lo: int,
                mid: int, hi: int) -> torch.Tensor | float:
    """Chunk j's padded rest ``[mid, hi)`` (``split``): its bits into ``bits[j]``, and its float64
    sums of squares (per block, a tensor; one scale per chunk: a float), as the native codec encodes it."""
    xs, row = padded(x, mid, max(mid, min(hi, x.numel())), hi), bits[j, (mid - lo) // 8 : (hi - lo) // 8]
    es = widen(e[mid:hi])  # a bfloat16 error: its rest widened (fewer than 8 W elements, or a block)
    if layout.block is None:
        return cpu_simd.encode_total(xs, es, row)
    return cpu_simd.encode_blocks(xs, es, row, layout.block)


def decode_tail(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                worker_error: torch.Tensor | None, s_w: torch.Tensor | None, layout: Layout, j: int, lo: int,
                mid: int, hi: int) -> None:
    """Chunk j's padded rest ``[mid, hi)``: the deferred worker error (``worker_error`` None: not
    updated; bfloat16: updated in float32, stored rounded as :mod:`onebit.kernels.rounding` stores a
    whole buffer) and the decode of the elements ``out`` holds, as the native codec decodes it."""
    n = out.numel()
    end = max(mid, min(hi, n))
    values = padded(out, mid, end, hi)
    e, ws = (None, None) if worker_error is None else (widen(worker_error[mid:hi]),
                                                        piece_scales(s_w, layout, j, lo, mid, hi))
    row = bits[j, (mid - lo) // 8 : (hi - lo) // 8]
    cpu_simd.decompress(row, piece_scales(scales, layout, j, lo, mid, hi), values, layout.block, e, ws)
    if e is not None and worker_error.dtype != torch.float32:
        worker_error[mid:hi] = narrow_plain(e, s_w, layout.block_len, WORKER, offset=mid)
    if end > mid:
        out[mid:end] = values[: end - mid]


def encode_chunks(x: torch.Tensor, e: torch.Tensor, layout: Layout, msg: torch.Tensor, piece) -> float | None:
    """``worker_compress(update_error=False)``'s message, chunk by chunk: ``piece(j, lo, mid, hi)``
    encodes chunk j's ``[lo, mid)`` into ``bits[j]`` (the codec's pass, with whatever maths a fused
    pass adds) and returns its float64 sums of squares (per block, or one total), an empty list
    where ``mid == lo``; the padded rest ``[mid, hi)`` takes :func:`encode_tail`. The scales: one
    from every chunk's sums, or one per block; a non-finite block poisons every scale. One scale per
    chunk: the sums are Python floats (IEEE doubles: the float64 tensor arithmetic's bits, without a
    torch op per chunk, each of which waits for a core the C passes' threads still hold); returns that
    scale (None with block scales)."""
    bits, scales, n = message_bits(msg, layout), message_scales(msg, layout), x.numel()
    if layout.block is None:
        total = 0.0
        for j, (lo, mid, hi) in enumerate(splits(layout, n)):
            pieces = [float(s) for s in piece(j, lo, mid, hi)]
            if hi > mid:
                pieces.append(encode_tail(x, e, layout, bits, j, lo, mid, hi))
            if len(pieces) > 2:
                raise AssertionError("encode_chunks: at most a piece and a rest per chunk")
            total += pieces[0] if len(pieces) == 1 else pieces[0] + pieces[1]  # as cat(pieces).sum()
        scale = rms(total, layout.N)
        scales.fill_(scale)
        return scale
    total = torch.zeros((), dtype=torch.float64)
    for j in range(layout.W):
        lo, mid, hi = split(layout, n, j)
        pieces = list(piece(j, lo, mid, hi))
        if hi > mid:
            pieces.append(encode_tail(x, e, layout, bits, j, lo, mid, hi))
        scales[j] = torch.sqrt(torch.cat(pieces) / layout.block).to(torch.float32)
    if not bool(torch.isfinite(scales).all()):
        scales.fill_(float("nan"))  # as the plain path
    return None


def rms(total: float, N: int) -> float:
    """``sqrt(total / N)`` in float64 rounded to float32, as ``torch.sqrt(t / N).to(torch.float32)``
    rounds a float64 tensor ``t`` (to nearest, ties to even; past float32's range: inf)."""
    value = math.sqrt(total / N) if total >= 0 else math.nan  # a negative sum: none (as torch: NaN)
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond float32's largest: torch's conversion gives inf
        return math.inf
