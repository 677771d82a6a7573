"""The multi-tensor forms of the optimizers' maths (optimizers/_multi.py) against the
per-tensor functions, and the optimizers run both ways.

On CPU torch's ``_foreach`` ops are loops over the per-tensor ops, so the functions must be
bitwise the per-tensor ones (a wrong order or a missed term fails). The optimizers take the
multi-tensor forms only on CUDA; here ``applies`` is widened to CPU tensors to check the
wiring (groups, learning rates, bias corrections, missing gradients) bitwise. The CUDA-marked
test runs the same comparison on a GPU, where the foreach kernels differ from the per-tensor
kernels at most in the last bit of a division by a scalar.
"""

from __future__ import annotations

import math

import pytest
import torch

from onebit.collectives import local_compressed_allreduce
from onebit.optimizers import OnebitAdam, ZeroOneAdam
from onebit.optimizers import _functional as F
from onebit.optimizers import _multi as M

SHAPES = [(37, 5), (1000,), (3,), (64, 17)]  # numels not multiples of 16, all below cpu_fused's 2^16


def _lists(seed, positive=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, generator=g) for s in SHAPES]
    return [t.abs() + 0.05 for t in out] if positive else out


def _copy(ts):
    return [t.clone() for t in ts]


def _with_specials(ts):
    ts[0].view(-1)[0] = float("nan")
    ts[1].view(-1)[3] = float("inf")
    ts[2].zero_()
    return ts


def _equal(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.isnan(), y.isnan())
        assert torch.equal(x.nan_to_num(), y.nan_to_num())


def test_folds_are_the_per_tensor_folds():
    us, ds = _lists(1), _lists(2, positive=True)
    grads = _with_specials(_lists(3))
    grads[3] = None
    a, b = _copy(us), _copy(us)
    M.fold_preconditioned_(a, grads, ds, 0.9)
    for u, gr, d in zip(b, grads, ds, strict=True):
        F.fold_preconditioned_(u, gr, d, 0.9)
    _equal(a, b)
    a, b = _copy(us), _copy(us)
    M.fold_(a, grads, 0.8)
    for u, gr in zip(b, grads, strict=True):
        F.fold_(u, gr, 0.8)
    _equal(a, b)
    xs = _lists(4)
    a, b = _copy(us), _copy(us)
    M.fold_scaled_(a, xs, ds, 0.7)
    for m, x, d in zip(b, xs, ds, strict=True):
        m.mul_(0.7).addcmul_(x, d, value=1 - 0.7)
    _equal(a, b)


@pytest.mark.parametrize("bc", [(1.0, 1.0), (0.19, 0.002)])
@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adam_is_the_per_tensor_adam(bc, eps_inside_sqrt, wd):
    ps, ms, grads = _lists(5), _lists(6), _with_specials(_lists(7))
    vs = _lists(8, positive=True)
    kw = dict(lr=1e-2, eps=1e-8, weight_decay=wd, bc1=bc[0], bc2=bc[1], eps_inside_sqrt=eps_inside_sqrt)
    a = [_copy(x) for x in (ps, ms, vs)]
    b = [_copy(x) for x in (ps, ms, vs)]
    M.moments_(a[1], a[2], grads, (0.9, 0.99))
    M.adam_update_(*a, **kw)
    for p, m, v, gr in zip(*b, grads, strict=True):
        F.moments_(m, v, gr, (0.9, 0.99))
        F.adam_update(p, m, v, **kw)
    for x, y in zip(a, b, strict=True):
        _equal(x, y)


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("bc1", [1.0, 0.3])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_stale_steps_are_the_per_tensor_steps(clip, bc1, wd):
    ps, ms, ds = _lists(9), _with_specials(_lists(10)), _lists(11, positive=True)
    ms[3].mul_(100.0)  # beyond the clip
    a, b = _copy(ps), _copy(ps)
    M.stale_update_(a, ms, lr=0.1, weight_decay=wd, clip=clip, bc1=bc1)
    for p, m in zip(b, ms, strict=True):
        update = F.stale_direction(p, m, None, 0.0, clip, bc1)
        if wd:
            p.mul_(1.0 - 0.1 * wd)
        p.add_(update, alpha=-0.1)
    _equal(a, b)
    ms_before = _copy(ms)
    a, b = _copy(ps), _copy(ps)
    M.stale_step_(a, ms, ds, lr=0.1, weight_decay=wd, clip=clip)
    for p, m, d in zip(b, ms, ds, strict=True):
        p.add_(F.stale_direction(p, m, d, wd, clip), alpha=-0.1)
    _equal(a, b)
    _equal(ms, ms_before)  # the momenta are read, not written


def test_by_group_keeps_order_and_groups():
    g1, g2 = {"lr": 1}, {"lr": 2}
    rows = [(g1, 1, "a"), (g2, 2, "b"), (g1, 3, "c")]
    assert M.by_group(rows) == [(g1, [1, 3], ["a", "c"]), (g2, [2], ["b"])]


# -- the optimizers, both ways ------------------------------------------------------------------
def _forced_single_rank(tensor, worker_error, server_error, group=None):
    return local_compressed_allreduce([tensor], [worker_error], [server_error])[0]


def _params(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(device)) for s in SHAPES]


def _run(cls, kwargs, device, steps, multi: bool):
    """``steps`` steps with the multi-tensor forms (on any device: CPU tensors too) or without."""
    real = M.applies
    M.applies = (lambda ts: bool(ts)) if multi else (lambda ts: False)
    try:
        params = _params(device)
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]
        opt = cls(groups, lr=1e-2, weight_decay=0.05, **kwargs)
        opt.reducer().allreduce = _forced_single_rank
        g = torch.Generator().manual_seed(1)
        for step in range(steps):
            for i, p in enumerate(params):
                grad = torch.randn(p.shape, generator=g).to(device) * (1 + step % 3)
                grad.view(-1)[: max(1, p.numel() // 7)] = 0.0  # always-zero features
                p.grad = None if (i == 1 and step % 4 == 1) else grad  # sometimes no gradient
            opt.step()
        return [p.detach().cpu() for p in params], opt
    finally:
        M.applies = real


CONFIGS = [
    (OnebitAdam, dict(freeze_step=3)),
    (OnebitAdam, dict(freeze_step=3, bias_correction=True, eps_inside_sqrt=True)),
    (OnebitAdam, dict(freeze_step=3, update_clip=None)),
    (OnebitAdam, dict(freeze_step=3, compression="momentum")),
    (ZeroOneAdam, dict(var_freeze_step=12, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)),
    (ZeroOneAdam, dict(var_freeze_step=12, var_update_scaler=2, compression="momentum")),
]


def _spy(monkeypatch, calls):
    names = ("fold_", "fold_preconditioned_", "fold_scaled_", "adam_update_", "stale_update_", "stale_step_")
    for name in names:
        fn = getattr(M, name)

        def wrapped(*a, _fn=fn, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)

        monkeypatch.setattr(M, name, wrapped)


@pytest.mark.parametrize("cls,kwargs", CONFIGS, ids=lambda c: getattr(c, "__name__", None) or str(sorted(c)))
def test_optimizers_multi_tensor_path_is_the_per_tensor_path_on_cpu(monkeypatch, cls, kwargs):
    calls: dict = {}
    _spy(monkeypatch, calls)
    per_tensor, _ = _run(cls, kwargs, "cpu", 20, multi=False)
    assert not calls
    multi, opt = _run(cls, kwargs, "cpu", 20, multi=True)
    assert calls, "the multi-tensor forms never ran"
    if cls is OnebitAdam and kwargs.get("compression") != "momentum":
        assert calls["stale_update_"] == 2 * (20 - 3) and calls["adam_update_"] >= 2 * 3  # per group
    for a, b in zip(per_tensor, multi, strict=True):
        assert torch.equal(a, b)
    moved = [not torch.equal(a, b) for a, b in zip(multi, [p.detach() for p in _params("cpu")], strict=True)]
    assert all(moved)


@pytest.mark.cuda
@pytest.mark.parametrize("cls,kwargs", CONFIGS, ids=lambda c: getattr(c, "__name__", None) or str(sorted(c)))
def test_optimizers_multi_tensor_path_matches_per_tensor_path_on_cuda(cls, kwargs):
    per_tensor, _ = _run(cls, kwargs, "cuda", 20, multi=False)
    multi, _ = _run(cls, kwargs, "cuda", 20, multi=True)
    for a, b in zip(per_tensor, multi, strict=True):
        # foreach's division by a scalar may round differently from aten's (a * (1/b)):
        # bias corrections; everything else is the same formula
        if not kwargs.get("bias_correction"):
            assert torch.equal(a, b), (a - b).abs().max()
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert math.isfinite(float(sum(p.sum() for p in multi)))


def test_in_batches_bounds_the_denominators_made_at_once_and_keeps_the_order():
    from onebit.optimizers._multi import in_batches

    pairs = [(torch.zeros(n), {}) for n in (5, 3, 9, 2, 2, 20, 1)]
    batches = list(in_batches(pairs, limit=10))
    assert [[k for k, _ in b] for b in batches] == [[0, 1], [2], [3, 4], [5], [6]]  # 20 > 10: alone
    assert all(pairs[k][0] is p for b in batches for k, (p, _) in b)
