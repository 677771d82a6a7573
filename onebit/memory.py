"""The bytes of state an object holds, counted from outside as a user's profiler would: every tensor
reachable from it (attributes, containers, the closures of its hooks), each storage counted once, the
parameters' and gradients' storages left out. The models reachable from it (``torch.nn.Module``) are
not its state and are not walked. (The 1-bit optimizers' ``stats()["state_bytes_per_parameter"]``
counts the same; the code lives in :mod:`onebit.optimizers._memory`.)

    from onebit.memory import bytes_per_parameter
    bytes_per_parameter(opt)               # the optimizer's state per parameter
    bytes_per_parameter(opt, hook_state)   # AdamW behind the DDP hook: the optimizer's and the hook's
"""

from __future__ import annotations

from .optimizers._memory import bytes_per_parameter, state_bytes

__all__ = ["bytes_per_parameter", "state_bytes"]
