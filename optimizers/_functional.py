"""Optimizer maths as plain functions on tensors; the optimizer classes decide which runs when.

See docs/ALGORITHMS.md sections 3-4 for the update rules, and docs/optimizers.md ("How it trains") for the
automatic momentum mask (why compressed momentum needs it, and how its threshold was chosen).
"""

from __future__ import annotations

import math

import torch

from ..kernels.preconditioning import sqrt_v_floors, stale_denominator
from ..kernels.sketch import SketchHash, sketch

__all__ = [
    "MIN_SAMPLES", "adam_update", "clip_", "direction", "fold_", "fold_preconditioned_",
    "TRUST_SKETCH", "SketchHash", "count_sketch", "count_sketch_index", "lamb_compressed_update",
    "lamb_sketched_update",
    "lamb_warmup_update", "mask_", "moments_",
    "sqrt_v_floors", "stale_denominator", "stale_direction", "tiny_variance_mask",
]

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
    s = v.float().sqrt()  # (a bfloat16 variance widened, exactly)
    count = torch.count_nonzero(s).clamp_(min=1)
    typical = s.sum(dtype=torch.float64) / count
    masked = s <= (ratio * typical).to(s.dtype)
    if not bool(masked.any()):
        return None
    return masked


# -- moments ------------------------------------------------------------------------------
def moments_(m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, betas: tuple[float, float]) -> None:
    """Adam's moments in place: ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g*g``."""
    b1, b2 = betas
    m.mul_(b1).add_(grad, alpha=1.0 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)


def fold_(m: torch.Tensor, grad: torch.Tensor | None, beta1: float) -> torch.Tensor:
    """Fold a gradient into the momentum in place, ``m = b1*m + (1-b1)*g``; ``grad=None``
    (a parameter without a gradient on this rank) counts as zero. Returns ``m``."""
    m.mul_(beta1)
    if grad is not None:
        m.add_(grad, alpha=1.0 - beta1)
    return m


def mask_(x: torch.Tensor, dead: torch.Tensor | None, exp_avg_mask: torch.Tensor | None) -> torch.Tensor:
    """After decompression: zero the coordinates the automatic mask marks (``dead``, bool),
    then multiply by the user's ``exp_avg_mask``; either may be None. In place; returns ``x``."""
    if dead is not None:
        x.masked_fill_(dead, 0.0)
    if exp_avg_mask is not None:
        x.mul_(exp_avg_mask)
    return x


def direction(
    p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, eps: float, weight_decay: float,
) -> torch.Tensor:
    """The update direction ``m / (sqrt(v) + eps) + wd * p`` (a new tensor; no bias correction)."""
    update = m / (v.float().sqrt() + eps)  # (a variance stored in bfloat16: widened, exactly)
    if weight_decay > 0:
        update.add_(p, alpha=weight_decay)
    return update


# -- preconditioned compression: floor, denominator, clip (docs/ALGORITHMS.md section 6) ------
def fold_preconditioned_(u: torch.Tensor, grad: torch.Tensor | None, denom: torch.Tensor,
                         beta1: float) -> torch.Tensor:
    """The preconditioned momentum ``u = m / denom`` takes a gradient in place:
    ``u = b1*u + (1-b1) * g / denom`` (``denom`` is frozen, so this is ``fold_`` divided by
    it); ``grad=None`` counts as zero. Returns ``u``."""
    u.mul_(beta1)
    if grad is not None:
        u.addcdiv_(grad, denom, value=1.0 - beta1)
    return u


def clip_(x: torch.Tensor, clip: float | None) -> torch.Tensor:
    """Bound every coordinate to ``[-clip, clip]`` in place (None: nothing). Returns ``x``."""
    if clip is not None:
        x.clamp_(-clip, clip)
    return x


def stale_direction(p: torch.Tensor, m: torch.Tensor, denom: torch.Tensor | None, weight_decay: float,
                    clip: float | None, bc1: float = 1.0) -> torch.Tensor:
    """The update direction on a step whose variance is stale: ``clip(m / denom / bc1) + wd*p``
    (a new tensor). ``denom=None``: ``m`` is already preconditioned. ``clip`` bounds every
    coordinate to ``[-clip, clip]`` (None: no bound). With ``denom = v.sqrt() + eps``, no
    clip and ``bc1 = 1`` this is bitwise :func:`direction`."""
    update = m / denom if denom is not None else m.clone()
    if bc1 != 1.0:
        update.div_(bc1)
    if clip is not None:
        update.clamp_(-clip, clip)
    if weight_decay > 0:
        update.add_(p, alpha=weight_decay)
    return update


# -- Adam -----------------------------------------------------------------------------------
def adam_update(
    p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, eps: float, weight_decay: float,
    bc1: float, bc2: float, eps_inside_sqrt: bool,
) -> None:
    """``p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)``, in torch.optim.AdamW's order.

    ``m_hat = m / bc1``, ``v_hat = v / bc2`` (``bc = 1`` without bias correction); with
    ``eps_inside_sqrt`` the denominator is ``sqrt(v_hat + eps)``.
    """
    if weight_decay:
        p.mul_(1.0 - lr * weight_decay)
    v = v.float()  # a frozen variance stored in bfloat16 (``variance_dtype``): widened, exactly; float32: v
    if eps_inside_sqrt:
        denom = (v / bc2 if bc2 != 1.0 else v.clone()).add_(eps).sqrt_()
    else:
        denom = v.sqrt()
        if bc2 != 1.0:
            denom.div_(math.sqrt(bc2))
        denom.add_(eps)
    p.addcdiv_(m, denom, value=-lr / bc1)


# -- LAMB -----------------------------------------------------------------------------------
def _norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t).to(torch.float64)


def lamb_warmup_update(
    p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, coeff_freeze: torch.Tensor, *, lr: float,
    eps: float, weight_decay: float, min_coeff: float, max_coeff: float, coeff_beta: float,
    skip: torch.Tensor | None = None,
) -> torch.Tensor:
    """LAMB step with trust ratio ``c = clip(||p|| / ||upd||)`` (1 if a norm is 0); folds
    ``c`` into the EMA ``coeff_freeze`` when ``c != 1``. ``skip``: a 0-dim bool on the device (a step
    agreed there): ``p`` and the EMA left as they were where it is True. Returns ``c`` (0-dim float64)."""
    upd = direction(p, m, v, eps, weight_decay)
    w, u = _norm(p), _norm(upd)
    c = torch.where((w == 0) | (u == 0), 1.0, (w / u).clamp(min_coeff, max_coeff))
    ema = coeff_beta * coeff_freeze + (1 - coeff_beta) * c
    keep = c == 1 if skip is None else skip | (c == 1)
    coeff_freeze.copy_(torch.where(keep, coeff_freeze, ema))
    if skip is None:
        p.addcmul_(upd, (-lr * c).to(p.dtype))
    else:
        p.copy_(torch.where(skip, p, p.addcmul(upd, (-lr * c).to(p.dtype))))
    return c


TRUST_SKETCH = 256  # count-sketch size per tensor for OnebitLamb's trust ratio (section 6.3)


def count_sketch_index(numel: int, size: int, seed: int, device: torch.device) -> torch.Tensor | None:
    """The drawn index of the checkpoints written before the hashed one (:class:`SketchHash`,
    docs/ALGORITHMS.md 6.3): the hash of a count sketch of ``numel`` elements into ``size``
    buckets, as one int32 per element: ``h(i) + size * [s_i < 0]`` (bucket and sign), drawn
    from a generator seeded by ``seed`` (the same on every rank and after a restart). None when
    ``numel <= size``: such a tensor is not hashed (its sketch is itself)."""
    if numel <= size:
        return None
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2 * size, (numel,), generator=g, dtype=torch.int32).to(device)


def count_sketch(x: torch.Tensor, index: torch.Tensor | SketchHash | None, size: int) -> torch.Tensor:
    """``S x`` (float32): ``x`` itself if ``index`` is None, else ``size`` signed bucket sums
    (``E ||S x||^2 = ||x||^2``), the buckets from a :class:`~onebit.kernels.sketch.SketchHash`
    (computed as the sketch reads) or an index tensor (:func:`count_sketch_index`, older checkpoints)."""
    flat = x.reshape(-1).to(torch.float32)
    if index is None:
        return flat.clone()
    if isinstance(index, SketchHash):
        if index.size != size:
            raise ValueError(f"size: expected the hash's {index.size}, got {size}")
        return sketch(flat, index)
    sums = torch.zeros(2 * size, dtype=torch.float32, device=x.device).index_add_(0, index, flat)
    return sums[:size] - sums[size:]


def lamb_sketched_update(
    p: torch.Tensor, u: torch.Tensor, norm_estimate: torch.Tensor, *, lr: float, weight_decay: float,
    min_coeff: float, max_coeff: float, skip: torch.Tensor | None = None,
) -> torch.Tensor:
    """OnebitLamb's compressed-stage step (docs/ALGORITHMS.md section 6.3): ``p -= lr * c * (u +
    wd*p)`` with ``c = clip(||p|| / norm_estimate, min_coeff, max_coeff)`` (1 if a norm is 0);
    ``norm_estimate`` is the sketched ``||m* + wd*p||``, not the norm of the noisy ``u``.
    ``skip``: a 0-dim bool on the device (a step agreed there): ``p`` left as it was where it is True.
    Returns ``c`` (0-dim float64)."""
    upd = u.add(p, alpha=weight_decay) if weight_decay > 0 else u
    w, n = _norm(p), norm_estimate.to(torch.float64)
    c = torch.where((w == 0) | (n == 0), 1.0, (w / n).clamp(min_coeff, max_coeff))
    if skip is None:
        p.addcmul_(upd, (-lr * c).to(p.dtype))
    else:
        p.copy_(torch.where(skip, p, p.addcmul(upd, (-lr * c).to(p.dtype))))
    return c


def lamb_compressed_update(
    p: torch.Tensor, m: torch.Tensor, m_last: torch.Tensor, v: torch.Tensor, v_fresh: torch.Tensor,
    coeff_freeze: torch.Tensor, last_factor: torch.Tensor, *, lr: float, betas: tuple[float, float],
    eps: float, weight_decay: float, factor_min: float, factor_max: float, factor_threshold: float,
    denom: torch.Tensor | None = None, clip: float | None = None,
) -> torch.Tensor:
    """The compression-stage step (docs/ALGORITHMS.md 4.1, step 4) after decompression and mask.
    ``denom``: the (floored) frozen denominator (default ``sqrt(v) + eps``, the reference's);
    ``clip`` bounds every coordinate of ``m / denom`` (section 6). Returns the coefficient
    ``coeff_freeze * f`` used (0-dim float64)."""
    b1, b2 = betas
    g = (m - b1 * m_last) / (1 - b1)
    v_fresh.mul_(b2).addcmul_(g, g, value=1 - b2)
    if denom is None:
        denom = v.float().sqrt() + eps  # (a variance stored in bfloat16: widened, exactly)
    upd_pre = m / denom
    if clip is not None:
        upd_pre.clamp_(-clip, clip)
    upd = upd_pre + weight_decay * p if weight_decay > 0 else upd_pre
    if p.numel():
        f = (denom / (v_fresh.sqrt() + eps)).max().to(torch.float64)
    else:
        f = torch.ones_like(last_factor)
    if weight_decay > 0:
        r = torch.clamp(_norm(upd_pre) / _norm(upd), max=1.0).nan_to_num(nan=1.0)
        f = f * r + (1 - r)
    f = f.clamp(factor_min, factor_max)
    low, high = last_factor * (1 - factor_threshold), last_factor * (1 + factor_threshold)
    f = torch.minimum(torch.maximum(f, low), high)
    last_factor.copy_(f)
    c = coeff_freeze * f
    p.addcmul_(upd, (-lr * c).to(p.dtype))
    return c
