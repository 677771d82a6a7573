"""onebit: error-compensated 1-bit compressed collectives for PyTorch.

Layers (imports go one way only, and no module imports one that imports it back: checked by
tests/test_layering.py):
  onebit.kernels      sign packing, the fused compress / server-reduce / decompress kernels, and
                      Adam's preconditioning maths that optimizers and hooks share
  onebit.collectives  compressed_allreduce over torch.distributed; the DDP and FSDP2 hooks
  onebit.optimizers   1-bit optimizers built on the collectives; DiLoCo
  onebit.checkpoint, onebit.integrations (HF Trainer, Lightning, torchtitan), onebit.advise:
                      on top of the three

The names most scripts need are re-exported here: ``from onebit import OnebitAdam,
register_ddp_hook, OnebitCompressHookState, onebit_compress_hook, compressed_allreduce``; and a
script's last line, ``onebit.finish()`` (onebit.teardown).
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
from .teardown import finish

__version__ = "0.1.0"

__all__ = [
    "GradScaler", "OnebitAdam", "OnebitCompressHookState", "OnebitLamb", "ZeroOneAdam", "checkpoint",
    "compressed_allreduce", "finish", "onebit_compress_hook", "padded_numel", "register_ddp_hook",
    "register_fsdp_hooks", "verify_replicas",
]
