"""1-bit optimizers built on onebit.collectives: torch.optim citizens, no engine needed."""

from ._freeze import AutoFreeze
from .amp import GradScaler
from .ddp import onebit_comm_hook, register_ddp_hook
from .deepspeed_config import from_deepspeed_config
from .onebit_adam import OnebitAdam
from .onebit_lamb import OnebitLamb
from .zero_one_adam import ZeroOneAdam

__all__ = [
    "AutoFreeze",
    "GradScaler",
    "OnebitAdam",
    "OnebitLamb",
    "ZeroOneAdam",
    "from_deepspeed_config",
    "onebit_comm_hook",
    "register_ddp_hook",
]
