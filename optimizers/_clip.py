"""Gradient clipping by a norm every rank agrees on (``opt.clip_grad_norm_``).

``torch.nn.utils.clip_grad_norm_`` before a 1-bit optimizer's ``step()`` sees this rank's own
gradients (always without DDP; after the freeze with DDP, whose hook then passes them through),
so each rank would clip by its own factor and the logged norms would jump at the freeze. Here
the local norms are combined over the group by one float64 all-reduce, so every rank gets the
same norm and the same factor: the p-mean over ranks, ``(mean_r ||g_r||_p^p)^(1/p)`` (for
p = 2 the root mean square of the local norms; ``inf``: the largest). By the triangle
inequality it is at least the norm of the averaged gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from ..collectives._failure import guard
from ..collectives._group import comm_device, group_size
from ..kernels._checks import check_number


def agreed_norm(grads: list[torch.Tensor], norm_type: float, group,
                replicas: int | None = None) -> torch.Tensor:
    """The p-mean over the group's ranks of the local ``norm_type``-norms of ``grads`` (float64,
    0-dim, on the gradients' device; bitwise the same on every rank). ``replicas``: the group's
    ranks hold slices of that many replicas (HSDP: the sums over a replica's slices make its
    norm), so the p-mean is over replicas; default: every rank is one replica."""
    device = grads[0].device if grads else comm_device(group)
    inf = norm_type == math.inf
    parts = [g.detach().abs().max().double() if inf else g.detach().double().abs().pow(norm_type).sum()
             for g in grads if g.numel()]
    local = torch.stack(parts).max() if inf and parts else torch.stack(parts).sum() if parts else \
        torch.zeros((), dtype=torch.float64, device=device)
    W = group_size(group)
    if W > 1:
        flat = local.reshape(1).to(comm_device(group))
        with guard("clip_grad_norm_ all_reduce", group):
            dist.all_reduce(flat, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        local = flat.reshape(()).to(device)
    return local if inf else (local / (W if replicas is None else replicas)).pow(1.0 / norm_type)


def clip_grads_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float, group,
                replicas: int | None = None) -> torch.Tensor:
    """Scale every gradient in ``params`` by ``min(1, max_norm / (norm + 1e-6))`` with the agreed
    norm (as torch's clip_grad_norm_ does with its own); returns the norm."""
    max_norm = check_number("max_norm", max_norm, low=0.0)
    norm_type = check_number("norm_type", norm_type, low_open=True)  # math.inf: the largest element
    grads = [p.grad for p in params if p.grad is not None]
    norm = agreed_norm(grads, norm_type, group, replicas)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return norm
