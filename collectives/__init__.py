"""Compressed collectives over torch.distributed (every function takes ``group=``)."""

from onebit.kernels.layout import padded_numel

from .allreduce import compressed_allreduce

__all__ = ["compressed_allreduce", "padded_numel"]
