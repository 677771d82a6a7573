"""The CPU codec compiled by torch's own compiler (inductor's C++ backend): each kernel in one
or two passes over memory, against the half dozen of :mod:`onebit.kernels.torch_kernels`.

Same contracts and the same float32 arithmetic as the plain-torch path (``z = x + e``; the
server sum in rank order; products with +-1 exact), so the packed bits, the server sums and,
for equal scales, the errors are bitwise equal to it. The scales come from float64 sums of
squares whose order differs (8-element partial sums, then the block or the piece), so a scale
can differ from the plain path's in its last float32 bit, and an error with it (tested to that
tolerance in tests/test_cpu_compiled.py; the plain path stays the reference).

Work goes chunk by chunk over the elements that ``x`` (or ``out``) covers; the padded tail of
the last chunk (fewer than ``8 * W`` or ``block * W`` elements) goes through the plain path.
The compiled functions take symbolic sizes (one compile each, not one per size); the server's
sum is unrolled per world size (one compiled function per W). Compiling needs a C++ compiler:
:func:`usable` tries once, and without one warns once and leaves every call to the plain path.
The path is chosen by :mod:`onebit.kernels.api` for CPU tensors from ``MIN_NUMEL`` elements on
(smaller calls would spend more on the first compile than they save), or with
``backend="compiled"``; ``ONEBIT_CPU_CODEC=torch`` turns it off.
"""

from __future__ import annotations

import functools
import os

import torch

from . import torch_kernels
from ._warn import warn_user
from .layout import Layout, message_bits, message_scales

MIN_NUMEL = 1 << 20  # elements (padded N) from which api picks this path for CPU tensors
_ENV = "ONEBIT_CPU_CODEC"  # "torch": never this path; anything else: the default choice
_state: dict[str, bool] = {}


def _signs(bits: torch.Tensor) -> torch.Tensor:
    """float32 +-1 of packed bits (element 8k+i in bit 7-i of byte k), length 8 * bits.numel()."""
    shifts = torch.arange(7, -1, -1, dtype=torch.int32, device=bits.device)
    one = (bits.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return (one.to(torch.float32) * 2.0 - 1.0).reshape(-1)


def _encode(z: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 sum of squares of each ``block`` elements, packed bits of ``sgn(z)``)."""
    z8 = z.view(-1, 8)
    zd = z8.to(torch.float64)
    sums8 = zd[:, 0] * zd[:, 0]
    packed = (z8[:, 0] < 0).logical_not().to(torch.int32) * 128  # NaN and -0.0: bit 1, as pack_signs
    for k in range(1, 8):  # column by column: one loop over the bytes, vectorised along them
        sums8 = sums8 + zd[:, k] * zd[:, k]
        packed = packed + (z8[:, k] < 0).logical_not().to(torch.int32) * (1 << (7 - k))
    return sums8.view(-1, block // 8).sum(-1), packed.to(torch.uint8)


def _minus_sgn_scaled(z: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``z - s*sgn(z)`` with one scale per ``block`` elements (``z + 0.0``: -0.0 counts as +)."""
    zv = z.view(-1, block)
    return (zv - torch.copysign(scales.view(-1, 1), zv + 0.0)).view(-1)


def _worker_encode(x, e, block: int):
    return _encode(x.to(torch.float32) + e, block)


def _worker_update(x, e, scales, block: int) -> None:
    e.copy_(_minus_sgn_scaled(x.to(torch.float32) + e, scales, block))


def _server_m(bits, weights, e, block: int) -> torch.Tensor:
    m = (_signs(bits[0]).view(-1, block) * weights[0].view(-1, 1)).view(-1)
    for r in range(1, bits.shape[0]):  # rank order, as the spec
        m = m + (_signs(bits[r]).view(-1, block) * weights[r].view(-1, 1)).view(-1)
    return m + e


def _server_encode(bits, weights, e, block: int):
    return _encode(_server_m(bits, weights, e, block), block)


def _server_update(bits, weights, e, scales, block: int) -> None:
    e.copy_(_minus_sgn_scaled(_server_m(bits, weights, e, block), scales, block))


def _decode(bits, scales, out, block: int) -> None:
    out.copy_((_signs(bits).view(-1, block) * scales.view(-1, 1)).view(-1).to(out.dtype))


def _decode_update(bits, scales, out, e, s_w, block: int) -> None:
    e.copy_(_minus_sgn_scaled(out.to(torch.float32) + e, s_w, block))
    out.copy_((_signs(bits).view(-1, block) * scales.view(-1, 1)).view(-1).to(out.dtype))


def _compile(fn):
    return torch.compile(fn, dynamic=True, fullgraph=True)


_worker_encode_c = _compile(_worker_encode)
_worker_update_c = _compile(_worker_update)
_decode_c = _compile(_decode)
_decode_update_c = _compile(_decode_update)


@functools.cache
def _server_fns(W: int):
    """The server's two compiled functions for world size W (the rank loop is unrolled)."""
    return _compile(_server_encode), _compile(_server_update)


def usable() -> bool:
    """Whether compiled functions run here (tried once: a compile and a check of its result);
    without a working C++ compiler warns once and answers False from then on."""
    if "ok" not in _state:
        try:
            z = torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0, -1.0, 2.0, float("nan")] * 2)
            sums, bits = _worker_encode_c(z, torch.zeros_like(z), 8)
            ok = torch.equal(bits, torch_kernels.pack_signs(z)) and sums[0].isnan().item()
            why = "its result differed from the plain path's"
        except Exception as exc:  # noqa: BLE001 - any failure to compile means: not here
            ok, why = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        _state["ok"] = ok
        if not ok:
            warn_user(f"onebit: the compiled CPU codec is not available ({why}); CPU tensors use the "
                          "plain-torch kernels (slower, same results). A C++ compiler for torch.compile "
                          f"enables it; {_ENV}=torch silences this", RuntimeWarning)
    return _state["ok"]


def chosen(layout: Layout) -> bool:
    """api's default choice for a CPU call of this layout."""
    return layout.N >= MIN_NUMEL and os.environ.get(_ENV, "") != "torch" and usable()


def _split(layout: Layout, n: int, j: int) -> tuple[int, int, int]:
    """(lo, mid, hi) of chunk j: [lo, mid) covered by the n elements, in whole scale blocks (the
    compiled part); [mid, hi) the padded rest, for the plain path."""
    unit = 8 if layout.block is None else layout.block
    lo, hi = j * layout.C, (j + 1) * layout.C
    mid = max(lo, min(hi, lo + (n - lo) // unit * unit))
    return lo, mid, hi


def _block(layout: Layout, lo: int, hi: int) -> int:
    return hi - lo if layout.block is None else layout.block


def _piece_scales(scales: torch.Tensor, layout: Layout, j: int, lo: int, a: int, b: int) -> torch.Tensor:
    """Chunk j's scales for its elements [a, b) (chunk starts at lo): a 1-element view without
    block scales."""
    if layout.block is None:
        return scales[j].view(1)
    return scales[j, (a - lo) // layout.block : (b - lo) // layout.block]


@torch.no_grad()
def worker_compress(x: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor,
                    update_error: bool) -> None:
    """:func:`torch_kernels.worker_compress`, compiled."""
    bits, scales, n = message_bits(out, layout), message_scales(out, layout), x.numel()
    parts, total = [], torch.zeros((), dtype=torch.float64)
    for j in range(layout.W):
        lo, mid, hi = _split(layout, n, j)
        pieces = []
        if mid > lo:
            sums, packed = _worker_encode_c(x[lo:mid], e[lo:mid], _block(layout, lo, mid))
            bits[j, : (mid - lo) // 8] = packed
            pieces.append(sums)
        if hi > mid:
            z = torch_kernels._z(x, e, mid, hi)
            bits[j, (mid - lo) // 8 :] = torch_kernels.pack_signs(z)
            zd = z.to(torch.float64)
            pieces.append((zd * zd).view(-1, _block(layout, mid, hi)).sum(-1))
        sums = torch.cat(pieces)
        if layout.block is None:
            total += sums.sum()
        else:
            scales[j] = torch.sqrt(sums / layout.block).to(torch.float32)
        parts.append((lo, mid, hi))
    if layout.block is None:
        scales.copy_(torch.sqrt(total / layout.N).to(torch.float32).expand(layout.W))
    finite = bool(torch.isfinite(scales).all())
    if layout.block is not None and not finite:
        scales.fill_(float("nan"))  # one non-finite block poisons every scale (as the plain path)
    if not (update_error and finite):
        return
    for j, (lo, mid, hi) in enumerate(parts):
        if mid > lo:
            _worker_update_c(x[lo:mid], e[lo:mid], _piece_scales(scales, layout, j, lo, lo, mid),
                             _block(layout, lo, mid))
        if hi > mid:
            tail = _piece_scales(scales, layout, j, lo, mid, hi)
            e[mid:hi] = _minus_sgn_scaled(torch_kernels._z(x, e, mid, hi), tail, _block(layout, mid, hi))


@torch.no_grad()
def server_reduce(received: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor) -> None:
    """:func:`torch_kernels.server_reduce`, compiled."""
    encode, update = _server_fns(layout.W)
    rbits, rscales = message_bits(received, layout), message_scales(received, layout)
    weights = (rscales * (1.0 / layout.W)).view(layout.W, -1)  # 1/W multiplied, as the spec
    if layout.block is None:
        weights = weights.expand(layout.W, 1)
    block = layout.C if layout.block is None else layout.block
    sums, packed = encode(rbits, weights, e, block)
    message_bits(out, layout)[0] = packed
    out_scales = message_scales(out, layout)[0]
    div = layout.C if layout.block is None else layout.block
    out_scales.copy_(torch.sqrt(sums / div).to(torch.float32).view_as(out_scales))
    received_finite = bool(torch.isfinite(rscales).all())
    if not (received_finite and bool(torch.isfinite(out_scales).all())):
        if layout.block is not None or not received_finite:  # as the plain path
            out_scales.fill_(float("nan"))
        return
    update(rbits, weights, e, out_scales.view(-1), block)


@torch.no_grad()
def decompress(gathered: torch.Tensor, layout: Layout, out: torch.Tensor,
               worker_error: torch.Tensor | None, worker_message: torch.Tensor | None) -> None:
    """:func:`torch_kernels.decompress`, compiled."""
    scales, bits, n = message_scales(gathered, layout), message_bits(gathered, layout), out.numel()
    update = worker_error is not None and bool(torch.isfinite(scales).all())
    s_w = message_scales(worker_message, layout) if update else None
    for j in range(layout.W):
        lo, mid, hi = _split(layout, n, j)
        if mid > lo:
            block, sj = _block(layout, lo, mid), _piece_scales(scales, layout, j, lo, lo, mid)
            if update:
                _decode_update_c(bits[j, : (mid - lo) // 8], sj, out[lo:mid], worker_error[lo:mid],
                                 _piece_scales(s_w, layout, j, lo, lo, mid), block)
            else:
                _decode_c(bits[j, : (mid - lo) // 8], sj, out[lo:mid], block)
        if hi == mid:
            continue
        block = _block(layout, mid, hi)  # the padded rest: the plain path's arithmetic
        if update:
            worker_error[mid:hi] = _minus_sgn_scaled(torch_kernels._z(out, worker_error, mid, hi),
                                                     _piece_scales(s_w, layout, j, lo, mid, hi), block)
        if mid < n:
            signs = torch_kernels.unpack_signs(bits[j, (mid - lo) // 8 : (hi - lo) // 8])
            tail = _piece_scales(scales, layout, j, lo, mid, hi)
            vals = (signs.view(-1, block) * tail.view(-1, 1)).view(-1)
            out[mid:min(hi, n)] = vals[: min(hi, n) - mid].to(out.dtype)
