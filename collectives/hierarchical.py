"""The hierarchical compressed all-reduce on a 2-D mesh (docs/ALGORITHMS.md section 9).

With M nodes of L ranks, rank i of every node serves shard i (``s = ceil(n / L)`` elements):

1. reduce-scatter in full precision inside each node: rank i gets its node's mean of shard i
   (on gloo an all-reduce of every shard instead: gloo's reduce-scatter is the slower of the two,
   bench/HISTORY.md "Hierarchical"; NCCL reduce-scatters);
2. ``compressed_allreduce`` of shard i across the M ranks with index i (one per node), with
   this rank's error buffers (``padded_numel(s, M, block)``): every NIC is used, no rank
   leads, and across nodes each node sends about ``1 / L`` of what the flat 1-bit call sends
   (``4 / 7`` at 2 x 2 against gloo's ring all-gather: docs/ALGORITHMS.md section 9);
3. all-gather inside each node: every rank holds every shard.

Every rank ends with the same bits: after step 2 shard i is identical on the M ranks of its
cross-node group, and step 3 copies the shards unchanged. A non-finite value on any rank
gives NaN everywhere and leaves every error buffer unchanged, as the flat call does: each
rank appends one element per shard, 0 when its input is finite and NaN otherwise, which
the reduce-scatter sums into every shard of its node and step 2 adds to the shard (+0 keeps
its bits, except that -0.0 becomes +0.0 on every rank alike). One node (M = 1) is the exact
mean; one rank per node (L = 1) is the flat compressed all-reduce across nodes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels._checks import check_buffer
from ..kernels.layout import pad_unit, padded_numel
from ..kernels.rounding import ERROR_DTYPES
from ._failure import guard
from ._group import all_gather_single
from .mesh import Hierarchy
from .telemetry import CallTimer
from .wire import traffic

__all__ = ["hierarchical_allreduce", "shard_numel", "validate_hierarchical"]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def shard_numel(n: int, per_node: int) -> int:
    """Elements of the shard each rank of a node serves: ``ceil(n / per_node)``."""
    return -(-n // per_node)


def validate_hierarchical(tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                          h: Hierarchy, block: int | None) -> int:
    """Check the error buffers for ``tensor`` on ``h``; returns N (worker_error's length)."""
    s = shard_numel(tensor.numel(), h.per_node)
    unit = pad_unit(h.nodes, block)
    per = "8" if block is None else "block"
    check_buffer(
        "worker_error", worker_error, tensor.device, ERROR_DTYPES, at_least=s, multiple_of=unit,
        what=(f"float32 or bfloat16 of length N >= ceil(numel / per_node) ({s}) with "
              f"N % ({per} * nodes) == 0 ({unit}): "
              f"padded_numel({s}, {h.nodes}{'' if block is None else f', {block}'}) = "
              f"{padded_numel(s, h.nodes, block)}; onebit.collectives.error_buffers(numel, mesh) makes both"),
    )
    N = worker_error.numel()
    check_buffer("server_error", server_error, tensor.device, ERROR_DTYPES, length=N // h.nodes,
                 what=f"float32 or bfloat16 of length N / nodes = {N // h.nodes}")
    return N


def _intra_bytes(chunk: int, L: int) -> int:
    """Bytes one rank sends inside its node in a ring reduce-scatter or all-gather of L chunks
    of ``chunk`` float32 elements."""
    return (L - 1) * chunk * 4


def _sums_whole_node(h: Hierarchy) -> bool:
    """gloo: the node all-reduces every shard instead of reduce-scattering (see below)."""
    return dist.get_backend(h.intra) == "gloo"


def intra_bytes(s: int, h: Hierarchy) -> int:
    """Bytes one rank sends inside its node in one hierarchical call with shards of s elements
    (one flag per shard rides along to the node's sums)."""
    L = h.per_node
    if L == 1:
        return 0
    return (2 if _sums_whole_node(h) else 1) * _intra_bytes(s + 1, L) + _intra_bytes(s, L)


def hierarchical_allreduce(tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                           h: Hierarchy, block: int | None, compressed_allreduce) -> torch.Tensor:
    """The algorithm (module docstring) on validated arguments; ``tensor`` in place.
    ``compressed_allreduce``: the flat 1-bit all-reduce for step 2 (allreduce.py, which
    dispatches meshes here, passes its own: this module does not import it)."""

    n, L, M = tensor.numel(), h.per_node, h.nodes
    if n == 0 or h.world_size == 1:
        return tensor
    s = shard_numel(n, L)
    timer = CallTimer(tensor.device)
    with timer.stage("codec"):  # staging and the non-finite flag: local compute
        x = tensor.reshape(-1)
        staged = torch.empty(L, s + 1, dtype=torch.float32, device=tensor.device)  # row i: shard i, flag
        q, r = divmod(n, s)
        if q:
            staged[:q, :s].copy_(x[: q * s].view(q, s))
        if r:
            staged[q, :r].copy_(x[q * s :])
        staged.view(-1)[q * (s + 1) + r :].zero_()  # the padding (and the flags, set next)
        # all finite iff the smallest and the largest are (NaN and inf propagate): one pass, no
        # temporary the size of the input, no host synchronisation (isfinite().all() was 7x dearer)
        low, high = torch.aminmax(x)
        staged[:, s] = torch.where(torch.isfinite(low) & torch.isfinite(high), 0.0, float("nan"))
        shard = staged.new_empty(s + 1)
    if L > 1 and _sums_whole_node(h):
        # gloo's reduce-scatter took 2.3x its all-reduce of twice the data here (2^24 floats, 2
        # ranks: 0.144 s against 0.063 s), so on gloo the node sums every shard and each rank
        # keeps its own: the same sums on every rank of the node, twice the bytes on fast links
        with timer.stage("comm"), guard("hierarchical all-reduce (all-reduce inside the node)", h.intra):
            dist.all_reduce(staged, group=h.intra)
        traffic.intra += 2 * _intra_bytes(s + 1, L)
        shard = staged[h.local].div_(L)
    elif L > 1:
        with timer.stage("comm"), guard("hierarchical all-reduce (reduce-scatter inside the node)", h.intra):
            _reduce_scatter(shard, staged.view(-1), group=h.intra)
        traffic.intra += _intra_bytes(s + 1, L)
        shard.div_(L)
    else:
        shard = staged[0]
    body = shard[:s]
    body.add_(shard[s])  # +0, or NaN everywhere when a rank of this node had a non-finite input
    if M > 1:
        compressed_allreduce(body, worker_error, server_error, h.inter, block=block)
    if L > 1:
        gathered = torch.empty(L * s, dtype=torch.float32, device=tensor.device)
        with timer.stage("comm"), guard("hierarchical all-reduce (all-gather inside the node)", h.intra):
            all_gather_single(gathered, body, h.intra)
        traffic.intra += _intra_bytes(s, L)
    else:
        gathered = body
    with timer.stage("codec"):
        tensor.copy_(gathered[:n].view(tensor.shape))
    return tensor
