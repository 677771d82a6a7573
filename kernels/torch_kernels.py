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


# Multiplying 8 bytes of 0/1 (one int64, little-endian: byte i at bit 8i) by this constant
# puts byte i's bit at bit 63 - i: the partial products 2**(8i + 63 - 9k) have distinct
# exponents for distinct (i, k), so nothing carries and bits 56..63 are exactly the packed
# byte, most significant bit first. The product wraps modulo 2**64 (two's complement).
_GATHER_BITS = 0x8040201008040201 - (1 << 64)
_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 bit-gathering constant, [256, 8] float32 table of +-1 for each byte value)."""
    if device not in _tables:
        shifts = torch.arange(7, -1, -1, device=device)
        table = ((torch.arange(256, device=device).view(-1, 1) >> shifts) & 1).float() * 2.0 - 1.0
        _tables[device] = torch.tensor(_GATHER_BITS, dtype=torch.int64, device=device), table
    return _tables[device]


def pack_signs(z: torch.Tensor) -> torch.Tensor:
    """Packed bits of ``sgn(z)`` for a float vector whose length is a multiple of 8."""
    magic, _ = _constants(z.device)
    negative = (z < 0).view(torch.uint8).view(torch.int64)  # NaN and -0.0 are not negative
    return 255 - ((negative * magic) >> 56).to(torch.uint8)


def unpack_signs(bits: torch.Tensor) -> torch.Tensor:
    """+-1.0 float32 vector of length ``8 * bits.numel()`` from packed bits."""
    _, table = _constants(bits.device)
    return torch.index_select(table, 0, bits.reshape(-1).to(torch.int32)).view(-1)


def _update_error(
    e: torch.Tensor, z: torch.Tensor, signs: torch.Tensor, scale: torch.Tensor, gate: torch.Tensor
) -> None:
    """``e <- z - scale*signs`` when ``gate`` holds, else nothing is written.

    With signs +-1 the product is exact, so this is ``z -+ scale`` rounded once. The gate is
    read on the host: free for CPU tensors (the CUDA path is the Triton kernels).
    """
    if bool(gate):
        torch.addcmul(z, signs, scale, value=-1.0, out=e)


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
        _update_error(e, z, unpack_signs(message_bits(out, layout)), scale, torch.isfinite(scale))


def _server_sum(received: torch.Tensor, e: torch.Tensor, layout: Layout) -> torch.Tensor:
    bits = message_bits(received, layout)
    scales = message_scales(received, layout) * (1.0 / layout.W)  # 1/W multiplied, as the spec
    m = torch.zeros(layout.C, dtype=torch.float32, device=e.device)
    for r in range(layout.W):  # rank order, as the Triton kernel sums
        m.addcmul_(unpack_signs(bits[r]), scales[r])
    return m + e


def server_reduce(received: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor) -> None:
    """Reduce W received segments with the server error into one segment in ``out``.

    A non-finite worker scale or sum makes the server scale NaN and leaves ``e`` unchanged.
    """
    m = _server_sum(received, e, layout)
    ok = torch.isfinite(message_scales(received, layout)).all()
    scale = _rms(_sumsq(m), layout.C) if bool(ok) else torch.full((), float("nan"), device=e.device)
    bits = pack_signs(m)
    message_bits(out, layout).copy_(bits.view(1, -1))
    message_scales(out, layout).copy_(scale.view(1))
    _update_error(e, m, unpack_signs(bits), scale, torch.isfinite(scale))


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
        gate = torch.isfinite(scales).all()
        _update_error(worker_error, z, unpack_signs(pack_signs(z)), s_w, gate)
    signs = unpack_signs(message_bits(gathered, layout)).view(layout.W, layout.C)
    values = (signs * scales.view(-1, 1)).view(-1)
    out.copy_(values[: out.numel()])
