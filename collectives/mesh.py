"""A 2-D DeviceMesh (nodes x ranks per node) wherever onebit takes a process group.

``init_device_mesh(device, (nodes, per_node))`` puts the ranks of one node along the second
dimension (``node_mesh`` builds it from torchrun's environment). onebit then averages in full
precision inside each node and compresses only what crosses between nodes (see
:mod:`onebit.collectives.hierarchical`). A 1-D mesh is its one process group.

A :class:`Hierarchy` holds the process groups of one mesh as this rank sees them: ``intra``
(the ``per_node`` ranks of this rank's node), ``inter`` (the ``nodes`` ranks with this rank's
index inside their node) and ``flat`` (all ranks of the mesh: the optimizers' full-precision
averaging and agreement checks). It is built once per mesh; the first use also checks that
every rank of the mesh sees the same shape (a clear error instead of a hang later).
"""

from __future__ import annotations

import hashlib
import os
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._failure import guard
from ._group import all_gather_single, comm_device, members_group

__all__ = ["Hierarchy", "hierarchy", "is_mesh", "node_mesh", "flat_group"]

try:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
except ImportError:  # pragma: no cover - torch without DeviceMesh
    DeviceMesh = None  # type: ignore[assignment,misc]
    init_device_mesh = None  # type: ignore[assignment]


def is_mesh(group: object) -> bool:
    return DeviceMesh is not None and isinstance(group, DeviceMesh)


@dataclass(frozen=True, eq=False)
class Hierarchy:
    """The process groups of a 2-D mesh as this rank sees them (module docstring)."""

    nodes: int
    per_node: int
    intra: dist.ProcessGroup
    inter: dist.ProcessGroup
    flat: dist.ProcessGroup
    node: int  # this rank's node (its coordinate along the first dimension)
    local: int  # this rank's index inside its node

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node


# by identity, not by DeviceMesh's equality (equal layouts compare equal): every rank must run
# the agreement check at the first use of each mesh object, whatever its garbage collector kept
_CACHE: dict[int, tuple[weakref.ref, Hierarchy]] = {}
_FLAT: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _mesh_ranks(mesh) -> list[int]:
    return [int(r) for r in mesh.mesh.reshape(-1).tolist()]


def _flat(ranks: list[int], intra, inter) -> dist.ProcessGroup:
    """The process group of all the mesh's ranks (the world's own when they are the world)."""
    key = tuple(sorted(ranks))
    if key == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    found = _FLAT.get(key)
    if found is None:  # only the mesh's ranks take part (they all reach here together)
        found = _FLAT[key] = members_group(list(key), [intra, inter])
    return found


def _agree(mesh, groups: list[tuple[str, dist.ProcessGroup]]) -> None:
    """Every rank of each group sees a mesh of the same shape and ranks, or ValueError on all."""
    digest = hashlib.sha256(repr((tuple(mesh.mesh.shape), _mesh_ranks(mesh))).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    for name, group in groups:
        device = comm_device(group)
        table = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
        with guard(f"mesh agreement ({name})", group):
            all_gather_single(table, mine.to(device), group)
        if not bool((table == table[0]).all()):
            raise ValueError(f"group: the ranks of this rank's {name} group passed meshes of different "
                             f"shapes or ranks (this rank's: shape {tuple(mesh.mesh.shape)}); every rank "
                             "must build the same mesh, e.g. init_device_mesh(device, (nodes, per_node))")


def hierarchy(mesh) -> Hierarchy | None:
    """The :class:`Hierarchy` of a 2-D mesh; None for a 1-D mesh (use :func:`flat_group`).
    ValueError for more dimensions, or when this rank is not in the mesh."""
    if mesh.ndim not in (1, 2):
        raise ValueError(f"group: expected a ProcessGroup or a 1-D or 2-D DeviceMesh (nodes x ranks per "
                         f"node), got a {mesh.ndim}-D mesh of shape {tuple(mesh.mesh.shape)}")
    if mesh.get_coordinate() is None:
        raise ValueError(f"group: this rank (global rank {dist.get_rank()}) is not in the mesh "
                         f"{_mesh_ranks(mesh)}")
    if mesh.ndim == 1:
        return None
    entry = _CACHE.get(id(mesh))
    found = entry[1] if entry is not None and entry[0]() is mesh else None
    if found is None:
        nodes, per_node = (int(d) for d in mesh.mesh.shape)
        node, local = (int(c) for c in mesh.get_coordinate())
        intra, inter = mesh.get_group(1), mesh.get_group(0)
        _agree(mesh, [("node", intra), ("cross-node", inter)])
        found = Hierarchy(nodes, per_node, intra, inter, _flat(_mesh_ranks(mesh), intra, inter), node, local)
        key = id(mesh)
        _CACHE[key] = (weakref.ref(mesh, lambda _, key=key: _CACHE.pop(key, None)), found)
    return found


def flat_group(group):
    """The process group covering ``group``: itself for a ProcessGroup or None, the group of a
    1-D mesh, the group of all the ranks of a 2-D mesh."""
    if not is_mesh(group):
        return group
    h = hierarchy(group)
    return group.get_group() if h is None else h.flat


def node_mesh(per_node: int | None = None, device_type: str | None = None):
    """A 2-D mesh (nodes x ranks per node) of the whole world, from torchrun's environment:
    ``per_node`` defaults to ``LOCAL_WORLD_SIZE`` (the ranks torchrun started on this node).
    On one machine, pass ``per_node`` to emulate several nodes. Dimension names "node" and
    "local"; ``device_type`` defaults to "cuda" when available, else "cpu"."""
    world = dist.get_world_size()
    if per_node is None:
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise ValueError("per_node: not given and LOCAL_WORLD_SIZE is not set (start with torchrun)")
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    if not isinstance(per_node, int) or isinstance(per_node, bool) or per_node < 1 or world % per_node:
        raise ValueError(f"per_node: expected a positive divisor of the world size {world}, got {per_node!r}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (world // per_node, per_node), mesh_dim_names=("node", "local"))
