"""GradScaler for optimizers that do not all-reduce gradients every step.

With the 1-bit optimizers, ranks see their LOCAL gradients (compression stage, 0/1 Adam's
local steps), so ``torch.amp.GradScaler``'s overflow check is local: a rank that overflows
skips ``step()`` while the others enter a collective and wait for it forever, and the
scalers drift apart. This subclass makes the check collective: after unscaling, the
found-inf flags are all-reduced (MAX) over the optimizer's process group, in place, so
every rank skips the same steps and ``update()`` moves every scaler the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives._failure import guard
from ..collectives._group import group_size

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """Drop-in for ``torch.amp.GradScaler`` (same arguments) with a collective overflow check.

    The group is the optimizer's ``process_group`` attribute (the world if it has none).
    A step it lets through has finite gradients on every rank, so a onebit optimizer skips
    its own non-finite check (and that check's collective) inside ``scaler.step``.
    """

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        verified = getattr(optimizer, "_grads_verified", None)
        if verified is None or not self.is_enabled():
            return super().step(optimizer, *args, **kwargs)
        optimizer._grads_verified = True
        try:
            return super().step(optimizer, *args, **kwargs)
        finally:
            optimizer._grads_verified = verified

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if getattr(optimizer, "_overlap", None) is not None:
            raise ValueError("optimizer: built with overlap=True, whose compressed all-reduces start in "
                             "backward, before gradients are unscaled; use overlap=False with a GradScaler")
        super().unscale_(optimizer)
        if not self.is_enabled():
            return
        group = getattr(optimizer, "process_group", None)
        if group_size(group) == 1:
            return
        flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        device = self._scale.device if self._scale is not None else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float32, device=device)
        for flag in flags.values():
            total += flag.to(device)
        with guard("GradScaler found-inf all_reduce", group):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        if not flags:  # no gradients here at all: record the group's verdict anyway
            flags[device] = total
        for flag in flags.values():
            flag.copy_(total)
