"""Compressed collectives over torch.distributed (every function takes ``group=``)."""

from onebit.kernels.layout import padded_numel

from .allreduce import compressed_allreduce
from .wire import compressed_bytes, ring_allreduce_bytes, traffic

__all__ = ["compressed_allreduce", "compressed_bytes", "padded_numel", "ring_allreduce_bytes", "traffic"]
