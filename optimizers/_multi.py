"""Multi-tensor forms of the per-parameter maths in :mod:`._functional`, for GPU parameters.

On a GPU an optimizer step over ~100 parameter tensors is bound by the host, not by memory:
each per-tensor op is one kernel launch of a few microseconds of device time (bench/TRAFFIC.md
section 7).
Here each op runs once over a list of tensors (``torch._foreach_*``: a few launches for
the whole list), with the same formulas in the same order as the per-tensor functions, so
the results are those of :mod:`._functional` (tests/test_cuda.py compares them).

The optimizers use these forms when :func:`applies` says so: every tensor on a CUDA device
(tests/test_multi.py replaces it to run either form on either device).
On CPU the per-tensor functions and the fused CPU passes (:mod:`onebit.kernels.cpu_fused`)
stay: torch's CPU ``_foreach`` ops are loops over the same per-tensor ops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["adam_update_", "applies", "by_group", "fold_", "fold_preconditioned_", "fold_scaled_",
           "in_batches", "moments_",
           "stale_step_", "stale_update_"]

Tensors = Sequence[torch.Tensor]


def applies(tensors: Tensors) -> bool:
    """Whether the multi-tensor forms should run on ``tensors`` (all on CUDA)."""
    return bool(tensors) and all(t.is_cuda for t in tensors)


def by_group(rows):
    """Rows ``(group, *tensors)`` gathered per param group, in first-seen order: a list of
    ``(group, [column 1], [column 2], ...)`` (the multi-tensor ops take one lr, one beta)."""
    out: dict[int, tuple] = {}
    for g, *cols in rows:
        entry = out.setdefault(id(g), (g, *([] for _ in cols)))
        for lst, x in zip(entry[1:], cols, strict=True):
            lst.append(x)
    return list(out.values())


def in_batches(pairs, limit: int = 1 << 24):
    """``(k, (p, g))`` of the compressed parameters ``pairs`` in consecutive batches of at most
    ``limit`` elements in all (a larger parameter alone): the multi-tensor ops over stale
    denominators made per batch, so those transients never hold more than ``limit`` float32 at once
    (docs/ALGORITHMS.md 6.2)."""
    batch, size = [], 0
    for k, (p, g) in enumerate(pairs):
        if batch and size + p.numel() > limit:
            yield batch
            batch, size = [], 0
        batch.append((k, (p, g)))
        size += p.numel()
    if batch:
        yield batch


def _with_grads(targets: Tensors, grads: Sequence[torch.Tensor | None], *others: Tensors):
    """The entries whose gradient is not None, as lists (targets, grads, *others)."""
    keep = [i for i, g in enumerate(grads) if g is not None]
    return [[seq[i] for i in keep] for seq in (targets, grads, *others)]


def fold_(ms: Tensors, grads: Sequence[torch.Tensor | None], beta1: float) -> None:
    """``m = b1*m + (1-b1)*g`` for every pair (``g=None``: zero), as ``_functional.fold_``."""
    torch._foreach_mul_(list(ms), beta1)
    ms_, gs = _with_grads(ms, grads)
    if ms_:
        torch._foreach_add_(ms_, gs, alpha=1.0 - beta1)


def fold_preconditioned_(us: Tensors, grads: Sequence[torch.Tensor | None], denoms: Tensors,
                         beta1: float) -> None:
    """``u = b1*u + (1-b1) * g / denom`` (``g=None``: zero), as ``_functional.fold_preconditioned_``."""
    torch._foreach_mul_(list(us), beta1)
    us_, gs, ds = _with_grads(us, grads, denoms)
    if us_:
        torch._foreach_addcdiv_(us_, gs, ds, value=1.0 - beta1)


def fold_scaled_(ms: Tensors, xs: Tensors, denoms: Tensors, beta1: float) -> None:
    """``m = b1*m + (1-b1) * x * denom`` (ZeroOneAdam's phase-1 fold of a preconditioned gradient)."""
    torch._foreach_mul_(list(ms), beta1)
    torch._foreach_addcmul_(list(ms), list(xs), list(denoms), value=1.0 - beta1)


def moments_(ms: Tensors, vs: Tensors, grads: Tensors, betas: tuple[float, float]) -> None:
    """Adam's moments, as ``_functional.moments_``."""
    b1, b2 = betas
    torch._foreach_mul_(list(ms), b1)
    torch._foreach_add_(list(ms), list(grads), alpha=1.0 - b1)
    torch._foreach_mul_(list(vs), b2)
    torch._foreach_addcmul_(list(vs), list(grads), list(grads), value=1.0 - b2)


def adam_update_(ps: Tensors, ms: Tensors, vs: Tensors, *, lr: float, eps: float, weight_decay: float,
                 bc1: float, bc2: float, eps_inside_sqrt: bool) -> None:
    """``p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)``, as ``_functional.adam_update``."""
    ps, ms, vs = list(ps), list(ms), list(vs)
    if weight_decay:
        torch._foreach_mul_(ps, 1.0 - lr * weight_decay)
    if eps_inside_sqrt:
        denom = torch._foreach_div(vs, bc2) if bc2 != 1.0 else torch._foreach_add(vs, eps)
        if bc2 != 1.0:
            torch._foreach_add_(denom, eps)
        torch._foreach_sqrt_(denom)
    else:
        denom = torch._foreach_sqrt(vs)
        if bc2 != 1.0:
            torch._foreach_div_(denom, math.sqrt(bc2))
        torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(ps, ms, denom, value=-lr / bc1)


def _direction(ms: list, denoms: list | None, clip: float | None, bc1: float) -> list:
    """``clip(m / denom / bc1)`` as new tensors (``denoms=None``: m is preconditioned)."""
    if denoms is not None:
        upd = torch._foreach_div(ms, denoms)
        if bc1 != 1.0:
            torch._foreach_div_(upd, bc1)
    elif bc1 != 1.0:
        upd = torch._foreach_div(ms, bc1)
    elif clip is not None:
        upd = torch._foreach_clamp_max(ms, clip)  # clamp(-c, c) == clamp_min(clamp_max(c), -c)
        torch._foreach_clamp_min_(upd, -clip)
        return upd
    else:
        return ms  # read only
    if clip is not None:
        torch._foreach_clamp_max_(upd, clip)
        torch._foreach_clamp_min_(upd, -clip)
    return upd


def stale_update_(ps: Tensors, ms: Tensors, *, lr: float, weight_decay: float, clip: float | None,
                  bc1: float = 1.0) -> None:
    """OnebitAdam's compression-stage update on preconditioned momenta:
    ``p = p * (1 - lr*wd) - lr * clip(m / bc1)`` (as ``OnebitAdam._apply_stale`` per tensor)."""
    ps = list(ps)
    upd = _direction(list(ms), None, clip, bc1)
    if weight_decay:
        torch._foreach_mul_(ps, 1.0 - lr * weight_decay)
    torch._foreach_add_(ps, upd, alpha=-lr)


def stale_step_(ps: Tensors, ms: Tensors, denoms: Tensors, *, lr: float, weight_decay: float,
                clip: float | None) -> None:
    """``p -= lr * (clip(m / denom) + wd * p)``: ``_functional.stale_direction`` then ``p.add_``."""
    ps = list(ps)
    upd = _direction(list(ms), list(denoms), clip, 1.0)
    if weight_decay > 0:
        torch._foreach_add_(upd, ps, alpha=weight_decay)
    torch._foreach_add_(ps, upd, alpha=-lr)
