"""Adam's preconditioning from a frozen variance: the floor under ``sqrt(v)`` and the stale
denominator (docs/ALGORITHMS.md 6 and 8.2). Pure tensor maths, shared by the 1-bit optimizers
(``onebit.optimizers``) and the hooks that run torch's Adam in the same space
(``onebit.collectives``), so it lives below both.
"""

from __future__ import annotations

import math

import torch

__all__ = ["sqrt_v_floors", "stale_denominator"]


def sqrt_v_floors(variances: list[torch.Tensor], ratio: float) -> list[torch.Tensor]:
    """Per tensor, ``ratio`` times the mean of its nonzero ``sqrt(v)`` (a 0-dim float32 on its
    device). A tensor whose variance is all zero (it never had a gradient) takes ``ratio``
    times the mean of the other tensors' means: nothing better is known about it, and a
    floor of zero would let one such coordinate's ``g / eps`` swamp its chunk's scale. No
    host synchronisation."""
    means = []
    for v in variances:
        s = v.sqrt()
        count = torch.count_nonzero(s).clamp_(min=1)
        means.append((s.sum(dtype=torch.float64) / count).to(torch.float32))
    if not means:
        return []
    stacked = torch.stack([m.to(means[0].device) for m in means])
    known = (stacked > 0).sum().clamp_(min=1)
    fallback = stacked.sum() / known
    return [(ratio * torch.where(m > 0, m, fallback.to(m.device))).to(torch.float32) for m in means]


def stale_denominator(
    v: torch.Tensor, floor: torch.Tensor | None, eps: float, bc2: float = 1.0, eps_inside_sqrt: bool = False,
) -> torch.Tensor:
    """Adam's denominator from a frozen (or not refreshed) variance, each ``sqrt(v)`` raised to
    at least ``floor`` first (None: no floor): ``max(sqrt(v), floor) / sqrt(bc2) + eps``, or
    ``sqrt(max(v, floor^2) / bc2 + eps)`` with ``eps_inside_sqrt``. A new tensor. Without a
    floor and bias correction it is bitwise ``v.sqrt() + eps``, the reference's."""
    if eps_inside_sqrt:
        w = v.clamp(min=floor * floor) if floor is not None else v.clone()
        if bc2 != 1.0:
            w.div_(bc2)
        return w.add_(eps).sqrt_()
    d = v.sqrt()
    if floor is not None:
        d = torch.maximum(d, floor)
    if bc2 != 1.0:
        d.div_(math.sqrt(bc2))
    return d.add_(eps)
