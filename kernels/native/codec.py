"""The native CPU codec: each stage (the worker's encode, the server's two passes, decompress) as
calls of the C passes in ``codec.c`` (:mod:`onebit.kernels.cpu_simd` binds them), whole: no stage
runs part in C and part elsewhere. The same contracts as :mod:`onebit.kernels.torch_kernels`.

Bits, errors and outputs are bitwise the plain path's for equal scales; a scale comes from float64
sums of exact squares added in another order, so it can differ from the plain path's in its last
float32 bit (docs/ALGORITHMS.md 2; tests/test_native_codec.py, tests/test_cpu_simd.py).

Each chunk ``[lo, hi)`` of the padded buffer splits where ``x`` ends: ``[lo, mid)`` (``mid``: the
last whole unit, 8 elements or a block, of ``x`` inside the chunk) runs on the tensors in place;
``[mid, hi)`` (at most a unit of data and the padding) runs on a small float32 copy of it, zero
beyond ``x``. Inputs in bfloat16 or float16 are converted to float32 a piece at a time (as the
plain path adds them to the float32 error). Any block length that is a multiple of 8 works.
"""

from __future__ import annotations

import torch

from .. import cpu_simd
from .._chunks import padded, piece_scales, split
from ..layout import Layout, message_bits, message_scales


def usable() -> bool:
    """Whether the C library is built here (any CPU: AVX-512, AVX2 or portable C)."""
    return cpu_simd.available()


def _pieces(layout: Layout, n: int, j: int) -> tuple[int, int, int, int]:
    """(lo, mid, end, hi) of chunk j (:func:`onebit.kernels._chunks.split`): ``x`` covers ``[lo, end)``;
    ``[lo, mid)`` whole units of it."""
    lo, mid, hi = split(layout, n, j)
    return lo, mid, max(lo, min(hi, n)), hi


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.to(torch.float32).contiguous()


@torch.no_grad()
def worker_compress(x: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor,
                    update_error: bool) -> None:
    """:func:`onebit.kernels.torch_kernels.worker_compress` in C."""
    bits, scales, n, B = message_bits(out, layout), message_scales(out, layout), x.numel(), layout.block
    total = 0.0
    pieces = []
    for j in range(layout.W):
        lo, mid, end, hi = _pieces(layout, n, j)
        parts = []
        if mid > lo:
            parts.append((lo, mid, _f32(x[lo:mid]), e[lo:mid]))
        if hi > mid:
            parts.append((mid, hi, padded(x, mid, end, hi), e[mid:hi]))
        sums = []
        for a, b, xs, es in parts:
            row = bits[j, (a - lo) // 8 : (b - lo) // 8]
            if B is None:
                total += cpu_simd.encode_total(xs, es, row)
            else:
                sums.append(cpu_simd.encode_blocks(xs, es, row, B))
        if B is not None:
            scales[j] = torch.sqrt(torch.cat(sums) / B).to(torch.float32)
        pieces.append((j, lo, parts))
    if B is None:
        scales.copy_(torch.sqrt(torch.tensor(total, dtype=torch.float64) / layout.N).to(torch.float32)
                     .expand(layout.W))
    finite = bool(torch.isfinite(scales).all())
    if B is not None and not finite:
        scales.fill_(float("nan"))  # one non-finite block poisons every scale, as the plain path
    if not (update_error and finite):
        return
    for j, lo, parts in pieces:
        for a, b, xs, es in parts:
            cpu_simd.error_update(xs, es, piece_scales(scales, layout, j, lo, a, b), B)


def bfloat16_errors(layout: Layout) -> bool:
    """Whether :func:`worker_compress` (``update_error`` off), :func:`decompress` and :func:`server_reduce`
    take bfloat16 error buffers as they are (widened run by run, stored rounded: the same bits as the
    widened buffers', :mod:`onebit.kernels.rounding`): one scale per chunk or blocks of at most 4096;
    else the caller widens them."""
    return layout.block is None or layout.block <= cpu_simd.BF16_RUN


@torch.no_grad()
def server_reduce(received: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor,
                  offset: int = 0) -> None:
    """:func:`onebit.kernels.torch_kernels.server_reduce` in C: the sum over the ranks' bits with its
    bits and sums of squares, the scale, then the error pass (m again from the bits and e). ``offset``:
    where ``e`` starts in its buffer (a slice's; a bfloat16 error's rounding reads it)."""
    bits, received_scales = message_bits(received, layout), message_scales(received, layout)
    seg_bits, seg_scales = message_bits(out, layout)[0], message_scales(out, layout)
    if layout.block is None:
        if offset and e.dtype != torch.float32:
            raise ValueError("offset: a bfloat16 server error with one scale is rounded whole (offset 0)")
        cpu_simd.server_reduce_one(bits, received_scales, e, seg_bits, seg_scales[:1])
        return
    B, scales = layout.block, seg_scales[0]
    weights = (received_scales * (1.0 / layout.W)).contiguous()  # 1/W multiplied, as the plain path
    sums = cpu_simd.server_blocks(bits, weights, e, seg_bits, B)
    scales.copy_(torch.sqrt(sums / B).to(torch.float32))
    if not (bool(torch.isfinite(received_scales).all()) and bool(torch.isfinite(scales).all())):
        scales.fill_(float("nan"))  # any non-finite block: every scale NaN, e unchanged
        return
    cpu_simd.server_update(bits, weights, e, scales, B, index=offset)


@torch.no_grad()
def decompress(gathered: torch.Tensor, layout: Layout, out: torch.Tensor, worker_error: torch.Tensor | None,
               worker_message: torch.Tensor | None, offset: int = 0) -> None:
    """:func:`onebit.kernels.torch_kernels.decompress` in C: per element, the deferred worker error
    (where every scale is finite) then the decode, in one pass. ``offset``: where ``worker_error``
    starts in its buffer (a slice's; a bfloat16 error's rounding reads it)."""
    scales, bits = message_scales(gathered, layout), message_bits(gathered, layout)
    n, B = out.numel(), layout.block
    update = worker_error is not None and bool(torch.isfinite(scales).all())
    s_w = message_scales(worker_message, layout) if update else None
    direct = out.dtype == torch.float32 and out.is_contiguous()
    for j in range(layout.W):
        lo, mid, end, hi = _pieces(layout, n, j)
        for a, b in ((lo, mid), (mid, hi)):
            if b <= a or (a >= n and not update):
                continue
            row = bits[j, (a - lo) // 8 : (b - lo) // 8]
            in_place = b <= end and direct  # a piece of out, else a float32 copy (another dtype; the padding)
            if in_place:
                values = out[a:b]
            else:
                values = out[a:b].to(torch.float32) if b <= end else padded(out, a, end, b)
            ws = piece_scales(s_w, layout, j, lo, a, b) if update else None
            cpu_simd.decompress(row, piece_scales(scales, layout, j, lo, a, b), values, B,
                                worker_error[a:b] if update else None, ws, index=offset + a)
            if not in_place and min(b, n) > a:
                out[a:min(b, n)] = values[: min(b, n) - a].to(out.dtype)
