"""Triton where it is installed (it ships for Linux). The fused steps' files define their Triton
kernels beside their C bindings with these names whether it is or not; without it the backend table
never selects Triton (:mod:`onebit.kernels.backends`), so the kernels are never called."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the native and plain backends only
    triton = tl = None

AVAILABLE = triton is not None


def jit(fn):
    """``triton.jit`` (the function as it is without Triton)."""
    return fn if triton is None else triton.jit(fn)


def constexpr(value):
    """``tl.constexpr(value)``: a module constant a kernel may read (``value`` without Triton)."""
    return value if tl is None else tl.constexpr(value)
