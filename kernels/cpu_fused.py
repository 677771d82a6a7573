"""Fused CPU passes for the optimizers' element-wise maths around the collective.

In the compression stage an optimizer runs a chain of torch ops per parameter, each a pass over
memory (bench/TRAFFIC.md section 3a): the fold of a gradient into the preconditioned momentum
(``u.mul_``, ``u.addcdiv_``: 24 B per element) and the update (``clone``, ``div_``,
``clamp_``, ``p.mul_``, ``p.add_``: 36-44 B). Compiled by torch's own compiler (inductor's
C++, built on first use like :mod:`onebit.kernels.cpu_compiled`), each is one pass: the fold
reads u, g and d and writes u (16 B); the update reads p and u and writes p (12 B).

The plain ops (``onebit.optimizers._functional``) stay the reference: the same float32
operations in the same order, so the results agree to rounding (tests/test_cpu_fused.py: the
fold bitwise; the update within one float32 ulp of its operands' scale ``|p| + lr |step|``:
the plain ``add_`` fuses its multiply-add, the compiled loop, built without contraction, rounds
twice). Each function returns False, having done nothing, where it does not apply: tensors that
are not contiguous float32 CPU tensors of the same size, fewer than ``MIN_NUMEL`` elements (a
compiled call costs tens of microseconds), ``ONEBIT_CPU_CODEC=torch``, or no working compiler
(:func:`cpu_compiled.usable` warns once); the caller then runs the plain ops. Used by
OnebitAdam's compression stage and ZeroOneAdam's steps on a stale variance (phase 1's, and
phase 2's local steps with their fold), and the DDP hook with ``freeze_step`` (its passes before
and after the collective, per parameter: ``hook_pre_``, ``hook_post_``).
"""

from __future__ import annotations

import functools
import math
import os

import torch

from . import cpu_compiled

MIN_NUMEL = 1 << 16


def _scalar(x: float) -> torch.Tensor:
    # a 0-dim tensor, not a Python float: torch.compile would recompile for every new learning
    # rate and bias correction; float32, as the plain ops round their scalars
    return torch.tensor(x, dtype=torch.float32)


@functools.cache
def _fns() -> dict:
    def fold(u, g, d, b1, w) -> None:
        u.copy_(u * b1 + w * g / d)  # fold_preconditioned_: u.mul_(b1), then u + (w * g) / d

    def stale_update(p, u, bc1, lo, hi, decay, neg_lr) -> None:
        # stale_direction(denom=None) then p.mul_(decay), p.add_(step, alpha=-lr)
        p.copy_(p * decay + neg_lr * torch.clamp(u / bc1, lo, hi))

    def stale_step(p, m, d, lo, hi, neg_lr) -> None:
        # ZeroOneAdam (wd = 0): stale_direction(denom=d) then p.add_(update, alpha=-lr)
        p.copy_(p + neg_lr * torch.clamp(m / d, lo, hi))

    def stale_step_wd(p, m, d, lo, hi, wd, neg_lr) -> None:
        # the same with stale_direction's update.add_(p, alpha=wd)
        p.copy_(p + neg_lr * (torch.clamp(m / d, lo, hi) + wd * p))

    def local_step(p, m, g, d, b1, w, lo, hi, neg_lr) -> None:
        # ZeroOneAdam's phase 2: fold_(m, g, b1), then the stale step above
        m.copy_(m * b1 + w * g)
        p.copy_(p + neg_lr * torch.clamp(m / d, lo, hi))

    def local_step_wd(p, m, g, d, b1, w, lo, hi, wd, neg_lr) -> None:
        m.copy_(m * b1 + w * g)
        p.copy_(p + neg_lr * (torch.clamp(m / d, lo, hi) + wd * p))

    def hook_pre(g, m, d, k) -> None:
        # the DDP hook with freeze_step: g.add_(c).div_(d) with c = m * k (onebit.collectives._frozen_adam)
        g.copy_((g + m * k) / d)

    def hook_post(out, m, d, k) -> None:
        # out.mul_(d).sub_(c), c = m * k again (m has not changed since the pre-pass)
        out.copy_(out * d - m * k)

    def frozen_adam(p, m, g, d, v, b1, w, decay, neg_step, eps, bc2) -> None:
        # torch's AdamW step with the hook's frozen denominator d (onebit.collectives._frozen_adam):
        # m.mul_(b1).add_(g, alpha=w); p.mul_(decay); p.addcdiv_(m, d, value=neg_step); and v as
        # AdamW's step would leave it for that denominator, (d - eps)^2 * bc2
        m_new = m * b1 + w * g
        m.copy_(m_new)
        p.copy_(p * decay + neg_step * m_new / d)
        v.copy_((d - eps) * (d - eps) * bc2)

    return {name: cpu_compiled._compile(fn) for name, fn in (
        ("fold", fold), ("stale_update", stale_update), ("stale_step", stale_step),
        ("stale_step_wd", stale_step_wd), ("local_step", local_step), ("local_step_wd", local_step_wd),
        ("hook_pre", hook_pre), ("hook_post", hook_post), ("frozen_adam", frozen_adam))}


def _applies(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return (first.numel() >= MIN_NUMEL
            and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                    and t.numel() == first.numel() for t in tensors)
            and os.environ.get(cpu_compiled._ENV, "") != "torch" and cpu_compiled.usable())


@torch.no_grad()
def fold_preconditioned_(u: torch.Tensor, grad: torch.Tensor | None, denom: torch.Tensor,
                         beta1: float) -> bool:
    """``u = b1*u + (1-b1) * g / denom`` in one pass; False (nothing done) where it does not
    apply, ``grad=None`` included."""
    if grad is None or not _applies(u, grad, denom):
        return False
    _fns()["fold"](u.view(-1), grad.view(-1), denom.view(-1), _scalar(beta1), _scalar(1.0 - beta1))
    return True


@torch.no_grad()
def stale_update_(p: torch.Tensor, u: torch.Tensor, *, lr: float, weight_decay: float,
                  clip: float | None, bc1: float) -> bool:
    """``p = p*(1 - lr*wd) - lr * clip(u / bc1)`` in one pass (``u`` already preconditioned;
    ``clip`` None: no bound); False (nothing done) where it does not apply."""
    if not _applies(p, u):
        return False
    bound = math.inf if clip is None else clip
    decay = 1.0 - lr * weight_decay if weight_decay else 1.0
    _fns()["stale_update"](p.view(-1), u.view(-1), _scalar(bc1), _scalar(-bound), _scalar(bound),
                           _scalar(decay), _scalar(-lr))
    return True


@torch.no_grad()
def stale_step_(p: torch.Tensor, m: torch.Tensor, denom: torch.Tensor, *, lr: float, weight_decay: float,
                clip: float | None) -> bool:
    """ZeroOneAdam's step on a stale variance, ``p -= lr * (clip(m / denom) + wd * p)``, in one
    pass; False (nothing done) where it does not apply."""
    if not _applies(p, m, denom):
        return False
    _step(p, m, None, denom, 0.0, lr, weight_decay, clip)
    return True


@torch.no_grad()
def local_step_(p: torch.Tensor, m: torch.Tensor, grad: torch.Tensor | None, denom: torch.Tensor, *,
                beta1: float, lr: float, weight_decay: float, clip: float | None) -> bool:
    """ZeroOneAdam's local step (phase 2): ``m = b1*m + (1-b1)*g``, then
    ``p -= lr * (clip(m / denom) + wd * p)``, in one pass; False (nothing done) where it does
    not apply, ``grad=None`` included."""
    if grad is None or not _applies(p, m, grad, denom):
        return False
    _step(p, m, grad, denom, beta1, lr, weight_decay, clip)
    return True


def _step(p, m, grad, denom, beta1: float, lr: float, weight_decay: float, clip: float | None) -> None:
    bound = math.inf if clip is None else clip
    fold = () if grad is None else (grad.view(-1),)
    args = (p.view(-1), m.view(-1), *fold, denom.view(-1))
    if grad is not None:
        args += (_scalar(beta1), _scalar(1.0 - beta1))
    args += (_scalar(-bound), _scalar(bound))
    name = "stale_step" if grad is None else "local_step"
    if weight_decay > 0:  # a separate pass: with wd = 0 the plain ops add nothing (0 * inf is NaN)
        _fns()[name + "_wd"](*args, _scalar(weight_decay), _scalar(-lr))
    else:
        _fns()[name](*args, _scalar(-lr))


@torch.no_grad()
def hook_pre_(g: torch.Tensor, m: torch.Tensor, d: torch.Tensor, factor: float) -> bool:
    """The DDP hook's pre-pass on one parameter's piece of a bucket, ``g = (g + m * factor) / d``,
    in one pass (the plain ops: ``c = m * factor`` into a bucket-sized buffer, ``add_``, ``div_``:
    36 B per element against 16); False (nothing done) where it does not apply."""
    if not _applies(g, m, d):
        return False
    _fns()["hook_pre"](g.view(-1), m.view(-1), d.view(-1), _scalar(factor))
    return True


@torch.no_grad()
def hook_post_(out: torch.Tensor, m: torch.Tensor, d: torch.Tensor, factor: float) -> bool:
    """Its post-pass, ``out = out * d - m * factor``, in one pass (plain: ``mul_``, ``sub_``, 24 B
    against 16); False (nothing done) where it does not apply."""
    if not _applies(out, m, d):
        return False
    _fns()["hook_post"](out.view(-1), m.view(-1), d.view(-1), _scalar(factor))
    return True


@torch.no_grad()
def frozen_adam_(p: torch.Tensor, m: torch.Tensor, g: torch.Tensor, d: torch.Tensor, v: torch.Tensor, *,
                 beta1: float, decay: float, step: float, eps: float, bc2: float) -> bool:
    """The DDP hook's AdamW step on a frozen denominator in one pass: ``m = b1 m + (1 - b1) g``,
    ``p = p * decay - step * m / d``, ``v = (d - eps)^2 bc2`` (reads p, m, g, d; writes p, m, v:
    28 B per element against the 116 of preparing the state for torch's own step, the step and the
    restore); False (nothing done) where it does not apply."""
    if not _applies(p, m, g, d, v):
        return False
    _fns()["frozen_adam"](p.view(-1), m.view(-1), g.view(-1), d.view(-1), v.view(-1), _scalar(beta1),
                          _scalar(1.0 - beta1), _scalar(decay), _scalar(-step), _scalar(eps), _scalar(bc2))
    return True
