"""Compression kernels: Triton for CUDA tensors (``triton_kernels``, ``triton_blocks``); for CPU
tensors the native C codec (``native.codec``, its C in ``native/``, bound by ``cpu_simd`` and
``cpu_fused``); the fused steps in ``fused/`` (one file per step with its Triton kernels and its C
binding, the C beside it); plain
torch (``torch_kernels``, the reference the others are tested against); a float64 reference
(:mod:`onebit.kernels.reference`) that is the oracle for tests and benchmarks. ``api`` checks
arguments and picks the implementation."""

if __name__ != "onebit.kernels":  # e.g. `import kernels` with the repository root on sys.path
    raise ImportError(f"{__name__}: this folder is the package onebit.kernels; import onebit.kernels "
                      "(a bare import would load a second copy of the library). The repository's root is "
                      "on sys.path (e.g. `python -m ...` run from it): packages that probe for a top-level "
                      "'kernels', such as transformers, then find this folder; run from another folder")

from .api import decompress, server_reduce, worker_compress
from .layout import Layout, message_bits, message_scales, padded_numel

__all__ = [
    "Layout",
    "decompress",
    "message_bits",
    "message_scales",
    "padded_numel",
    "server_reduce",
    "worker_compress",
]
