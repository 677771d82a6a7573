"""OnebitLamb's count sketch with a hashed index (docs/ALGORITHMS.md 6.3), every backend in this file.

Element ``i`` of a tensor goes to signed bucket ``x_i mod 2k`` (bucket ``x_i mod k``, sign ``+`` below
``k``), ``x_i = fmix32(key + i * 0x9E3779B9)`` (unsigned 32-bit arithmetic, wrapping), ``key =
fmix32(seed ^ SKETCH)``: computed where the sketch reads the element, so nothing is stored per
coordinate (the drawn int32 index it replaces cost 4 bytes per parameter). ``S x = sums[:k] -
sums[k:]``, the sums in element order in float32.

Backends (``sketch`` step): ``native``, the C in ``native/sketch.c`` (one thread, the hash of a run of
elements vectorised); ``plain``, torch ops in pieces of :data:`PIECE` elements (bounded int64
temporaries), on any device. Both give the same index; on CPU the same bits (sums in element order).
The hooks' clip (``clip`` step, :func:`sketch` with ``step="clip"``) may also take ``triton``: one launch
of atomic adds (the same index, the float32 sums in no fixed order: their last bits may differ from run
to run; ``torch.use_deterministic_algorithms(True)`` keeps the plain path).
"""

from __future__ import annotations

import torch

from . import backends
from ._triton import AVAILABLE, jit, tl
from .rounding import GOLDEN, _fmix, _fmix_tl, triton_cdiv

if AVAILABLE:
    from .triton_kernels import Launch

__all__ = ["SKETCH", "SketchHash", "add_sums_", "signed", "sketch"]

SKETCH = 0x536B6574  # "Sket" in ASCII: the key of a seed is not the rounding's key of the same number
_MASK = 0xFFFFFFFF
PIECE = 1 << 16  # elements per piece of the plain path


class SketchHash:
    """The hashed index of a count sketch of ``numel`` elements into ``size`` buckets, drawn by
    ``seed``: what the sketch computes as it reads (the index itself is never stored)."""

    __slots__ = ("key", "numel", "size")

    def __init__(self, numel: int, size: int, seed: int) -> None:
        if size < 1 or (2 * size) & (2 * size - 1):
            raise ValueError(f"size: expected a power of two, got {size}")  # 2k must divide 2^32
        self.numel, self.size = int(numel), int(size)
        self.key = _fmix((int(seed) ^ SKETCH) & _MASK)  # (Python ints: the same wrapping arithmetic)

    def index(self, start: int = 0, stop: int | None = None,
              device: torch.device | str = "cpu") -> torch.Tensor:
        """The signed buckets of elements ``[start, stop)`` (int64 in ``[0, 2 * size)``)."""
        stop = self.numel if stop is None else stop
        i = torch.arange(start, stop, dtype=torch.int64, device=device)
        return _fmix((self.key + (i & _MASK) * GOLDEN) & _MASK) & (2 * self.size - 1)

    def __repr__(self) -> str:
        return f"SketchHash(numel={self.numel}, size={self.size}, key={self.key:#010x})"


@jit
def _sketch_kernel(x_ptr, n, key, sums_ptr, mask, BLOCK: tl.constexpr):
    # each element added to its signed bucket fmix32(key + i * GOLDEN) & mask (SketchHash.index), atomically
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    live = idx < n
    x = tl.load(x_ptr + idx, mask=live, other=0.0)
    bucket = _fmix_tl(key.to(tl.uint32) + idx.to(tl.uint32) * 0x9E3779B9) & mask.to(tl.uint32)
    tl.atomic_add(sums_ptr + bucket.to(tl.int64), x, mask=live)


_BLOCK = 1024


def sketch_launches(flat: torch.Tensor, n: int, key: int, sums: torch.Tensor, size: int) -> list:
    """The Triton sketch of ``flat``'s ``n`` elements into ``sums`` (``2 * size`` floats, zeroed)."""
    return [Launch(_sketch_kernel, triton_cdiv(n, _BLOCK), (flat, n, key, sums, 2 * size - 1),
                   dict(BLOCK=_BLOCK), 4)]


def sketch(x: torch.Tensor, h: SketchHash, step: str = "sketch") -> torch.Tensor:
    """``S x`` (float32 ``[h.size]``) of ``x`` (``h.numel`` elements, any float dtype); ``step``:
    ``"clip"`` lets the sums come in any order (the Triton backend; module docstring)."""
    sums = torch.zeros(2 * h.size, dtype=torch.float32, device=x.device)
    add_sums_(sums, x, h, step)
    return signed(sums)


def signed(sums: torch.Tensor) -> torch.Tensor:
    """``S x`` from the signed buckets' sums :func:`add_sums_` made: ``sums[:k] - sums[k:]``."""
    k = sums.numel() // 2
    return sums[:k] - sums[k:]


def add_sums_(sums: torch.Tensor, x: torch.Tensor, h: SketchHash, step: str = "sketch") -> torch.Tensor:
    """Add ``x``'s elements into their signed buckets' sums ``sums`` (float32, ``2 * h.size``, on
    ``x``'s device): sketches of several tensors (each its own hash) summed in one buffer, one pass
    (one launch) per tensor; :func:`signed` makes the sketch. Returns ``sums``."""
    flat = x.reshape(-1)
    if flat.numel() != h.numel:
        raise ValueError(f"x: expected {h.numel} elements (the sketch's), got {flat.numel()}")
    if sums.dtype != torch.float32 or sums.numel() != 2 * h.size or not sums.is_contiguous() \
            or sums.device != flat.device:
        raise ValueError(f"sums: expected {2 * h.size} contiguous float32 on {flat.device}, got "
                         f"{sums.numel()} {sums.dtype} on {sums.device}")
    flat = flat.to(torch.float32).contiguous()
    name = backends.select(flat.device, step).name
    if name == "triton" and not torch.are_deterministic_algorithms_enabled() and h.numel:
        for launch in sketch_launches(flat, h.numel, h.key, sums, h.size):
            launch()
    elif name == "native":
        from . import cpu_simd

        cpu_simd.library().onebit_count_sketch(flat.data_ptr(), h.numel, h.key, 2 * h.size, sums.data_ptr(),
                                               cpu_simd._isa(None))
    else:
        for a in range(0, h.numel, PIECE):
            b = min(a + PIECE, h.numel)
            sums.index_add_(0, h.index(a, b, flat.device), flat[a:b])
    return sums
