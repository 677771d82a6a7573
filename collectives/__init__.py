"""Compressed collectives over torch.distributed (every function takes ``group=``)."""

from onebit.kernels.layout import padded_numel

from ._failure import CollectiveError
from .allreduce import compressed_allreduce
from .local import local_compressed_allreduce
from .replicas import ReplicaMismatchError, fingerprints, verify_replicas
from .wire import compressed_bytes, ring_allreduce_bytes, traffic

__all__ = [
    "CollectiveError", "ReplicaMismatchError", "compressed_allreduce", "compressed_bytes", "fingerprints",
    "local_compressed_allreduce", "padded_numel", "ring_allreduce_bytes", "traffic", "verify_replicas",
]
