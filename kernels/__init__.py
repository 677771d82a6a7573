"""Compression kernels: Triton for CUDA tensors, plain torch for CPU tensors, and a float64
reference (:mod:`onebit.kernels.reference`) that is the oracle for tests and benchmarks."""

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
