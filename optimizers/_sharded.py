"""The 1-bit optimizers on DTensor parameters: FSDP2 sharded inside a replica, HSDP across.

A model that ``fully_shard(model, mesh=mesh)`` sharded over a 2-D mesh ``("replicate",
"shard")`` has DTensor parameters placed ``(Replicate(), Shard(0))``: each rank holds a row
slice of every tensor, and the ranks of one replicate group hold the same slice. The
optimizer then works on those local slices (docs/ALGORITHMS.md 11):

- warm-up: FSDP2 averages the gradients over all ranks itself (reduce-scatter inside the
  replica, all-reduce across replicas), and Adam runs on the local slices;
- from the freeze on, FSDP2's all-reduce across replicas is switched off
  (:mod:`onebit.collectives._fsdp_replicas`): ``.grad`` holds the replica's own mean, and each
  rank compresses its slice of the momentum across the replicate group. The reduce-scatter
  inside the replica stays full precision.

The compressed all-reduces, the first step's replica comparison and ``verify_ranks`` run over
the replicate group (the ranks that hold the same slice). Whatever every rank must agree on
(non-finite gradients, the clip's norm, an automatic freeze, warnings said once) runs over all
the mesh's ranks: the *control group*. Pure FSDP (a 1-D shard mesh) has no replicas and nothing
to compress: refused with a clear error.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..collectives._fsdp_replicas import ReplicaReduction, fsdp_modules_of, is_dtensor, to_local
from ..collectives.mesh import flat_group

__all__ = ["Sharding", "local_params", "to_local"]


@dataclass(eq=False)
class Sharding:
    """The mesh the DTensor parameters live on, as the optimizer uses it (module docstring)."""

    mesh: object
    placements: tuple
    replicate_group: dist.ProcessGroup
    control_group: dist.ProcessGroup
    replicas: int  # size of the replicate group: the compressed all-reduces' world size
    shards: int
    padded_numels: list[int]  # per parameter: its slice's size in FSDP's padded row blocks
    depth: int = 0  # local_params() nesting
    reduction: ReplicaReduction | None = None  # FSDP's all-reduce switch, set at the first step

    @staticmethod
    def detect(param_groups: list[dict], group, name: str, supported: bool) -> Sharding | None:
        """None for ordinary tensors; for DTensor parameters, the Sharding, or ValueError (or
        TypeError) saying what is not supported."""
        params = [p for g in param_groups for p in g["params"]]
        dts = [p for p in params if is_dtensor(p)]
        if not dts:
            return None
        if len(dts) != len(params):
            raise TypeError("params: expected all DTensor parameters (a model sharded with fully_shard) or "
                            f"none, got {len(dts)} DTensors among {len(params)} parameters")
        if not supported:
            raise ValueError(
                f"params: {name} does not support DTensor (FSDP2/HSDP sharded) parameters: its update needs "
                "each tensor's whole norm, which no rank holds. Use OnebitAdam, or AdamW with "
                "onebit.collectives.register_fsdp_hooks(model, optimizer=opt)")
        if group is not None:
            raise ValueError("group: DTensor parameters bring their own mesh; leave group=None (the 1-bit "
                             "all-reduces run across the mesh's replicate dimension)")
        mesh, placements = dts[0].device_mesh, tuple(dts[0].placements)
        for p in dts[1:]:
            if p.device_mesh != mesh or tuple(p.placements) != placements:
                raise ValueError(f"params: expected every parameter on one mesh with one placement, got "
                                 f"{placements} and {tuple(p.placements)}")
        kinds = [type(pl).__name__ for pl in placements]
        if kinds == ["Shard"]:
            raise ValueError(
                f"params: {name} got parameters sharded over a 1-D mesh (pure FSDP): every rank holds "
                "its own slice and no replica holds the same one, so there is nothing to compress. Use "
                "torch.optim.AdamW, or shard over a 2-D mesh (\"replicate\", \"shard\") (HSDP) so that "
                "the traffic across replicas is compressed")
        if kinds != ["Replicate", "Shard"] or placements[1].dim != 0:
            raise ValueError(
                f"params: expected HSDP placements (Replicate(), Shard(0)) on a 2-D mesh (fully_shard with "
                f"mesh dims (\"replicate\", \"shard\")), got {placements}")
        if mesh.size(0) == 1:
            raise ValueError(
                f"params: {name} got parameters on a mesh with one replica ({tuple(mesh.mesh.shape)}): no "
                "replica holds the same slice, so there is nothing to compress. Use torch.optim.AdamW, or "
                "more than one replica")
        replicate, shards = mesh.get_group(0), mesh.size(1)
        padded = [-(-p.size(0) // shards) * (p.numel() // p.size(0)) if p.dim() and p.size(0) else p.numel()
                  for p in params]
        return Sharding(mesh, placements, replicate, flat_group(mesh), dist.get_world_size(replicate),
                        shards, padded)

    def adopt(self, params) -> None:
        """Find the FSDP modules that manage ``params`` and take over their all-reduce switch."""
        if self.reduction is None:
            self.reduction = ReplicaReduction(fsdp_modules_of(params))

    def wrap(self, local: torch.Tensor, p) -> torch.Tensor:
        """``local`` (this rank's slice of a tensor shaped as ``p``) as a DTensor like ``p``."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())


@contextlib.contextmanager
def local_params(opt):
    """For its duration, ``opt.param_groups`` and ``opt.state`` hold the local slices of the
    DTensor parameters (with ``.grad`` their gradients' slices) in place of the DTensors, so
    that the optimizers' maths runs on ordinary tensors. A no-op without DTensor parameters
    and when nested."""
    sharding = getattr(opt, "_sharding", None)
    if sharding is None or sharding.depth:
        yield
        return
    sharding.depth += 1
    swapped = []
    try:
        for g in opt.param_groups:
            params = g["params"]
            for i, p in enumerate(params):
                local = to_local(p)
                if p.grad is not None:
                    local.grad = to_local(p.grad)
                if p in opt.state:
                    opt.state[local] = opt.state.pop(p)
                params[i] = local
                swapped.append((params, i, p, local))
        yield
    finally:
        for params, i, p, local in swapped:
            params[i] = p
            if local in opt.state:
                opt.state[p] = opt.state.pop(local)
            local.grad = None
        sharding.depth -= 1
