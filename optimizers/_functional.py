"""Optimizer maths as plain functions on tensors; the optimizer classes decide which runs when.

See docs/ALGORITHMS.md sections 3-4 for the update rules, and README "How it trains" for the
automatic momentum mask (why compressed momentum needs it, and how its threshold was chosen).
"""

from __future__ import annotations

import torch

__all__ = ["MIN_SAMPLES", "tiny_variance_mask"]

# Below this many variance updates only exact zeros are masked: with k samples of a Gaussian
# gradient, sqrt(v_i) < 0.1 * mean by chance has probability ~1% at k = 2, 2e-4 at k = 4 and
# ~1e-8 at k = 8, so a young variance cannot tell a systematically tiny coordinate from luck.
MIN_SAMPLES = 8


def tiny_variance_mask(v: torch.Tensor, ratio: float, samples: int) -> torch.Tensor | None:
    """Which coordinates of one tensor must not take compressed updates, judged by ``v``.

    Masks coordinate ``i`` when ``sqrt(v_i) <= ratio * mean(sqrt(v_j) over v_j > 0)``, the
    mean taken over the tensor's own nonzero coordinates (so ``v_i == 0`` is always masked);
    when ``v`` holds fewer than MIN_SAMPLES updates (``samples``), only ``v_i == 0``.
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
    if samples < MIN_SAMPLES:
        ratio = 0.0
    s = v.sqrt()
    count = torch.count_nonzero(s).clamp_(min=1)
    typical = s.sum(dtype=torch.float64) / count
    masked = s <= (ratio * typical).to(s.dtype)
    if not bool(masked.any()):
        return None
    return masked
