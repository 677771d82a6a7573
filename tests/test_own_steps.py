"""The DDP hook's own Adam/AdamW step on the frozen denominator for the parameters the C pass does not take
(a GPU, small tensors, an old checkpoint's denominator) in multi-tensor ops (collectives/_frozen_adam.py
``own_steps``, issue 57: on a GPU one launch per operation for all of them, not 7-8 per parameter): bitwise
the per-parameter operations it replaced, for Adam's L2 term and AdamW's decay, per-parameter step counts
(bias corrections), floors, ``bc2`` 1 and not, an old checkpoint's denominator, odd sizes and an empty
tensor."""

from __future__ import annotations

import pytest
import torch

from onebit.collectives._frozen_adam import own_steps
from onebit.kernels.preconditioning import stale_denominator

SHAPES = [(7, 3), (1,), (0,), (1000,), (33, 5)]


def _one_by_one(items, group):
    """The per-parameter route own_steps replaced (session 27's FrozenAdam._own_step)."""
    b1, lr, wd = group["betas"][0], float(group["lr"]), float(group["weight_decay"])
    decoupled = group.get("decoupled_weight_decay", False)
    for p, m, grad, v, legacy, (floor, bc2, eps), step in items:
        g = grad.add(p, alpha=wd) if wd and not decoupled else grad
        decay = 1.0 - lr * wd if wd and decoupled else 1.0
        d = legacy if legacy is not None else stale_denominator(v.float(), torch.tensor(floor), eps, bc2)
        m.mul_(b1).add_(g, alpha=1.0 - b1)
        if decay != 1.0:
            p.mul_(decay)
        p.addcdiv_(m, d, value=-step)


def _items(seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    items = []
    for k, s in enumerate(SHAPES):
        p, m, grad = (torch.randn(s, generator=g) for _ in range(3))
        v = torch.rand(s, generator=g) * 1e-3
        v.view(-1)[:1] = 0.0  # a zero variance: the floor (or eps alone) decides
        legacy = torch.rand(s, generator=g) + 0.5 if k == 3 else None
        scalars = (1e-3 * (k % 2), (1.0 if k == 1 else 1.0 - 0.999 ** (10 + k)), 1e-8)
        t = 11 + k  # each parameter its own step count
        items.append([x.to(device) if x is not None else None for x in (p, m, grad, v, legacy)]
                     + [scalars, 1e-2 / (1.0 - 0.9**t)])
    return items


@pytest.mark.parametrize("decoupled, wd", [(True, 0.01), (False, 0.1), (False, 0.0)])
def test_own_steps_are_bitwise_the_per_parameter_operations(decoupled, wd):
    group = {"betas": (0.9, 0.999), "lr": 1e-2, "weight_decay": wd, "decoupled_weight_decay": decoupled}
    ours, theirs = _items(0, "cpu"), _items(0, "cpu")
    own_steps([tuple(it) for it in ours], group)
    _one_by_one([tuple(it) for it in theirs], group)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # the parameter and the momentum
    start = _items(0, "cpu")
    assert all(not torch.equal(a[0], s[0]) for a, s in zip(ours, start, strict=True) if a[0].numel())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_own_steps_on_cuda_match_the_per_parameter_operations():
    # multi-tensor kernels may contract a multiply-add the single-tensor ones do not: to rounding
    group = {"betas": (0.9, 0.999), "lr": 1e-2, "weight_decay": 0.01, "decoupled_weight_decay": True}
    ours, theirs = _items(1, "cuda"), _items(1, "cuda")
    own_steps([tuple(it) for it in ours], group)
    _one_by_one([tuple(it) for it in theirs], group)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-7)


def _with_counts(items, device: str):
    """The same items with the step count itself (a 0-dim float32 tensor on ``device``, as a fused AdamW
    keeps it on a GPU) in place of ``lr / bc1``: own_steps makes ``-lr / bc1`` on the device."""
    return [tuple(it[:6]) + (torch.tensor(float(11 + k), device=device),) for k, it in enumerate(items)]


@pytest.mark.parametrize("decoupled, wd", [(True, 0.01), (False, 0.1)])
def test_own_steps_with_the_step_counts_on_the_device_match_to_rounding(decoupled, wd):
    # the bias correction in float32 on the device (torch's capturable Adam's way) and the step size divided
    # into the denominator: the same update to float32 rounding, the momentum bitwise
    group = {"betas": (0.9, 0.999), "lr": 1e-2, "weight_decay": wd, "decoupled_weight_decay": decoupled}
    ours, theirs = _items(2, "cpu"), _items(2, "cpu")
    legacy = ours[3][4].clone()
    own_steps(_with_counts(ours, "cpu"), group)
    own_steps([tuple(it) for it in theirs], group)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a[0], b[0], rtol=2e-6, atol=1e-7)
        assert torch.equal(a[1], b[1])
    assert torch.equal(ours[3][4], legacy)  # an old checkpoint's denominator is read, never written


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_own_steps_with_the_step_counts_on_the_device_synchronise_nothing():
    # issue 57: the hook's own step for a fused AdamW (step counts on the GPU) reads no count back
    group = {"betas": (0.9, 0.999), "lr": 1e-2, "weight_decay": 0.01, "decoupled_weight_decay": True}
    ours, theirs = _items(3, "cuda"), _items(3, "cuda")
    items = _with_counts(ours, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        own_steps(items, group)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    own_steps([tuple(it) for it in theirs], group)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a[0], b[0], rtol=2e-6, atol=1e-7)
