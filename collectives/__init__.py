"""Compressed collectives over torch.distributed (every function takes ``group=``)."""

if __name__ != "onebit.collectives":  # e.g. `import collectives` with the repository root on sys.path
    raise ImportError(f"{__name__}: this folder is the package onebit.collectives; import onebit.collectives "
                      "(a bare import would load a second copy of the library)")

from ..kernels.layout import padded_numel
from ._deprecated import OnebitHookState, onebit_hook
from ._failure import CollectiveError
from .allreduce import compressed_allreduce, error_buffers
from .ddp_hook import OnebitCompressHookState, onebit_compress_hook
from .fsdp_hook import FSDPHooks, OnebitAllReduceHook, register_fsdp_hooks
from .local import local_compressed_allreduce
from .mesh import node_mesh
from .replicas import ReplicaMismatchError, fingerprints, verify_replicas
from .wire import compressed_bytes, ring_allreduce_bytes, traffic

__all__ = [
    "CollectiveError", "FSDPHooks", "OnebitAllReduceHook", "OnebitCompressHookState", "ReplicaMismatchError",
    "compressed_allreduce", "compressed_bytes", "error_buffers", "fingerprints",
    "local_compressed_allreduce", "node_mesh", "onebit_compress_hook", "padded_numel", "register_fsdp_hooks",
    "ring_allreduce_bytes", "traffic", "verify_replicas",
    # deprecated names (CHANGELOG.md), removed in 0.3.0
    "OnebitHookState", "onebit_hook",
]
