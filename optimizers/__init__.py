"""1-bit optimizers built on onebit.collectives: torch.optim citizens, no engine needed."""

from .amp import GradScaler
from .ddp import onebit_comm_hook, register_ddp_hook
from .onebit_adam import OnebitAdam
from .onebit_lamb import OnebitLamb
from .zero_one_adam import ZeroOneAdam

__all__ = [
    "GradScaler",
    "OnebitAdam",
    "OnebitLamb",
    "ZeroOneAdam",
    "onebit_comm_hook",
    "register_ddp_hook",
]
