"""verify_replicas: are the model replicas on all ranks still bitwise identical?

Each rank reduces every tensor to a 2 x int64 fingerprint of its bit patterns (their sum,
and their sum weighted by position, so that any single changed element and any swap of two
elements change it), the fingerprints are all-gathered, and every rank compares the same
table: all ranks return, or all raise ReplicaMismatchError naming the first tensor that
differs and the ranks that hold another version of it. Cost: one read of the tensors and
16 bytes per tensor per rank on the wire.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from ._failure import guard
from ._group import all_gather_single, comm_device, group_size

__all__ = ["ReplicaMismatchError", "fingerprints", "verify_replicas"]

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 20


class ReplicaMismatchError(RuntimeError):
    """Ranks hold different values of a tensor that should be identical on every rank."""


def _named(tensors) -> list[tuple[str, torch.Tensor]]:
    if isinstance(tensors, torch.nn.Module):
        return [(n, t) for n, t in tensors.state_dict(keep_vars=True).items()]
    if isinstance(tensors, torch.Tensor):
        raise TypeError("tensors: expected a Module or an iterable of tensors or (name, tensor) pairs, "
                        "got a single Tensor (wrap it in a list)")
    if not isinstance(tensors, Iterable):
        raise TypeError(f"tensors: expected a Module or an iterable of tensors, got {type(tensors).__name__}")
    out = []
    for i, item in enumerate(tensors):
        name, t = item if isinstance(item, tuple) else (f"tensor {i}", item)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors: item {i} is {type(t).__name__}, expected a Tensor")
        out.append((str(name), t))
    return out


@torch.no_grad()
def fingerprints(tensors) -> torch.Tensor:
    """int64 ``[len, 2]``: per tensor, the sum of its elements' bit patterns and their
    position-weighted sum (wrapping int64 arithmetic; equal for bitwise-equal tensors)."""
    named = _named(tensors)
    device = named[0][1].device if named else torch.device("cpu")
    out = torch.zeros(len(named), 2, dtype=torch.int64, device=device)
    for k, (_, t) in enumerate(named):
        flat = t.detach().reshape(-1)
        size = flat.element_size()
        bits = flat.view(torch.uint8).view(_INT[size]) if size in _INT else flat.view(torch.uint8)
        for start in range(0, bits.numel(), _CHUNK):
            c = bits[start : start + _CHUNK].to(device=device, dtype=torch.int64)
            w = torch.arange(start, start + c.numel(), dtype=torch.int64, device=device).remainder_(65521)
            out[k, 0] += c.sum()
            out[k, 1] += (c * w.add_(1)).sum()
    return out


def verify_replicas(tensors, group=None) -> int:
    """Raise ReplicaMismatchError on every rank unless ``tensors`` are bitwise equal on all.

    ``tensors``: a Module (its parameters and buffers, by name), or an iterable of tensors or
    of ``(name, tensor)`` pairs, in the same order on every rank. A collective over
    ``group``. Returns the number of tensors checked.
    """
    named = _named(tensors)
    W = group_size(group)
    if W == 1:
        return len(named)
    device = comm_device(group)
    mine = fingerprints(named).to(device)
    counts = torch.empty(W, dtype=torch.int64, device=device)
    with guard("verify_replicas", group):
        all_gather_single(counts, torch.tensor([len(named)], dtype=torch.int64, device=device), group)
    me = dist.get_rank(group)
    counts = counts.tolist()
    if len(set(counts)) > 1:
        r = next(r for r, c in enumerate(counts) if c != counts[0])
        raise ReplicaMismatchError(
            f"verify_replicas: group rank {r} passed {counts[r]} tensors but group rank 0 passed "
            f"{counts[0]} (this is group rank {me})"
        )
    table = torch.empty(W, len(named), 2, dtype=torch.int64, device=device)
    with guard("verify_replicas", group):
        all_gather_single(table.view(-1), mine.view(-1), group)
    table = table.cpu()
    differ = (table != table[0]).any(dim=2)  # [W, P]
    bad = differ.any(dim=0).nonzero().flatten().tolist()
    if bad:
        k = bad[0]
        ranks = differ[:, k].nonzero().flatten().tolist()
        raise ReplicaMismatchError(
            f"verify_replicas: {named[k][0]!r} differs between replicas: group rank(s) {ranks} hold "
            f"other values than group rank 0 ({len(bad)} of {len(named)} tensors differ; this is group "
            f"rank {me})"
        )
    return len(named)
