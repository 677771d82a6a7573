"""FSDP2's own all-reduce across HSDP replicas, switched off while onebit compresses instead.

On a 2-D mesh ``("replicate", "shard")`` FSDP2 reduce-scatters every gradient inside the shard
group, then all-reduces the shard across the replicas in full precision (torch 2.13,
``_fsdp_collectives.foreach_reduce``), then hands it to ``.grad``. That all-reduce is the
traffic over the slow links, and the one a 1-bit optimizer or hook replaces. torch offers no
public switch that skips it and still hands the shard over: ``set_requires_all_reduce(False)``
keeps the shard back for a later all-reduce (gradient accumulation), so ``.grad`` never sees it.

:class:`ReplicaReduction` therefore swaps, per FSDP parameter group, the replicate process group
that FSDP all-reduces over (``FSDPParamGroup.mesh_info.replicate_process_group``) for a group of
this rank alone, and back. An all-reduce over one rank sends nothing, and FSDP's averaging
factor (shard size x replicate group size) then counts the shard group only: ``.grad`` holds
the replica's own mean gradient, which is what the optimizer or hook compresses. Everything
else FSDP does (all-gathers, reduce-scatters inside the replica, mixed precision, resharding)
is untouched. The attribute is a torch internal: :func:`fsdp_param_groups` checks that it is
there and says which torch it was written for when it is not.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

__all__ = ["ReplicaReduction", "fsdp_modules_of", "fsdp_param_groups", "is_dtensor", "solo_group", "to_local"]

_SOLO: dict[int, dist.ProcessGroup] = {}


def is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(t, DTensor)


def to_local(t):
    """A DTensor's local slice (an alias: writing to it writes the DTensor); anything else as is."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def solo_group() -> dist.ProcessGroup:
    """A process group of this rank alone (made once per process; only this rank takes part, and
    its hashed name leaves torch's group counter, which names the shared groups, unchanged)."""
    rank = dist.get_rank()
    found = _SOLO.get(rank)
    if found is None:
        found = _SOLO[rank] = dist.new_group([rank], use_local_synchronization=True)
    return found


def fsdp_modules_of(params) -> list[torch.nn.Module]:
    """The FSDP2 modules (``fully_shard`` applied) that manage any of ``params`` (found among
    the garbage collector's objects once: a fraction of a second)."""
    from torch.distributed.fsdp import FSDPModule

    ids = {id(p) for p in params}
    found = []
    for obj in gc.get_objects():
        if issubclass(type(obj), FSDPModule):
            if any(id(fp.sharded_param) in ids for g in _param_groups(obj) for fp in g.fsdp_params):
                found.append(obj)
    return found


def _param_groups(module) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch before the plural (one group per module)
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def fsdp_param_groups(modules) -> list:
    """The FSDP parameter groups of ``modules`` (those that manage parameters); ValueError when
    this torch's FSDP2 lacks the internals :class:`ReplicaReduction` switches."""
    groups = [g for m in modules for g in _param_groups(m)]
    for g in groups:
        info = getattr(g, "mesh_info", None)
        if info is None or not hasattr(info, "shard_process_group"):
            raise ValueError(
                f"model: this torch ({torch.__version__}) has no FSDPParamGroup.mesh_info with a shard "
                "group; onebit's FSDP2 support was written against torch 2.13's internals")
    return groups


def is_hsdp(group) -> bool:
    """Whether FSDP all-reduces this parameter group's shards across replicas itself."""
    return hasattr(group.mesh_info, "replicate_process_group")


class ReplicaReduction:
    """``full(True)``: FSDP all-reduces across replicas as it was built to; ``full(False)``: it
    does not (module docstring). Only HSDP parameter groups are touched; the setting applies
    from the next backward on.

    Off, ``.grad`` holds the replica's own estimate of what FSDP's all-reduce would have
    given, on the same scale: with FSDP's default averaging, the replica's mean; with a divide
    factor F set (``set_gradient_divide_factor``, torchtitan's F = 1 with the loss divided by
    the global token count: a sum over all ranks), R times the replica's sum / F, by setting
    the factor to F / R while off. The mean over replicas of those blocks is then FSDP's result
    in both conventions (docs/ALGORITHMS.md 11.1)."""

    def __init__(self, modules) -> None:
        self.groups = [g for g in fsdp_param_groups(modules) if is_hsdp(g)]
        self.original = [(g.mesh_info.replicate_process_group, g.gradient_divide_factor) for g in self.groups]
        self.is_full = True

    def full(self, on: bool) -> None:
        if bool(on) == self.is_full:
            return
        solo = None if on else solo_group()
        for g, (replicate, factor) in zip(self.groups, self.original, strict=True):
            g.mesh_info.replicate_process_group = replicate if on else solo
            if factor is not None:
                g.gradient_divide_factor = factor if on else factor / dist.get_world_size(replicate)
        self.is_full = bool(on)
