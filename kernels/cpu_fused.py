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
OnebitAdam's compression stage; ZeroOneAdam and the DDP hook still run the plain ops.
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

    return {"fold": cpu_compiled._compile(fold), "stale_update": cpu_compiled._compile(stale_update)}


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


@torch.no_grad()  # as every caller: a graph compiled with grad mode on would not be reused
def warm_up() -> bool:
    """Build every compiled CPU pass now (this module's and :mod:`cpu_compiled`'s codec) instead
    of at the first call that needs it: each costs a torch.compile (seconds; from inductor's
    on-disk cache, still about a second of tracing per process). Runs each on a few elements
    through the callers' own entry points, so later calls of any size reuse the graphs
    (compiled with dynamic shapes). False where the compiled passes are off or unavailable.
    Test launchers call it once before forking ranks; a training script need not."""
    if os.environ.get(cpu_compiled._ENV, "") == "torch" or not cpu_compiled.usable():
        return False
    from .layout import Layout, empty_message

    n = 312  # 3 chunks of 104: no two of the passes' sizes equal (torch.compile would tie them)
    layout = Layout(n, 3)
    x, e, ew, out = torch.randn(n), torch.zeros(n), torch.zeros(n), torch.empty(n)
    message = empty_message(layout, layout.W, x.device)
    cpu_compiled.worker_compress(x, e, layout, message, True)
    gathered = message.clone()
    cpu_compiled.decompress(gathered, layout, out, None, None)
    cpu_compiled.decompress(gathered, layout, out, ew, message)
    u, g, d = torch.zeros(n), torch.randn(n), torch.ones(n)
    _fns()["fold"](u, g, d, _scalar(0.9), _scalar(0.1))
    _fns()["stale_update"](x[:n], u, _scalar(1.0), _scalar(-1.0), _scalar(1.0), _scalar(1.0), _scalar(-1e-3))
    return True
