"""Process-group helpers: size, membership, all-gather, and the agreement check."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from ..kernels._checks import check_group
from ..kernels._warn import warn_user
from ._failure import guard

# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """Gather every rank's ``input`` into ``output``; with ``async_op``, returns the Work."""
    return _all_gather(output, input, group=group, async_op=async_op)


def group_size(group: dist.ProcessGroup | None) -> int:
    """W for ``group``; 1 when torch.distributed is not initialised and no group is given
    (validated: see :func:`onebit.kernels._checks.check_group`)."""
    return check_group(group)


def verify_agreement(tensor: torch.Tensor, N: int, group, block: int | None = None) -> None:
    """Raise ValueError on every rank unless all ranks pass the same numel, N, dtype and block."""
    W = group_size(group)
    if W == 1:
        return
    mine = [tensor.numel(), N, _DTYPE_CODES[tensor.dtype], 0 if block is None else block]
    device = tensor.device if tensor.is_cuda else torch.device("cpu")
    rows = torch.empty(W * 4, dtype=torch.int64, device=device)
    with guard("check", group):
        all_gather_single(rows, torch.tensor(mine, dtype=torch.int64, device=device), group)
    table = rows.view(W, 4).tolist()
    names = {v: str(k).removeprefix("torch.") for k, v in _DTYPE_CODES.items()}
    me = dist.get_rank(group)
    for r, row in enumerate(table):
        if row != table[0]:
            def show(x):
                return f"numel={x[0]}, N={x[1]}, dtype={names[x[2]]}, block={x[3] or None}"

            raise ValueError(
                f"check: ranks disagree: group rank {r} passed {show(row)} but group rank 0 "
                f"passed {show(table[0])} (this is group rank {me})"
            )


def comm_device(group) -> torch.device:
    """Where small control tensors for ``group`` must live: the current GPU for NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_json(obj, group, operation: str) -> list:
    """Every rank's JSON-serialisable ``obj``, indexed by group rank (two all-gathers).

    JSON, not pickle: what comes from a peer is parsed as data and never executed.
    """
    W = group_size(group)
    if W == 1:
        return [obj]
    device = comm_device(group)
    data = json.dumps(obj, sort_keys=True).encode()
    sizes = torch.empty(W, dtype=torch.int64, device=device)
    with guard(operation, group):
        all_gather_single(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device), group)
    width = int(sizes.max())
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = torch.empty(W * width, dtype=torch.uint8, device=device)
    with guard(operation, group):
        all_gather_single(rows, mine.to(device), group)
    rows = rows.view(W, width).cpu()
    return [json.loads(bytes(rows[r, : int(sizes[r])].tolist())) for r in range(W)]


def warn_collective(message: str, category: type[Warning], group) -> None:
    """A warning about a condition every rank of ``group`` sees alike (a step skipped on every
    rank, masked coordinates, a bucket layout that changed): raised on group rank 0 only, so a
    run prints it once instead of once per rank; attributed to the user's line (warn_user)."""
    if dist.is_available() and dist.is_initialized() and dist.get_rank(group) > 0:
        return
    warn_user(message, category)


_renamed_warned: set[str] = set()


def warn_renamed(old: str, new: str, group) -> None:
    """One FutureWarning per process (shown on the group's rank 0) that the public name ``old``
    is ``new`` now (CHANGELOG.md)."""
    if old in _renamed_warned:
        return
    _renamed_warned.add(old)
    warn_collective(f"onebit: {old} is deprecated and will be removed in 0.3.0; use {new} (the same "
                    "object under a name that says what it does; CHANGELOG.md)", FutureWarning, group)


def members_group(ranks: list[int], via: list) -> dist.ProcessGroup:
    """A new process group over ``ranks`` (a subset of the world) that only its members create.

    ``new_group(..., use_local_synchronization=True)`` names such a group by a hash of its ranks
    and of how many groups this process already knows, and each process knows only the groups
    it belongs to: members with different histories (ranks 0-1 of {0, 1} where rank 1 is also in
    {1, 2}) would pick different names, rendezvous under different store keys and wait for each
    other forever. So the members first agree on the largest count (a maximum over the groups
    ``via``, which together connect all of them: the group itself, or a mesh's two dimensions
    one after the other) and the ones behind catch up with one-rank groups of their own.
    """
    from torch.distributed import distributed_c10d as c10d

    known = torch.tensor([len(c10d._world.pg_names)], dtype=torch.int64)
    for group in via:
        device = comm_device(group)
        counts = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
        with guard("group creation", group):
            all_gather_single(counts, known.to(device), group)
        known = counts.max().cpu().reshape(1)
    while len(c10d._world.pg_names) < int(known):
        dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return dist.new_group(sorted(ranks), use_local_synchronization=True)
