"""The CPU codec compiled by torch's own compiler (inductor's C++ backend): the worker's pass
(sum of squares and sign bits in one loop), its error update and decompress (with the
deferred worker error update) each in one pass over memory, against the half dozen passes of
:mod:`onebit.kernels.torch_kernels`.

Same contracts and the same float32 arithmetic as the plain-torch path (``z = x + e``;
products with +-1 exact), so the packed bits and, for equal scales, the errors and outputs are
bitwise equal to it. The scales come from float64 sums of squares in another order (8-element
partial sums, then the block or the whole message), so a scale can differ from the plain
path's in its last float32 bit, and an error with it (tests/test_cpu_compiled.py; the plain
path stays the reference). Stages listed in ``SLOW_COMPILED`` run the plain path: their
compiled loops were slower when measured.

Work goes chunk by chunk over the elements that ``x`` (or ``out``) covers; the padded tail of
the last chunk (fewer than ``8 * W`` or ``block * W`` elements) goes through plain torch. The
compiled functions take symbolic sizes (one compile each, not one per size). Compiling needs
a C++ compiler: :func:`usable` tries once, and without one warns once and leaves every call
to the plain path. :mod:`onebit.kernels.api` picks this path for CPU tensors from
``MIN_NUMEL`` elements on (smaller calls would spend more on the first compile than they
save), or with ``backend="compiled"``; ``ONEBIT_CPU_CODEC=torch`` turns it off.
"""

from __future__ import annotations

import functools
import os

import torch

from . import torch_kernels
from ._warn import warn_user
from .layout import Layout, message_bits, message_scales

# Stages whose compiled loop was slower than the plain path when measured (2^24 float32, W = 4,
# this repository's 2-core CPU, bench/RESULTS.md "Kernels on CPU"): the server's sum (unpacking
# W bit rows) and, with block scales, the error update and decompress (inductor's loops with a
# per-block scale ran 4-20x slower); these run the plain path until a faster form is found.
SLOW_COMPILED = ("server", "block-scale error updates", "block-scale decompress")
MIN_NUMEL = 1 << 20  # elements (padded N) from which api picks this path for CPU tensors
_ENV = "ONEBIT_CPU_CODEC"  # "torch": never this path; anything else: the default choice
_state: dict[str, bool] = {}


def _signs(bits: torch.Tensor) -> torch.Tensor:
    """float32 +-1 of packed bits (element 8k+i in bit 7-i of byte k), length 8 * bits.numel()."""
    shifts = torch.arange(7, -1, -1, dtype=torch.int32, device=bits.device)
    one = (bits.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return (one.to(torch.float32) * 2.0 - 1.0).reshape(-1)


def _encode(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 sum of squares of each 8 elements, packed bits of ``sgn(z)``). The sums per
    scale block are added outside (an eager sum over ``N/8`` float64s: a reduction inside the
    compiled loop over a symbolic block length ran 4x slower than the whole pass)."""
    z8 = z.view(-1, 8)
    zd = z8.to(torch.float64)
    sums8 = zd[:, 0] * zd[:, 0]
    packed = (z8[:, 0] < 0).logical_not().to(torch.int32) * 128  # NaN and -0.0: bit 1, as pack_signs
    for k in range(1, 8):  # column by column: one loop over the bytes, vectorised along them
        sums8 = sums8 + zd[:, k] * zd[:, k]
        packed = packed + (z8[:, k] < 0).logical_not().to(torch.int32) * (1 << (7 - k))
    return sums8, packed.to(torch.uint8)


def _block_sums(sums8: torch.Tensor, block: int) -> torch.Tensor:
    return sums8.view(-1, block // 8).sum(-1)


def _minus_sgn_scaled(z: torch.Tensor, scales: torch.Tensor, block: int | None) -> torch.Tensor:
    """``z - s*sgn(z)`` (``z + 0.0``: -0.0 counts as +), one scale per ``block`` elements, or
    ``scales`` a single scale broadcast over ``z`` (``block=None``)."""
    if block is None:
        return z - torch.copysign(scales, z + 0.0)
    zv = z.view(-1, block)
    return (zv - torch.copysign(scales.view(-1, 1), zv + 0.0)).view(-1)


def _scaled(signs: torch.Tensor, scales: torch.Tensor, block: int | None) -> torch.Tensor:
    if block is None:
        return signs * scales
    return (signs.view(-1, block) * scales.view(-1, 1)).view(-1)


def _worker_encode(x, e):
    return _encode(x.to(torch.float32) + e)


def _compile(fn):
    return torch.compile(fn, dynamic=True, fullgraph=True)


@functools.cache
def _fns() -> dict:
    """The compiled passes: the worker's encode, and the element-wise passes with one scale
    broadcast over the piece (no block scales; see SLOW_COMPILED for the rest). Built on first
    use: torch.compile imports torch._dynamo (about 2 s), which `import onebit` need not pay."""

    def worker_update(x, e, scales) -> None:
        e.copy_(_minus_sgn_scaled(x.to(torch.float32) + e, scales, None))

    def decode(bits, scales, out) -> None:
        out.copy_(_scaled(_signs(bits), scales, None).to(out.dtype))

    def decode_update(bits, scales, out, e, s_w) -> None:
        e.copy_(_minus_sgn_scaled(out.to(torch.float32) + e, s_w, None))
        out.copy_(_scaled(_signs(bits), scales, None).to(out.dtype))

    return {"worker_encode": _compile(_worker_encode), "worker_update": _compile(worker_update),
            "decode": _compile(decode), "decode_update": _compile(decode_update)}


def usable() -> bool:
    """Whether compiled functions run here (tried once: a compile and a check of its result);
    without a working C++ compiler warns once and answers False from then on."""
    if "ok" not in _state:
        try:
            z = torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0, -1.0, 2.0, float("nan")] * 3)[:16]
            # called as worker_compress calls it (views of pieces, autograd off): the graph
            # compiled here is the one every later call reuses, not a first of two
            with torch.no_grad():
                sums8, bits = _fns()["worker_encode"](z, torch.zeros(24)[:16])
            ok = torch.equal(bits, torch_kernels.pack_signs(z)) and sums8[0].isnan().item()
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
            sums8, packed = _fns()["worker_encode"](x[lo:mid], e[lo:mid])
            bits[j, : (mid - lo) // 8] = packed
            pieces.append(_block_sums(sums8, _block(layout, lo, mid)))
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
    if layout.block is not None:  # per-block scales: the plain path's update (see SLOW_COMPILED)
        for j, lo, hi in torch_kernels._pieces(layout):
            a, b = lo - j * layout.C, hi - j * layout.C
            torch_kernels._minus_sgn_scaled_blocks(torch_kernels._z(x, e, lo, hi),
                                                   scales[j, a // layout.block : b // layout.block], e[lo:hi])
        return
    for j, (lo, mid, hi) in enumerate(parts):
        if mid > lo:
            _fns()["worker_update"](x[lo:mid], e[lo:mid], _piece_scales(scales, layout, j, lo, lo, mid))
        if hi > mid:
            tail = _piece_scales(scales, layout, j, lo, mid, hi)
            e[mid:hi] = _minus_sgn_scaled(torch_kernels._z(x, e, mid, hi), tail, _block(layout, mid, hi))


def server_reduce(received: torch.Tensor, e: torch.Tensor, layout: Layout, out: torch.Tensor) -> None:
    """The plain path's :func:`torch_kernels.server_reduce` (see SLOW_COMPILED)."""
    torch_kernels.server_reduce(received, e, layout, out)


@torch.no_grad()
def decompress(gathered: torch.Tensor, layout: Layout, out: torch.Tensor,
               worker_error: torch.Tensor | None, worker_message: torch.Tensor | None) -> None:
    """:func:`torch_kernels.decompress`, compiled; with block scales the plain path's (see
    SLOW_COMPILED)."""
    if layout.block is not None:
        torch_kernels.decompress(gathered, layout, out, worker_error, worker_message)
        return
    scales, bits, n = message_scales(gathered, layout), message_bits(gathered, layout), out.numel()
    update = worker_error is not None and bool(torch.isfinite(scales).all())
    s_w = message_scales(worker_message, layout) if update else None
    for j in range(layout.W):
        lo, mid, hi = _split(layout, n, j)
        if mid > lo:
            fns, sj = _fns(), _piece_scales(scales, layout, j, lo, lo, mid)
            if update:
                fns["decode_update"](bits[j, : (mid - lo) // 8], sj, out[lo:mid], worker_error[lo:mid],
                                     _piece_scales(s_w, layout, j, lo, lo, mid))
            else:
                fns["decode"](bits[j, : (mid - lo) // 8], sj, out[lo:mid])
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
