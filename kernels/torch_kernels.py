"""Plain, vectorised torch implementation of the three kernels (the path for CPU tensors).

Same contracts as :mod:`onebit.kernels.triton_kernels`; launched through
:mod:`onebit.kernels.api`, which validates inputs and allocates outputs. The float32
arithmetic follows the same order as the Triton kernels (``z = x + e``; server sum over
ranks in rank order; products with +-1 are exact), so both paths give bitwise-equal bits
and errors except where the float64 norm rounds differently in its last bit.
"""

from __future__ import annotations

import torch

from .layout import Layout, message_bits, message_scales

_SUMSQ_CHUNK = 1 << 20  # elements converted to float64 at a time (bounds the temporary)


def _sumsq(z: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a float32 vector, accumulated in float64."""
    acc = torch.zeros((), dtype=torch.float64, device=z.device)
    for start in range(0, z.numel(), _SUMSQ_CHUNK):
        zc = z[start : start + _SUMSQ_CHUNK].to(torch.float64)
        acc += torch.dot(zc, zc)
    return acc


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8, device=device)


def pack_signs(z: torch.Tensor) -> torch.Tensor:
    """Packed bits of ``sgn(z)`` for a float vector whose length is a multiple of 8."""
    positive = torch.logical_not(z < 0).view(-1, 8).to(torch.uint8)
    return torch.sum(positive << _shifts(z.device), dim=1, dtype=torch.uint8)


def unpack_signs(bits: torch.Tensor) -> torch.Tensor:
    """+-1.0 float32 vector of length ``8 * bits.numel()`` from packed bits."""
    b = (bits.reshape(-1, 1) >> _shifts(bits.device)) & 1
    return (b.to(torch.float32) * 2.0 - 1.0).view(-1)


def _error_compensated(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    z = e.clone()
    z[: x.numel()] += x
    return z


def _rms(sumsq: torch.Tensor, length: int) -> torch.Tensor:
    return torch.sqrt(sumsq / length).to(torch.float32)


def worker_compress(
    x: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor, update_error: bool
) -> None:
    """Pack ``sgn(pad(x) + e)`` chunk by chunk into ``out`` (W segments) with the RMS scale.

    With ``update_error`` the error becomes ``z - scale*sgn(z)`` unless the scale is not finite.
    """
    z = _error_compensated(x, e)
    scale = _rms(_sumsq(z), layout.N)
    message_bits(out, layout).copy_(pack_signs(z).view(layout.W, layout.chunk_bytes))
    message_scales(out, layout).copy_(scale.expand(layout.W))
    if update_error:
        new = z - scale * torch.where(z < 0, -1.0, 1.0)
        torch.where(torch.isfinite(scale), new, e, out=e)


def _server_sum(received: torch.Tensor, e: torch.Tensor, layout: Layout) -> torch.Tensor:
    bits = message_bits(received, layout)
    scales = message_scales(received, layout) * (1.0 / layout.W)  # 1/W multiplied, as the spec
    m = torch.zeros(layout.C, dtype=torch.float32, device=e.device)
    for r in range(layout.W):  # rank order, as the Triton kernel sums
        m += unpack_signs(bits[r]) * scales[r]
    return m + e


def server_reduce(received: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor) -> None:
    """Reduce W received segments with the server error into one segment in ``out``.

    A non-finite worker scale or sum makes the server scale NaN and leaves ``e`` unchanged.
    """
    m = _server_sum(received, e, layout)
    ok = torch.isfinite(message_scales(received, layout)).all()
    scale = torch.where(ok, _rms(_sumsq(m), layout.C), float("nan"))
    message_bits(out, layout).copy_(pack_signs(m).view(1, -1))
    message_scales(out, layout).copy_(scale.view(1))
    new = m - scale * torch.where(m < 0, -1.0, 1.0)
    torch.where(torch.isfinite(scale), new, e, out=e)


def decompress(
    gathered: torch.Tensor,
    layout: Layout,
    out: torch.Tensor,
    worker_error: torch.Tensor | None,
    worker_message: torch.Tensor | None,
) -> None:
    """Write ``scale_j * sgn`` into ``out`` (flat, caller's dtype, unpadded).

    With ``worker_error``: first apply the worker error update deferred by the collective,
    ``e <- pad(out) + e - s_w*sgn(pad(out) + e)``, only when all W scales in ``gathered`` are
    finite (``s_w`` is the scale in ``worker_message``).
    """
    scales = message_scales(gathered, layout)
    if worker_error is not None:
        z = _error_compensated(out, worker_error)
        s_w = message_scales(worker_message, layout)[0]
        new = z - s_w * torch.where(z < 0, -1.0, 1.0)
        torch.where(torch.isfinite(scales).all(), new, worker_error, out=worker_error)
    signs = unpack_signs(message_bits(gathered, layout)).view(layout.W, layout.C)
    values = (signs * scales.view(-1, 1)).view(-1)
    out.copy_(values[: out.numel()])
