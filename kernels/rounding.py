"""Error buffers in bfloat16 with stochastic rounding (docs/ALGORITHMS.md 12).

An error buffer (worker or server) may be float32 or bfloat16. A bfloat16 one is widened to float32
(exact) for a call's passes and stored back with **stochastic rounding**: element ``i``, updated with
scale ``s`` (its chunk's, or its block's), is stored as the top 16 bits of ``bits(e_i) + r_i``, where
``r_i`` is the top 16 bits of ``key + i * 0x9E3779B9`` and ``key = fmix32(bits(s) ^ role)``
(``fmix32``: MurmurHash3's finaliser; unsigned 32-bit arithmetic, wrapping): per element an add and a
shift, the hash once per run of one scale. It rounds the magnitude
up with probability equal to the fraction of the gap it discards: zero-mean, so the rounding errors do
not add up to a drift the way round-to-nearest's do (section 12). The bits depend only on the value,
its index, the scale and the role (``WORKER`` or ``SERVER``): every backend (torch here, the native C
in ``native/rounding.c``, the Triton kernel below) stores the same bits, with no generator state to
keep or checkpoint; a new scale every step gives new bits every step. A NaN is stored as its top 16
bits with the quiet bit set; a value already in bfloat16 (a skipped update) is stored unchanged.

Example: ``e = 1 + 2^-9`` (bits ``0x3F804000``), ``s = 1``, worker role: ``key = 0xBC144185``,
``r_0 = 0xBC14``, so ``0x3F804000 + 0xBC14 = 0x3F80FC14`` is stored as ``0x3F80`` (1.0); at ``i = 2``,
``r_2 = 0xF883`` and the sum carries into ``0x3F81`` (``1 + 2^-7``). An element rounds up where
``r_i >= 0xC000``: a quarter of them, and the mean stored is ``e``.
"""

from __future__ import annotations

import torch

from . import backends
from ._checks import check_half_or_float
from ._triton import jit, tl

__all__ = ["ERROR_DTYPES", "SERVER", "WORKER", "check_error_dtype", "narrow_", "widen"]

ERROR_DTYPES = (torch.float32, torch.bfloat16)
WORKER = 0x576F726B  # the roles: "Work" and "Serv" in ASCII, so that the worker's and the server's
SERVER = 0x53657276  # buffers draw different bits for the same scale and index
GOLDEN = 0x9E3779B9
_MASK = 0xFFFFFFFF
_PIECE = 1 << 22  # elements per piece of the plain path (its int64 temporaries: 8 bytes each)


def check_error_dtype(error_dtype: object) -> torch.dtype:
    """``error_dtype`` if it is float32 or bfloat16 (else ValueError naming it)."""
    return check_half_or_float("error_dtype", error_dtype)


def widen(e: torch.Tensor) -> torch.Tensor:
    """``e`` as float32: ``e`` itself where it is float32, else a new float32 copy (exact)."""
    return e if e.dtype == torch.float32 else e.float()


def narrow_(dst: torch.Tensor, src: torch.Tensor, scales: torch.Tensor, unit: int, role: int) -> torch.Tensor:
    """Store float32 ``src`` into ``dst`` (contiguous, the same length): a copy where ``dst`` is float32
    (where ``dst`` is ``src``, nothing), else the stochastic rounding above, element ``i`` keyed by
    ``scales.view(-1)[i // unit]`` (float32, contiguous) and ``role``. Returns ``dst``."""
    if src.dtype != torch.float32:
        raise ValueError(f"src: expected float32 values to store, got {src.dtype}")
    if dst.dtype == torch.float32:
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
        return dst
    n = src.numel()
    if n == 0:
        return dst
    scales = scales.reshape(-1).contiguous()
    name = backends.select(src.device, "codec").name
    if name == "native":
        from . import cpu_simd

        cpu_simd.library().onebit_narrow(dst.data_ptr(), src.data_ptr(), scales.data_ptr(), n, unit, role,
                                         cpu_simd._isa(None), cpu_simd._threads(n))
    elif name == "triton":
        grid = (triton_cdiv(n, _BLOCK),)
        _narrow_kernel[grid](src, dst.view(torch.int16), scales, n, unit, role, BLOCK=_BLOCK)
    else:
        for a in range(0, n, _PIECE):
            b = min(a + _PIECE, n)
            dst[a:b] = narrow_plain(src[a:b], scales, unit, role, a)
    return dst


def _fmix(h: torch.Tensor) -> torch.Tensor:
    """fmix32 on int64 tensors holding uint32 values (products wrap; the low 32 bits kept)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK
    return h ^ (h >> 16)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & _MASK


def narrow_plain(src: torch.Tensor, scales: torch.Tensor, unit: int, role: int,
                 offset: int = 0) -> torch.Tensor:
    """The rounding in torch ops: bfloat16 ``[n]`` for float32 ``src`` whose element ``k`` is
    element ``offset + k`` of its buffer (the reference of the C and Triton versions)."""
    idx = torch.arange(offset, offset + src.numel(), dtype=torch.int64, device=src.device)
    key = _fmix(_bits(scales.reshape(-1)) ^ role)[idx // unit]
    r = ((key + idx * GOLDEN) & _MASK) >> 16
    x = _bits(src.reshape(-1))
    top = torch.where((x & 0x7FFFFFFF) > 0x7F800000, (x >> 16) | 0x40, (x + r) >> 16)
    return torch.where(top >= 0x8000, top - 0x10000, top).to(torch.int16).view(torch.bfloat16)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


_BLOCK = 1024


@jit
def _fmix_tl(h):
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@jit
def _narrow_kernel(src_ptr, dst_ptr, scales_ptr, n, unit, role, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    live = idx < n
    s = tl.load(scales_ptr + idx // unit, mask=live, other=0.0)
    key = _fmix_tl(s.to(tl.uint32, bitcast=True) ^ role.to(tl.uint32))
    r = (key + idx.to(tl.uint32) * 0x9E3779B9) >> 16
    x = tl.load(src_ptr + idx, mask=live, other=0.0).to(tl.uint32, bitcast=True)
    top = tl.where((x & 0x7FFFFFFF) > 0x7F800000, (x >> 16) | 0x40, (x + r) >> 16)
    tl.store(dst_ptr + idx, top.to(tl.uint16).to(tl.int16, bitcast=True), mask=live)



# ---- inside other kernels: an error buffer read and stored in the same pass (the fused stage) --

@jit
def load_error(addr, idx, mask, BF16: tl.constexpr):
    # the error buffer at address ``addr`` (int64), elements ``idx`` where ``mask`` (0 elsewhere), as
    # float32: bfloat16 widened exactly where BF16
    if BF16:
        h = tl.load(addr.to(tl.pointer_type(tl.uint16)) + idx, mask=mask, other=0)
        return (h.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(addr.to(tl.pointer_type(tl.float32)) + idx, mask=mask, other=0.0)


@jit
def store_error(addr, idx, value, scale, role, mask, BF16: tl.constexpr):
    # float32 ``value`` into the error buffer at ``addr``, elements ``idx`` where ``mask``: where BF16,
    # rounded stochastically as ``narrow_`` rounds element ``idx`` with ``scale`` (float32 scalar) and
    # ``role`` (a uint32 scalar): bitwise its bits
    if BF16:
        key = _fmix_tl(scale.to(tl.uint32, bitcast=True) ^ role.to(tl.uint32))
        r = (key + idx.to(tl.uint32) * 0x9E3779B9) >> 16
        x = value.to(tl.uint32, bitcast=True)
        top = tl.where((x & 0x7FFFFFFF) > 0x7F800000, (x >> 16) | 0x40, (x + r) >> 16)
        tl.store(addr.to(tl.pointer_type(tl.uint16)) + idx, top.to(tl.uint16), mask=mask)
    else:
        tl.store(addr.to(tl.pointer_type(tl.float32)) + idx, value, mask=mask)


@jit
def store_typed_error(e_ptr, idx, value, scale, role, mask):
    # float32 ``value`` into the error buffer ``e_ptr`` (a float32 or a bfloat16 tensor), elements ``idx``
    # where ``mask`` (None: every one): a bfloat16 buffer's rounded stochastically as ``narrow_`` rounds
    # element ``idx`` with ``scale`` (float32, broadcast to ``value``) and ``role``: bitwise its bits
    if e_ptr.dtype.element_ty == tl.bfloat16:
        key = _fmix_tl((scale + tl.zeros(value.shape, tl.float32)).to(tl.uint32, bitcast=True) ^ role)
        r = (key + idx.to(tl.uint32) * 0x9E3779B9) >> 16
        x = value.to(tl.uint32, bitcast=True)
        top = tl.where((x & 0x7FFFFFFF) > 0x7F800000, (x >> 16) | 0x40, (x + r) >> 16)
        tl.store(e_ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + idx, top.to(tl.uint16), mask=mask)
    else:
        tl.store(e_ptr + idx, value, mask=mask)
