"""DistributedDataParallel communication hook for the 1-bit optimizers.

Under DDP, gradients are all-reduced during backward. The 1-bit optimizers need that only
on some steps (warm-up; 0/1 Adam's variance steps); on the others each rank must keep its
LOCAL gradient, because the optimizer communicates compressed momentum instead. The hook
asks the optimizer before every bucket: average in full precision, or pass the local
gradient through untouched with no communication. The optimizer, told the hook is there,
never averages the same gradients again.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..collectives._group import warn_collective, warn_renamed
from ..collectives._unwrap import unwrap_optimizer
from ..collectives.telemetry import CallTimer
from ..kernels._checks import check_instance

# This module does not import _base (which imports it for adopt_ddp_model): a 1-bit optimizer
# is recognised by what it offers.
OnebitOptimizer = torch.optim.Optimizer  # annotations; _is_onebit() is the check


def _is_onebit(optimizer) -> bool:
    return isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "wants_averaged_gradients") \
        and hasattr(optimizer, "external_averaging")

__all__ = ["onebit_comm_hook", "register_ddp_hook", "warmup_averaging_hook"]


def warmup_averaging_hook(
    optimizer: OnebitOptimizer, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The hook that ``register_ddp_hook`` installs: a DDP bucket averaged in full precision
    over the optimizer's group when the optimizer wants averaged gradients (warm-up, 0/1 Adam's
    variance steps), else returned as it is, with no communication."""
    if not _is_onebit(optimizer):
        raise TypeError(
            f"warmup_averaging_hook: its state must be a onebit 1-bit optimizer, got "
            f"{type(optimizer).__name__}; install it with onebit.optimizers.register_ddp_hook(model, "
            "opt). To compress a DDP model's gradients for another optimizer, register "
            "onebit.collectives.onebit_compress_hook with an OnebitCompressHookState")
    buffer = bucket.buffer()
    if optimizer.wants_averaged_gradients() and optimizer.world_size > 1:
        buffer.div_(optimizer.world_size)
        group = optimizer.process_group if optimizer.process_group is not None else dist.group.WORLD
        timer, start = CallTimer(buffer.device, optimizer.traffic), time.perf_counter()
        work = dist.all_reduce(buffer, group=group, async_op=True)
        optimizer.count_sent(buffer.numel(), buffer.element_size())
        # the parameters whose gradients DDP averaged for this step (a cohort does not average them again)
        optimizer._ddp_averaged_params.update(id(p) for p in bucket.parameters())

        def done(fut) -> torch.Tensor:
            timer.add("full", time.perf_counter() - start)  # launch to completion
            return fut.value()[0]

        return work.get_future().then(done)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def register_ddp_hook(model: DistributedDataParallel, optimizer: OnebitOptimizer) -> None:
    """Register :func:`warmup_averaging_hook` on ``model`` for ``optimizer`` (same process group).
    A framework's wrapper around the optimizer (``.optimizer`` holds it) is unwrapped."""
    optimizer = unwrap_optimizer(optimizer)
    check_instance("model", model, DistributedDataParallel, "a DistributedDataParallel")
    if not _is_onebit(optimizer):
        raise TypeError(f"optimizer: expected a onebit optimizer, got {type(optimizer).__name__}")
    ddp_size = dist.get_world_size(model.process_group)
    if ddp_size != optimizer.world_size:
        hint = (" (it was built before init_process_group: build the optimizer once the process group "
                "exists, e.g. after Accelerator() or fabric.launch())" if optimizer.world_size == 1 else "")
        raise ValueError(
            f"optimizer: its group has {optimizer.world_size} ranks but the model's DDP group has {ddp_size}"
            + hint)
    if optimizer._overlap is not None:
        raise ValueError("optimizer: built with overlap=True, which starts its own all-reduces from "
                         "backward; use overlap=False under DDP")
    model.register_comm_hook(optimizer, warmup_averaging_hook)
    optimizer.external_averaging = True


def onebit_comm_hook(
    optimizer: OnebitOptimizer, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Deprecated name of :func:`warmup_averaging_hook` (renamed in 0.2.0)."""
    warn_renamed("onebit_comm_hook", "onebit.optimizers.warmup_averaging_hook", optimizer.process_group)
    return warmup_averaging_hook(optimizer, bucket)


def adopt_ddp_model(optimizer: OnebitOptimizer) -> None:
    """At a 1-bit optimizer's first step (once per process): if its parameters belong to a
    DistributedDataParallel model that ``register_ddp_hook`` was not called for, DDP would
    all-reduce full-precision gradients every step on top of the optimizer's own traffic.
    Without a communication hook on that model, install :func:`warmup_averaging_hook` (what
    ``register_ddp_hook`` does) and say so once for the group; with another hook on it (e.g.
    ``onebit_compress_hook``: the gradients would be compressed twice), refuse with what to do.
    Finding the model scans the garbage collector's objects once (a fraction of a second)."""
    import gc

    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    # issubclass(type(obj)), not isinstance: isinstance reads obj.__class__, and some objects
    # (torch.distributed.reduce_op) warn when their attributes are read
    owners = [obj for obj in gc.get_objects() if issubclass(type(obj), DistributedDataParallel)
              and any(id(p) in ids for p in obj.parameters())]
    for model in owners:
        hooks = [hook for hook, _ in getattr(model, "_comm_hooks", [])]
        if any(hook is warmup_averaging_hook or hook is onebit_comm_hook for hook in hooks):
            continue
        if hooks:
            names = ", ".join(getattr(h, "__name__", repr(h)) for h in hooks)
            raise ValueError(
                f"step: {type(optimizer).__name__}'s parameters belong to a DistributedDataParallel "
                f"model with a communication hook ({names}): the gradients would be averaged (or "
                "compressed) twice. A 1-bit optimizer compresses its own momentum: build the DDP model "
                "without that hook and call onebit.optimizers.register_ddp_hook(model, opt)")
        register_ddp_hook(model, optimizer)
        warn_collective(
            f"onebit: {type(optimizer).__name__}'s parameters belong to a DistributedDataParallel model "
            "without register_ddp_hook, so DDP would all-reduce full-precision gradients every step on "
            "top of the optimizer's own 1-bit traffic; onebit registered the hook for you "
            "(onebit.optimizers.register_ddp_hook(model, opt) right after building both says so "
            "explicitly and silences this)", RuntimeWarning, optimizer.process_group)

