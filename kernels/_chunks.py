"""A chunk's pieces in the fused passes built on the native codec
(kernels/fused/): where chunk j splits into the part the
C passes take and the padded rest, its scales for a piece, and the rest's encode and
decode with the plain path's arithmetic (tests/test_fused_cpu.py, tests/test_cpu_simd.py)."""

from __future__ import annotations

import torch

from . import torch_kernels
from .layout import Layout, message_bits, message_scales


def minus_sgn_scaled(z: torch.Tensor, scales: torch.Tensor, block: int | None) -> torch.Tensor:
    """``z - s*sgn(z)`` (``z + 0.0``: -0.0 counts as +), one scale per ``block`` elements, or
    ``scales`` a single scale broadcast over ``z`` (``block=None``)."""
    if block is None:
        return z - torch.copysign(scales, z + 0.0)
    zv = z.view(-1, block)
    return (zv - torch.copysign(scales.view(-1, 1), zv + 0.0)).view(-1)


def scaled(signs: torch.Tensor, scales: torch.Tensor, block: int | None) -> torch.Tensor:
    if block is None:
        return signs * scales
    return (signs.view(-1, block) * scales.view(-1, 1)).view(-1)


def split(layout: Layout, n: int, j: int) -> tuple[int, int, int]:
    """(lo, mid, hi) of chunk j: [lo, mid) covered by the n elements, in whole scale blocks (the
    compiled part); [mid, hi) the padded rest, for the plain path."""
    unit = 8 if layout.block is None else layout.block
    lo, hi = j * layout.C, (j + 1) * layout.C
    mid = max(lo, min(hi, lo + (n - lo) // unit * unit))
    return lo, mid, hi


def block_of(layout: Layout, lo: int, hi: int) -> int:
    return hi - lo if layout.block is None else layout.block


def piece_scales(scales: torch.Tensor, layout: Layout, j: int, lo: int, a: int, b: int) -> torch.Tensor:
    """Chunk j's scales for its elements [a, b) (chunk starts at lo): a 1-element view without
    block scales."""
    if layout.block is None:
        return scales[j].view(1)
    return scales[j, (a - lo) // layout.block : (b - lo) // layout.block]


def encode_tail(x: torch.Tensor, e: torch.Tensor, layout: Layout, bits: torch.Tensor, j: int, lo: int,
                mid: int, hi: int) -> torch.Tensor:
    """Chunk j's padded rest ``[mid, hi)`` (``split``): its bits into ``bits[j]``, and its float64
    sums of squares (per block, or one), with the plain path's arithmetic."""
    z = torch_kernels._z(x, e, mid, hi)
    bits[j, (mid - lo) // 8 :] = torch_kernels.pack_signs(z)
    zd = z.to(torch.float64)
    return (zd * zd).view(-1, block_of(layout, mid, hi)).sum(-1)


def decode_tail(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                worker_error: torch.Tensor | None, s_w: torch.Tensor | None, layout: Layout, j: int, lo: int,
                mid: int, hi: int) -> None:
    """Chunk j's padded rest ``[mid, hi)``: the deferred worker error (``worker_error`` None: not
    updated) and the decode of the elements ``out`` holds, with the plain path's arithmetic."""
    block, n = block_of(layout, mid, hi), out.numel()
    if worker_error is not None:
        worker_error[mid:hi] = minus_sgn_scaled(torch_kernels._z(out, worker_error, mid, hi),
                                                piece_scales(s_w, layout, j, lo, mid, hi), block)
    if mid < n:
        signs = torch_kernels.unpack_signs(bits[j, (mid - lo) // 8 : (hi - lo) // 8])
        tail = piece_scales(scales, layout, j, lo, mid, hi)
        vals = (signs.view(-1, block) * tail.view(-1, 1)).view(-1)
        out[mid:min(hi, n)] = vals[: min(hi, n) - mid].to(out.dtype)


def encode_chunks(x: torch.Tensor, e: torch.Tensor, layout: Layout, msg: torch.Tensor, piece) -> None:
    """``worker_compress(update_error=False)``'s message, chunk by chunk: ``piece(j, lo, mid, hi)``
    encodes chunk j's ``[lo, mid)`` into ``bits[j]`` (the codec's pass, with whatever maths a fused
    pass adds) and returns its float64 sums of squares (per block, or one total), an empty list
    where ``mid == lo``; the padded rest ``[mid, hi)`` takes the plain arithmetic. The scales: one
    from every chunk's sums, or one per block; a non-finite block poisons every scale."""
    bits, scales, n = message_bits(msg, layout), message_scales(msg, layout), x.numel()
    total = torch.zeros((), dtype=torch.float64)
    for j in range(layout.W):
        lo, mid, hi = split(layout, n, j)
        pieces = list(piece(j, lo, mid, hi))
        if hi > mid:
            pieces.append(encode_tail(x, e, layout, bits, j, lo, mid, hi))
        sums = torch.cat(pieces)
        if layout.block is None:
            total += sums.sum()
        else:
            scales[j] = torch.sqrt(sums / layout.block).to(torch.float32)
    if layout.block is None:
        scales.copy_(torch.sqrt(total / layout.N).to(torch.float32).expand(layout.W))
    elif not bool(torch.isfinite(scales).all()):
        scales.fill_(float("nan"))  # as the plain path
