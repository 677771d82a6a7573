"""DistributedDataParallel communication hook for the 1-bit optimizers.

Under DDP, gradients are all-reduced during backward. The 1-bit optimizers need that only
on some steps (warm-up; 0/1 Adam's variance steps); on the others each rank must keep its
LOCAL gradient, because the optimizer communicates compressed momentum instead. The hook
asks the optimizer before every bucket: average in full precision, or pass the local
gradient through untouched with no communication. The optimizer, told the hook is there,
never averages the same gradients again.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..collectives._group import warn_renamed
from ..collectives.wire import ring_allreduce_bytes, traffic
from ..kernels._checks import check_instance
from ._base import OnebitOptimizerBase

__all__ = ["onebit_comm_hook", "register_ddp_hook", "warmup_averaging_hook"]


def warmup_averaging_hook(
    optimizer: OnebitOptimizerBase, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The hook that ``register_ddp_hook`` installs: a DDP bucket averaged in full precision
    over the optimizer's group when the optimizer wants averaged gradients (warm-up, 0/1 Adam's
    variance steps), else returned as it is, with no communication."""
    buffer = bucket.buffer()
    if optimizer.wants_averaged_gradients() and optimizer.world_size > 1:
        buffer.div_(optimizer.world_size)
        group = optimizer.process_group if optimizer.process_group is not None else dist.group.WORLD
        work = dist.all_reduce(buffer, group=group, async_op=True)
        traffic.full += ring_allreduce_bytes(buffer.numel(), optimizer.world_size, buffer.element_size())
        traffic.full_calls += 1
        return work.get_future().then(lambda fut: fut.value()[0])
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def register_ddp_hook(model: DistributedDataParallel, optimizer: OnebitOptimizerBase) -> None:
    """Register :func:`warmup_averaging_hook` on ``model`` for ``optimizer`` (same process group)."""
    check_instance("model", model, DistributedDataParallel, "a DistributedDataParallel")
    check_instance("optimizer", optimizer, OnebitOptimizerBase, "a onebit optimizer")
    ddp_size = dist.get_world_size(model.process_group)
    if ddp_size != optimizer.world_size:
        raise ValueError(
            f"optimizer: its group has {optimizer.world_size} ranks but the model's DDP group has {ddp_size}"
        )
    if optimizer._overlap is not None:
        raise ValueError("optimizer: built with overlap=True, which starts its own all-reduces from "
                         "backward; use overlap=False under DDP")
    model.register_comm_hook(optimizer, warmup_averaging_hook)
    optimizer.external_averaging = True


def onebit_comm_hook(
    optimizer: OnebitOptimizerBase, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Deprecated name of :func:`warmup_averaging_hook` (renamed in 0.2.0)."""
    warn_renamed("onebit_comm_hook", "onebit.optimizers.warmup_averaging_hook", optimizer.process_group)
    return warmup_averaging_hook(optimizer, bucket)
