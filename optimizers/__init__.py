"""1-bit optimizers built on onebit.collectives: torch.optim citizens, no engine needed."""

from .onebit_adam import OnebitAdam

__all__ = ["OnebitAdam"]
