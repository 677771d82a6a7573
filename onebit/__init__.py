"""onebit: error-compensated 1-bit compressed collectives for PyTorch.

Layers (imports go one way only):
  onebit.kernels      sign packing and the fused compress / server-reduce / decompress kernels
  onebit.collectives  compressed_allreduce over torch.distributed
  onebit.optimizers   1-bit optimizers built on the collectives

The names most scripts need are re-exported here: ``from onebit import OnebitAdam,
register_ddp_hook, OnebitCompressHookState, onebit_compress_hook, compressed_allreduce``.
"""

from . import checkpoint
from .collectives import (
    OnebitCompressHookState,
    compressed_allreduce,
    onebit_compress_hook,
    padded_numel,
    register_fsdp_hooks,
    verify_replicas,
)
from .optimizers import GradScaler, OnebitAdam, OnebitLamb, ZeroOneAdam, register_ddp_hook

__version__ = "0.1.0"

__all__ = [
    "GradScaler", "OnebitAdam", "OnebitCompressHookState", "OnebitLamb", "ZeroOneAdam", "checkpoint",
    "compressed_allreduce", "onebit_compress_hook", "padded_numel", "register_ddp_hook",
    "register_fsdp_hooks", "verify_replicas",
]
