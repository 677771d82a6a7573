"""The local compute of one compressed_allreduce for all W ranks, in one process.

What every rank computes (worker compress, the server reduce of its chunk, decompress with
the deferred error update), with the all-to-all and the all-gather replaced by slicing. The
tests compare it against the collective bit for bit; at W = 1 it runs the whole compute
that compressed_allreduce skips (its W = 1 call is the identity), which is what the
benchmarks time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import Layout
from ..kernels._checks import check_instance
from ._stages import Stages
from .allreduce import validate

__all__ = ["local_compressed_allreduce"]


@torch.no_grad()
def local_compressed_allreduce(
    tensors: Sequence[torch.Tensor],
    worker_errors: Sequence[torch.Tensor],
    server_errors: Sequence[torch.Tensor],
    *,
    backend: str | None = None,
    block: int | None = None,
) -> list[torch.Tensor]:
    """Run one compressed_allreduce of a W-rank group locally, ``W = len(tensors)``.

    ``tensors[r]``, ``worker_errors[r]`` and ``server_errors[r]`` are what rank ``r`` would
    pass (validated like compressed_allreduce's arguments). Each tensor is replaced in place
    by rank ``r``'s result (identical for every ``r``) and each rank's errors are updated as
    the collective would update them. ``backend``: as for the kernels (None: Triton on CUDA,
    torch on CPU); ``block``: as for compressed_allreduce. Returns ``tensors`` as a list.
    """
    per_rank = (("tensors", tensors), ("worker_errors", worker_errors), ("server_errors", server_errors))
    for name, seq in per_rank:
        check_instance(name, seq, list | tuple, "a list with one tensor per rank")
    W = len(tensors)
    if W < 1 or len(worker_errors) != W or len(server_errors) != W:
        raise ValueError(f"tensors: expected W >= 1 tensors and W error buffers of each kind, got "
                         f"{len(tensors)}, {len(worker_errors)}, {len(server_errors)}")
    N = 0
    for r in range(W):
        N = validate(tensors[r], worker_errors[r], server_errors[r], W, block)
    layout = Layout(N, W, block)
    ranks = [Stages(t, we, se, layout, backend=backend)
             for t, we, se in zip(tensors, worker_errors, server_errors, strict=True)]
    msgs = [rank.encode() for rank in ranks]
    # the all-to-all: chunk j of every rank's message goes to rank j; the all-gather: every segment
    gathered = torch.cat([ranks[j].serve(torch.cat([m.view(W, layout.segment_bytes)[j] for m in msgs]))
                          for j in range(W)])
    for rank in ranks:
        rank.decode(gathered)
    return list(tensors)
