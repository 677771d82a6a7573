"""Fused CPU passes for the optimizers' element-wise maths around the collective, in C.

In the compression stage an optimizer runs a chain of torch ops per parameter, each a pass over
memory (bench/TRAFFIC.md section 3a): the fold of a gradient into the preconditioned momentum
(``u.mul_``, ``u.addcdiv_``: 24 B per element) and the update (``clone``, ``div_``,
``clamp_``, ``p.mul_``, ``p.add_``: 36-44 B). Here each is one pass of the native library's
(``onebit/kernels/fused/*.c``, built as :mod:`onebit.kernels.cpu_simd` builds it): the fold reads
u, g and the variance v (the stale denominator d computed from it in the pass) and writes u (16 B);
the update reads p and u and writes p (12 B).

The plain ops (``onebit.optimizers._functional``) stay the reference: the same float32
operations in the same order, so the results agree to rounding (tests/test_cpu_fused.py: the
fold bitwise; the update within one float32 ulp of its operands' scale ``|p| + lr |step|``:
the plain ``add_`` fuses its multiply-add, the C loop, built without contraction, rounds
twice). Each function returns False, having done nothing, where it does not apply: tensors that
are not contiguous float32 CPU tensors of the same size, fewer than ``MIN_NUMEL`` elements,
``ONEBIT_CPU_CODEC=torch``, or no C library (:func:`onebit.kernels.cpu_simd.library` warns once);
the caller then runs the plain ops. Used by OnebitAdam's compression stage and ZeroOneAdam's steps
on a stale variance (phase 1's, and phase 2's local steps with their fold), and the DDP hook with
``freeze_step`` (its AdamW step on the frozen denominator: ``frozen_adam_``; its passes around the
collective are :mod:`onebit.kernels.fused.hook`'s).
"""

from __future__ import annotations

import math

import torch

from . import backends, cpu_simd

MIN_NUMEL = 1 << 16


def usable() -> bool:
    """Whether the passes run here: the ``tensor`` step's backend on CPU is native."""
    return backends.select("cpu", "tensor").name == "native"


def _applies(*tensors: torch.Tensor, var: torch.Tensor | None = None) -> bool:
    """Contiguous CPU tensors of one size, float32 (``var``, a variance: float32 or bfloat16), at least
    ``MIN_NUMEL`` elements, where the C runs."""
    first = tensors[0]
    return (first.numel() >= MIN_NUMEL
            and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                    and t.numel() == first.numel() for t in tensors)
            and (var is None or (var.device.type == "cpu" and var.dtype in (torch.float32, torch.bfloat16)
                                 and var.is_contiguous() and var.numel() == first.numel()))
            and usable())


def _run(name: str, tensors, *scalars: float) -> None:
    n = tensors[0].numel()
    getattr(cpu_simd.library(), name)(*(t.data_ptr() for t in tensors), *scalars, n, cpu_simd._isa(None),
                                      cpu_simd._threads(n))


def _run_var(name: str, tensors, var: torch.Tensor, *scalars: float) -> None:
    """``_run`` of a pass that reads a variance ``var`` after ``tensors`` (float32 or bfloat16: its last
    argument says which)."""
    n, narrow = var.numel(), int(var.dtype == torch.bfloat16)
    getattr(cpu_simd.library(), name)(*(t.data_ptr() for t in tensors), var.data_ptr(), *scalars, n,
                                      cpu_simd._isa(None), cpu_simd._threads(n), narrow)


@torch.no_grad()
def fold_preconditioned_(u: torch.Tensor, grad: torch.Tensor | None, var: torch.Tensor,
                         denominator: tuple[float, float, float], beta1: float) -> bool:
    """``u = b1*u + (1-b1) * g / d`` in one pass, ``d = max(sqrt(var), floor) * r + eps`` computed as
    it reads ``var`` (``denominator``: ``(floor, r, eps)``, docs/ALGORITHMS.md 6.2); False (nothing
    done) where it does not apply, ``grad=None`` included."""
    if grad is None or not _applies(u, grad, var=var):
        return False
    _run_var("onebit_fold", (u, grad), var, *denominator, beta1, 1.0 - beta1)
    return True


@torch.no_grad()
def stale_denominator(v: torch.Tensor, denominator: tuple[float, float, float]) -> torch.Tensor | None:
    """``max(sqrt(v), floor) * r + eps`` (``denominator``: ``(floor, r, eps)``) as a new tensor in one
    pass, each operation correctly rounded (the fused passes' arithmetic); None where the C library
    does not run here or ``v`` is not a contiguous float32 (or bfloat16) CPU tensor."""
    if not (v.device.type == "cpu" and v.dtype in (torch.float32, torch.bfloat16) and v.is_contiguous()
            and usable()):
        return None
    out = torch.empty_like(v, dtype=torch.float32)
    if v.numel():
        _run_var("onebit_stale_denominator", (out,), v, *denominator)
    return out


@torch.no_grad()
def stale_update_(p: torch.Tensor, u: torch.Tensor, *, lr: float, weight_decay: float,
                  clip: float | None, bc1: float) -> bool:
    """``p = p*(1 - lr*wd) - lr * clip(u / bc1)`` in one pass (``u`` already preconditioned;
    ``clip`` None: no bound); False (nothing done) where it does not apply."""
    if not _applies(p, u):
        return False
    bound = math.inf if clip is None else clip
    decay = 1.0 - lr * weight_decay if weight_decay else 1.0
    _run("onebit_stale_update", (p, u), decay, -lr, bc1, -bound, bound)
    return True


@torch.no_grad()
def stale_step_(p: torch.Tensor, m: torch.Tensor, var: torch.Tensor, denominator: tuple[float, float, float],
                *, lr: float, weight_decay: float, clip: float | None) -> bool:
    """ZeroOneAdam's step on a stale variance, ``p -= lr * (clip(m / d) + wd * p)`` (``d`` from
    ``var`` and ``denominator`` as :func:`fold_preconditioned_`'s), in one pass; False (nothing done)
    where it does not apply."""
    if not _applies(p, m, var=var):
        return False
    bound = math.inf if clip is None else clip
    wd = weight_decay if weight_decay > 0 else 0.0
    _run_var("onebit_stale_step", (p, m), var, *denominator, -bound, bound, wd, -lr)
    return True


@torch.no_grad()
def local_step_(p: torch.Tensor, m: torch.Tensor, grad: torch.Tensor | None, var: torch.Tensor,
                denominator: tuple[float, float, float], *, beta1: float, lr: float, weight_decay: float,
                clip: float | None) -> bool:
    """ZeroOneAdam's local step (phase 2): ``m = b1*m + (1-b1)*g``, then
    ``p -= lr * (clip(m / d) + wd * p)`` (``d`` from ``var`` and ``denominator`` as
    :func:`fold_preconditioned_`'s), in one pass; False (nothing done) where it does not apply,
    ``grad=None`` included."""
    if grad is None or not _applies(p, m, grad, var=var):
        return False
    bound = math.inf if clip is None else clip
    _run_var("onebit_local_step", (p, m, grad), var, *denominator, beta1, 1.0 - beta1, -bound, bound,
         weight_decay if weight_decay > 0 else 0.0, -lr)
    return True


@torch.no_grad()
def zoa_momentum_(m: torch.Tensor, u: torch.Tensor, var: torch.Tensor,
                  denominator: tuple[float, float, float], nl: float) -> bool:
    """ZeroOneAdam's momentum from its synchronisation's decoded mean ``u``, ``m = (u * d) / nl`` (``d``
    from ``var`` as :func:`fold_preconditioned_`'s), in one pass (plain: the denominator, ``mul``,
    ``div_``); False (nothing done) where it does not apply."""
    if not _applies(m, u, var=var):
        return False
    _run_var("onebit_zoa_momentum", (m, u), var, *denominator, nl)
    return True


@torch.no_grad()
def frozen_adam_(p: torch.Tensor, m: torch.Tensor, g: torch.Tensor, var: torch.Tensor, *,
                 beta1: float, decay: float, step: float, denominator: tuple[float, float, float]) -> bool:
    """The DDP hook's AdamW step on a frozen denominator in one pass: ``m = b1 m + (1 - b1) g``,
    ``p = p * decay - step * m / d``, ``d = max(sqrt(var), floor) * r + eps`` computed as it reads the
    frozen variance (``denominator``: ``(floor, r, eps)``, docs/ALGORITHMS.md 6.2; reads p, m, g, var;
    writes p, m: 24 B per element against the 116 of preparing the state for torch's own step, the
    step and the restore); False (nothing done) where it does not apply."""
    if not _applies(p, m, g, var):
        return False
    _run("onebit_frozen_adam", (p, m, g, var), beta1, 1.0 - beta1, decay, -step, *denominator)
    return True
