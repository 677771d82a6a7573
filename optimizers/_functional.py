"""Optimizer maths as plain functions on tensors; the optimizer classes decide which runs when.

See docs/ALGORITHMS.md sections 3-4 for the update rules and docs/TRAINING.md for the
automatic momentum mask (why compressed momentum needs it, and how it is chosen).
"""

from __future__ import annotations

import torch

__all__ = ["tiny_variance_mask"]


def tiny_variance_mask(v: torch.Tensor, ratio: float) -> torch.Tensor | None:
    """Which coordinates of one tensor must not take compressed updates, judged by ``v``.

    Masks coordinate ``i`` when ``sqrt(v_i) <= ratio * mean(sqrt(v_j) over v_j > 0)``, the
    mean taken over the tensor's own nonzero coordinates (so ``v_i == 0`` is always masked).
    Returns a bool tensor shaped like ``v`` (True = masked), or None when no coordinate is
    masked (the caller then touches nothing, so such runs stay bitwise what they were
    without the mask). A tensor whose variance is all zero is masked whole. One host
    synchronisation.

    Why: after decompression every coordinate's momentum is ``+-scale`` (one scale per
    chunk), so a coordinate whose ``sqrt(v)`` is far below its tensor's would move by
    ``lr * scale / (sqrt(v) + eps)``, up to ``1e5`` times Adam's largest step when ``v == 0``
    (features that are always zero, dead ReLU units, unused embedding rows). Adam gives
    such coordinates an update of zero (``v == 0``) or one that decays to zero (a unit that
    stopped receiving gradient), which is what the mask gives them.
    """
    s = v.sqrt()
    count = torch.count_nonzero(s).clamp_(min=1)
    typical = s.sum(dtype=torch.float64) / count
    masked = s <= (ratio * typical).to(s.dtype)
    if not bool(masked.any()):
        return None
    return masked
