"""Plain, vectorised torch implementation of the three kernels (the path for CPU tensors).

Same contracts as :mod:`onebit.kernels.triton_kernels`; launched through
:mod:`onebit.kernels.api`, which validates inputs and allocates outputs. Work goes in
blocks of ``_BLOCK`` elements: temporaries stay small (a fresh model-sized buffer costs
page faults on every call) and hot in cache. The float32 arithmetic follows the same order
as the Triton kernels (``z = x + e``; server sum in rank order; products with +-1 are
exact), so both paths give bitwise-equal bits and errors except where the float64 norm
rounds differently in its last bit.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .layout import Layout, message_bits, message_scales

_BLOCK = 1 << 18  # elements per block (a multiple of 8)

# Multiplying 8 bytes of 0/1 (one int64, little-endian: byte i at bit 8i) by this constant
# puts byte i's bit at bit 63 - i: the partial products 2**(8i + 63 - 9k) have distinct
# exponents for distinct (i, k), so nothing carries and bits 56..63 are exactly the packed
# byte, most significant bit first. The product wraps modulo 2**64 (two's complement).
_GATHER_BITS = 0x8040201008040201 - (1 << 64)
_constants_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 bit-gathering constant, [256, 8] float32 table of +-1 for each byte value)."""
    if device not in _constants_cache:
        shifts = torch.arange(7, -1, -1, device=device)
        table = ((torch.arange(256, device=device).view(-1, 1) >> shifts) & 1).float() * 2.0 - 1.0
        magic = torch.tensor(_GATHER_BITS, dtype=torch.int64, device=device)
        _constants_cache[device] = magic, table
    return _constants_cache[device]


def pack_signs(z: torch.Tensor) -> torch.Tensor:
    """Packed bits of ``sgn(z)`` for a float vector whose length is a multiple of 8."""
    magic, _ = _constants(z.device)
    negative = (z < 0).view(torch.uint8).view(torch.int64)  # NaN and -0.0 are not negative
    return 255 - ((negative * magic) >> 56).to(torch.uint8)


def unpack_signs(bits: torch.Tensor, scale: torch.Tensor | float = 1.0, dtype=torch.float32, out=None):
    """``scale * sgn`` (length ``8 * bits.numel()``) from packed bits, in ``dtype``.

    One gather from a 256-row table of ``+-scale`` (products with +-1 are exact).
    """
    _, table = _constants(bits.device)
    rows = (table * scale).to(dtype)
    index = bits.reshape(-1).to(torch.int32)
    if out is None:
        return torch.index_select(rows, 0, index).view(-1)
    torch.index_select(rows, 0, index, out=out.view(-1, 8))
    return out


def _blocks(layout: Layout) -> Iterator[tuple[int, int, int]]:
    """(chunk j, first element, end element) of each block; blocks never cross chunks."""
    for j in range(layout.W):
        for a in range(0, layout.C, _BLOCK):
            yield j, j * layout.C + a, j * layout.C + min(a + _BLOCK, layout.C)


def _z(x: torch.Tensor, e: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``pad(x) + e`` on elements ``[lo, hi)``, in float32."""
    end = min(hi, x.numel())
    if end <= lo:
        return e[lo:hi].clone()
    if end == hi:
        return torch.add(x[lo:hi], e[lo:hi])  # one pass; x + e == e + x bitwise
    z = torch.empty(hi - lo, dtype=torch.float32, device=e.device)
    torch.add(x[lo:end], e[lo:end], out=z[: end - lo])
    z[end - lo :] = e[end:hi]
    return z


def _minus_sgn_scaled(z: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out <- z - scale*sgn(z)`` = ``z -+ scale`` (``z + 0.0`` turns -0.0 into +0.0)."""
    torch.sub(z, torch.copysign(scale, z + 0.0), out=out)


def _sumsq(z: torch.Tensor) -> torch.Tensor:
    zd = z.to(torch.float64)
    return torch.dot(zd, zd)


def _rms(sumsq: torch.Tensor, length: int) -> torch.Tensor:
    return torch.sqrt(sumsq / length).to(torch.float32)


def worker_compress(
    x: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor, update_error: bool
) -> None:
    """Pack ``sgn(pad(x) + e)`` chunk by chunk into ``out`` (W segments) with the RMS scale.

    With ``update_error`` the error becomes ``z - scale*sgn(z)`` unless the scale is not finite.
    """
    if layout.block is not None:
        worker_compress_blocks(x, e, layout, out, update_error)
        return
    bits, C = message_bits(out, layout), layout.C
    acc = torch.zeros((), dtype=torch.float64, device=e.device)
    for j, lo, hi in _blocks(layout):
        z = _z(x, e, lo, hi)
        acc += _sumsq(z)
        bits[j, (lo - j * C) // 8 : (hi - j * C) // 8] = pack_signs(z)
    scale = _rms(acc, layout.N)
    message_scales(out, layout).copy_(scale.expand(layout.W))
    if update_error and bool(torch.isfinite(scale)):  # a free host read for CPU tensors
        for _, lo, hi in _blocks(layout):
            _minus_sgn_scaled(_z(x, e, lo, hi), scale, e[lo:hi])


def _server_sum(received: torch.Tensor, e: torch.Tensor, layout: Layout, a: int, b: int) -> torch.Tensor:
    """``m = sum_r sgn_r * (s_r * (1/W)) + e`` on chunk elements ``[a, b)``, rank order."""
    bits = message_bits(received, layout)[:, a // 8 : b // 8]
    weights = message_scales(received, layout) * (1.0 / layout.W)  # 1/W multiplied, as the spec
    m = unpack_signs(bits[0], weights[0])
    for r in range(1, layout.W):
        m += unpack_signs(bits[r], weights[r])
    return m + e[a:b]


def server_reduce(received: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor) -> None:
    """Reduce W received segments with the server error into one segment in ``out``.

    A non-finite worker scale or sum makes the server scale NaN and leaves ``e`` unchanged.
    """
    if layout.block is not None:
        server_reduce_blocks(received, e, layout, out)
        return
    bits = message_bits(out, layout)[0]
    acc = torch.zeros((), dtype=torch.float64, device=e.device)
    sums = []  # kept for the error update: this rank's chunk only (N/W floats)
    for a in range(0, layout.C, _BLOCK):
        b = min(a + _BLOCK, layout.C)
        m = _server_sum(received, e, layout, a, b)
        acc += _sumsq(m)
        bits[a // 8 : b // 8] = pack_signs(m)
        sums.append((a, b, m))
    finite = bool(torch.isfinite(message_scales(received, layout)).all())
    scale = _rms(acc, layout.C) if finite else torch.full((), float("nan"), device=e.device)
    message_scales(out, layout).copy_(scale.view(1))
    if bool(torch.isfinite(scale)):
        for a, b, m in sums:
            _minus_sgn_scaled(m, scale, e[a:b])


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
    if layout.block is not None:
        decompress_blocks(gathered, layout, out, worker_error, worker_message)
        return
    scales = message_scales(gathered, layout)
    bits, C, n = message_bits(gathered, layout), layout.C, out.numel()
    update = worker_error is not None and bool(torch.isfinite(scales).all())
    s_w = message_scales(worker_message, layout)[0] if update else None
    for j, lo, hi in _blocks(layout):
        if update:
            _minus_sgn_scaled(_z(out, worker_error, lo, hi), s_w, worker_error[lo:hi])
        if lo >= n:
            continue
        src = bits[j, (lo - j * C) // 8 : (hi - j * C) // 8]
        end = min(hi, n)
        if end == hi:
            unpack_signs(src, scales[j], out.dtype, out=out[lo:hi])
        else:  # the last, partly padded block
            out[lo:end] = unpack_signs(src, scales[j], out.dtype)[: end - lo]


# -- block scales: one scale per ``layout.block`` elements (docs/ALGORITHMS.md section 7) ------
def _pieces(layout: Layout) -> Iterator[tuple[int, int, int]]:
    """Like _blocks, but every piece holds whole scale blocks."""
    step = max(layout.block, _BLOCK // layout.block * layout.block)
    for j in range(layout.W):
        for a in range(0, layout.C, step):
            yield j, j * layout.C + a, j * layout.C + min(a + step, layout.C)


def _block_rms(z: torch.Tensor, block: int) -> torch.Tensor:
    """float32 RMS of each ``block`` consecutive elements of ``z`` (``sqrt(sum z^2 / block)``
    from a float64 norm: one pass, no float64 copy of ``z``)."""
    norms = torch.linalg.vector_norm(z.view(-1, block), dim=1, dtype=torch.float64)
    return torch.sqrt(norms.square_().div_(block)).to(torch.float32)


def _minus_sgn_scaled_blocks(z: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """_minus_sgn_scaled with one scale per row of ``z.view(len(scales), -1)`` (broadcast)."""
    zv = z.view(scales.numel(), -1)
    signed = zv + 0.0  # -0.0 -> +0.0, as _minus_sgn_scaled
    torch.copysign(scales.view(-1, 1), signed, out=signed)
    torch.sub(zv, signed, out=out.view_as(zv))


def _unpack_blocks(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``scale_b * sgn`` of packed ``bits``, one scale per row of ``len(scales)`` rows."""
    signs = unpack_signs(bits, out=out)
    signs.view(scales.numel(), -1).mul_(scales.view(-1, 1))  # products with +-1: exact
    return signs


def worker_compress_blocks(
    x: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor, update_error: bool
) -> None:
    """worker_compress with a scale per block: the message's scales are ``[W, C / block]``."""
    bits, scales, C, B = message_bits(out, layout), message_scales(out, layout), layout.C, layout.block
    for j, lo, hi in _pieces(layout):
        z = _z(x, e, lo, hi)
        a, b = lo - j * C, hi - j * C
        scales[j, a // B : b // B] = _block_rms(z, B)
        bits[j, a // 8 : b // 8] = pack_signs(z)
    # one non-finite block poisons every scale of the message, so that every server (not only
    # the one serving that block) sees it and leaves its error alone (no host synchronisation)
    finite = torch.isfinite(scales).all()
    scales.masked_fill_(~finite, float("nan"))  # a 0-d mask: no host synchronisation
    if update_error and bool(finite):
        for j, lo, hi in _pieces(layout):
            a, b = lo - j * C, hi - j * C
            _minus_sgn_scaled_blocks(_z(x, e, lo, hi), scales[j, a // B : b // B], e[lo:hi])


def server_reduce_blocks(received: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor) -> None:
    """server_reduce with a scale per block; any non-finite received scale or sum makes every
    output scale NaN and leaves ``e`` unchanged."""
    bits, out_scales, B = message_bits(out, layout)[0], message_scales(out, layout)[0], layout.block
    rbits, rscales = message_bits(received, layout), message_scales(received, layout)
    weights = rscales * (1.0 / layout.W)  # [W, blocks]: 1/W multiplied, as the spec
    step = max(B, _BLOCK // B * B)
    sums = []
    term = None
    for a in range(0, layout.C, step):
        b = min(a + step, layout.C)
        m = _unpack_blocks(rbits[0, a // 8 : b // 8], weights[0, a // B : b // B])
        if term is None or term.numel() != m.numel():
            term = torch.empty_like(m)
        for r in range(1, layout.W):  # rank order, as the spec
            m += _unpack_blocks(rbits[r, a // 8 : b // 8], weights[r, a // B : b // B], out=term)
        m += e[a:b]
        out_scales[a // B : b // B] = _block_rms(m, B)
        bits[a // 8 : b // 8] = pack_signs(m)
        sums.append((a, b, m))
    if not bool(torch.isfinite(rscales).all() and torch.isfinite(out_scales).all()):
        out_scales.fill_(float("nan"))
        return
    for a, b, m in sums:
        _minus_sgn_scaled_blocks(m, out_scales[a // B : b // B], e[a:b])


def decompress_blocks(gathered: torch.Tensor, layout: Layout, out: torch.Tensor,
                      worker_error: torch.Tensor | None, worker_message: torch.Tensor | None) -> None:
    """decompress with a scale per block (chunk j's scales from segment j of ``gathered``; the
    deferred worker error update takes segment j's scales from ``worker_message``)."""
    scales = message_scales(gathered, layout)
    bits, C, B, n = message_bits(gathered, layout), layout.C, layout.block, out.numel()
    update = worker_error is not None and bool(torch.isfinite(scales).all())
    s_w = message_scales(worker_message, layout) if update else None
    for j, lo, hi in _pieces(layout):
        a, b = lo - j * C, hi - j * C
        if update:
            z = _z(out, worker_error, lo, hi)
            _minus_sgn_scaled_blocks(z, s_w[j, a // B : b // B], worker_error[lo:hi])
        if lo >= n:
            continue
        src, piece_scales = bits[j, a // 8 : b // 8], scales[j, a // B : b // B]
        if hi <= n and out.dtype == torch.float32:
            _unpack_blocks(src, piece_scales, out=out[lo:hi])
        else:
            out[lo:min(hi, n)] = _unpack_blocks(src, piece_scales)[: min(hi, n) - lo].to(out.dtype)
