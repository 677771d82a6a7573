"""1-bit optimizers built on onebit.collectives: torch.optim citizens, no engine needed."""

if __name__ != "onebit.optimizers":  # e.g. `import optimizers` with the repository root on sys.path
    raise ImportError(f"{__name__}: this folder is the package onebit.optimizers; import onebit.optimizers "
                      "(a bare import would load a second copy of the library)")

from ._freeze import AutoFreeze
from .amp import GradScaler
from .combined import Combined
from .ddp import onebit_comm_hook, register_ddp_hook, warmup_averaging_hook
from .deepspeed_config import from_deepspeed_config
from .diloco import DiLoCo
from .onebit_adam import OnebitAdam
from .onebit_lamb import OnebitLamb
from .zero_one_adam import ZeroOneAdam

__all__ = [
    "AutoFreeze",
    "Combined",
    "DiLoCo",
    "GradScaler",
    "OnebitAdam",
    "OnebitLamb",
    "ZeroOneAdam",
    "from_deepspeed_config",
    "register_ddp_hook",
    "warmup_averaging_hook",
    "onebit_comm_hook",  # deprecated name (CHANGELOG.md), removed in 0.3.0
]
