"""The fused CPU passes (onebit.kernels.cpu_fused, C) against the plain torch ops that stay the
reference (onebit.optimizers._functional): the fold bitwise, the update within one float32 ulp
of its operands' scale; zeros, signed zeros, tiny denominators, NaN and infinities where the
plain ops put them; sizes not a multiple of 16; the cases it leaves to the caller; OnebitAdam's
compression stage with and without them on 2 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import fused_steps

from onebit.kernels import cpu_fused
from onebit.kernels.backends import use_backend
from onebit.kernels.preconditioning import inverse_sqrt_bc2, stale_denominator
from onebit.optimizers._functional import fold_, fold_preconditioned_, stale_direction

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif("not cpu_fused.usable()",
                                 reason="no C library here (no C compiler): plain ops run")]

N = cpu_fused.MIN_NUMEL + 13
FLOOR, BC2, EPS = 1e-3, 0.6, 1e-8  # the floor binds on 10% of the variances; r = 1 / sqrt(0.6)
DEN = (float(torch.tensor(FLOOR)), inverse_sqrt_bc2(BC2), EPS)  # (floor, r, eps) as the passes take them


def _den(v):
    """The plain path's stale denominator of ``v`` (what the passes compute from it)."""
    return stale_denominator(v, torch.tensor(FLOOR), EPS, BC2)


def _inputs(seed: int, n: int = N):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(n, generator=g) * 1e-2
    grad = torch.randn(n, generator=g) * 10.0 ** torch.randint(-8, 3, (n,), generator=g)
    v = (torch.rand(n, generator=g) * 1e-2) ** 2
    u[:4], grad[4:8] = torch.tensor([0.0, -0.0, 0.0, -0.0]), torch.tensor([0.0, -0.0, 1e-38, -1e-38])
    return u, grad, v


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("beta1", [0.9, 0.0, 0.999])
def test_fold_is_bitwise_the_plain_ops(seed, beta1):
    u, grad, v = _inputs(seed)
    grad[100], grad[101] = float("nan"), float("inf")  # non-finite where the plain ops put it
    v[102], v[103], v[104] = float("inf"), float("nan"), 0.0  # d = inf, NaN, the floor's
    want = fold_preconditioned_(u.clone(), grad, _den(v), beta1)
    got = u.clone()
    assert cpu_fused.fold_preconditioned_(got, grad, v, DEN, beta1)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))  # -0.0 kept


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("nl", [-1e-3, -0.37, -3e-7])
def test_zero_one_adams_momentum_at_rest_is_bitwise_the_plain_ops(seed, nl):
    # ZeroOneAdam's momentum made again from a sync's decoded mean: (u * d) / nl, as the sync wrote it
    u, _, v = _inputs(seed)
    u[100], v[102], v[103], v[104] = float("inf"), float("inf"), float("nan"), 0.0
    want = torch.mul(u, _den(v)).div_(nl)
    got = torch.empty_like(u)
    assert cpu_fused.zoa_momentum_(got, u, v, DEN, nl)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))
    assert not cpu_fused.zoa_momentum_(got[:100], u[:100], v[:100], DEN, nl)  # below MIN_NUMEL: the caller's


@pytest.mark.parametrize(("lr", "wd", "clip", "bc1"), [
    (1e-3, 0.0, 1.0, 1.0), (3e-4, 0.01, 1.0, 0.1), (1e-2, 0.1, None, 0.5), (1e-3, 0.0, 1e-3, 0.999),
])
def test_update_is_the_plain_ops_to_one_ulp(lr, wd, clip, bc1):
    u, _, _ = _inputs(7)
    u = u * 300.0  # many coordinates past the clip
    u[50] = float("nan")
    p = torch.randn(N, generator=torch.Generator().manual_seed(8))
    p[60] = 0.0
    want = p.clone()
    step = stale_direction(want, u, None, 0.0, clip, bc1)
    if wd:
        want.mul_(1.0 - lr * wd)
    want.add_(step, alpha=-lr)
    got = p.clone()
    assert cpu_fused.stale_update_(got, u, lr=lr, weight_decay=wd, clip=clip, bc1=bc1)
    # one float32 ulp of the operands' scale |p| + lr |step|: the plain add_ rounds p - lr*step once
    # (a fused multiply-add), the compiled loop twice; where the two cancel, that is more ulps of
    # the (small) result
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    scale = (p.abs() + lr * step.abs())[ok]
    assert bool(((got[ok] - want[ok]).abs() <= torch.finfo(torch.float32).eps * scale).all())
    assert (got == want).float().mean() > 0.5  # and mostly bitwise
    assert bool(torch.isnan(got[50])) and (got != p).float().mean() > 0.99  # it moved every coordinate


def _close_to_one_ulp(got, want, scale):
    """NaN and infinities where the plain ops put them; elsewhere within one float32 ulp of
    ``scale``, and mostly bitwise (the plain add_ rounds a multiply-add once, the compiled loop
    twice)."""
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    inf = torch.isinf(want)
    assert torch.equal(got[inf], want[inf])
    ok = torch.isfinite(want)
    assert bool(((got[ok] - want[ok]).abs() <= torch.finfo(torch.float32).eps * scale[ok]).all())
    assert (got == want).float().mean() > 0.5


@pytest.mark.parametrize(("fold", "lr", "wd", "clip"), [
    (False, 1e-3, 0.0, 1.0), (False, 3e-4, 0.01, None), (True, 1e-3, 0.0, 1.0), (True, 1e-2, 0.1, 1e-3),
    (True, 1e-3, 0.0, None),
])
def test_zero_one_adam_steps_are_the_plain_ops_to_one_ulp(fold, lr, wd, clip):
    m, grad, v = _inputs(11)
    m = m * 300.0  # many coordinates past the clip
    m[50], v[51], grad[52] = float("nan"), float("nan"), float("inf")  # non-finite where the plain ops put it
    d = _den(v)
    p = torch.randn(N, generator=torch.Generator().manual_seed(12))
    p[60] = 0.0
    want_p, want_m = p.clone(), m.clone()
    if fold:
        fold_(want_m, grad, 0.9)
    step = stale_direction(want_p, want_m, d, wd, clip)
    want_p.add_(step, alpha=-lr)
    got_p, got_m = p.clone(), m.clone()
    if fold:
        assert cpu_fused.local_step_(got_p, got_m, grad, v, DEN, beta1=0.9, lr=lr, weight_decay=wd, clip=clip)
        _close_to_one_ulp(got_m, want_m, 0.9 * m.abs() + 0.1 * grad.abs())
    else:
        assert cpu_fused.stale_step_(got_p, got_m, v, DEN, lr=lr, weight_decay=wd, clip=clip)
        assert torch.equal(got_m.view(torch.int32), m.view(torch.int32))  # read only
    # the step's own rounding (p + wd*p, then p - lr*that) and, folded, the last bit of m's
    # operands carried through m / d
    scale = p.abs() + lr * step.abs()
    if fold:
        scale += lr * (0.9 * m.abs() + 0.1 * grad.abs()) / d
    _close_to_one_ulp(got_p, want_p, 2 * scale)
    assert bool(torch.isnan(got_p[50])) and (got_p != p).float().mean() > 0.99  # it moved every coordinate


def test_it_leaves_to_the_caller_what_it_does_not_fuse():
    u, grad, d = _inputs(0)
    small = cpu_fused.MIN_NUMEL - 1
    cases = [
        (u[:small].clone(), grad[:small], d[:small]),  # too small to pay for a call
        (u.clone(), grad.to(torch.bfloat16), d),  # another dtype
        (u.clone(), grad[: 2 * (N // 2)].view(-1, 2).t()[0], d[: N // 2]),  # not contiguous
        (u.clone(), grad[:-1], d),  # sizes differ
    ]
    for uu, gg, dd in cases:
        before = uu.clone()
        assert not cpu_fused.fold_preconditioned_(uu, gg, dd, DEN, 0.9)
        assert torch.equal(uu, before)
    assert not cpu_fused.fold_preconditioned_(u, None, d, DEN, 0.9)
    before = u.clone()
    with use_backend("plain"):
        assert not cpu_fused.fold_preconditioned_(u, grad, d, DEN, 0.9)
        assert not cpu_fused.stale_update_(u, d, lr=1e-3, weight_decay=0.0, clip=1.0, bc1=1.0)
        assert not cpu_fused.stale_step_(u, grad, d, DEN, lr=1e-3, weight_decay=0.0, clip=1.0)
        assert not cpu_fused.local_step_(u, grad.clone(), grad, d, DEN, beta1=0.9, lr=1e-3, weight_decay=0.0,
                                         clip=1.0)
    assert torch.equal(u, before)
    assert not cpu_fused.local_step_(u, grad.clone(), None, d, DEN, beta1=0.9, lr=1e-3, weight_decay=0.0,
                                     clip=1.0)
    assert not cpu_fused.stale_step_(u[:small], grad[:small], d[:small], DEN, lr=1e-3, weight_decay=0.0,
                                     clip=1.0)
    assert torch.equal(u, before)


def _body_adam(plain: bool, optimizer: str = "onebit_adam"):
    from onebit.optimizers import OnebitAdam, ZeroOneAdam

    # the per-parameter passes (the bucket's fused passes: tests/test_fused_cpu.py); plain: none
    scope = use_backend("plain") if plain else fused_steps("plain")
    fused = ({"fold_preconditioned_": 0, "stale_update_": 0} if optimizer == "onebit_adam"  # calls that ran
             else {"stale_step_": 0, "local_step_": 0})  # the fused pass
    originals = {name: getattr(cpu_fused, name) for name in fused}

    def counted(name):
        def call(*args, **kwargs):
            done = originals[name](*args, **kwargs)
            fused[name] += done
            return done
        return call

    for name in fused:
        setattr(cpu_fused, name, counted(name))
    try:
        scope.__enter__()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 320), torch.nn.Tanh(), torch.nn.Linear(320, 8))
        if optimizer == "onebit_adam":
            # exact errors: the runs agree to float32 rounding, and bfloat16's stochastic rounding keys on
            # the scales, so a scale's last bit draws other bits (tests/test_error_dtype.py covers those)
            opt = OnebitAdam(model.parameters(), lr=3e-3, freeze_step=3, weight_decay=0.01,
                             bias_correction=True, error_dtype=torch.float32)
        else:  # phase 1 to step 6, then local steps and syncs
            opt = ZeroOneAdam(model.parameters(), lr=3e-3, var_freeze_step=6, var_update_scaler=2,
                              local_step_scaler=2, local_step_clipper=4, weight_decay=0.01,
                              error_dtype=torch.float32)
        g = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(12):
            x = torch.randn(64, 256, generator=g)
            torch.nn.functional.mse_loss(model(x), x[:, :8]).backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), fused
    finally:
        scope.__exit__(None, None, None)
        for name, fn in originals.items():
            setattr(cpu_fused, name, fn)


def test_onebit_adam_compression_stage_with_and_without_the_fused_passes(ranks):
    assert 256 * 320 >= cpu_fused.MIN_NUMEL  # the first layer takes the fused passes
    fused, plain = ranks(2).run(_body_adam, False), ranks(2).run(_body_adam, True)
    # the first layer's weight in each of the 9 compressed steps (its bias and the second layer
    # are below MIN_NUMEL); none with every step plain
    assert fused[0][1] == {"fold_preconditioned_": 9, "stale_update_": 9}, fused[0][1]
    assert plain[0][1] == {"fold_preconditioned_": 0, "stale_update_": 0}, plain[0][1]
    assert torch.equal(fused[0][0], fused[1][0])  # the ranks agree bitwise
    torch.testing.assert_close(fused[0][0], plain[0][0], rtol=1e-5, atol=1e-7)


def test_zero_one_adam_with_and_without_the_fused_passes(ranks):
    fused, plain = ranks(2).run(_body_adam, False, "zero_one"), ranks(2).run(_body_adam, True, "zero_one")
    counts = fused[0][1]
    # the first layer's weight: phase 1's steps (variance steps too), then phase 2's local steps
    assert counts["stale_step_"] >= 4 and counts["local_step_"] >= 4, counts
    assert counts["stale_step_"] + counts["local_step_"] == 12, counts
    assert plain[0][1] == {"stale_step_": 0, "local_step_": 0}, plain[0][1]
    for r in range(2):  # phase 2's local steps: each rank its own weights until the next sync
        torch.testing.assert_close(fused[r][0], plain[r][0], rtol=1e-5, atol=1e-7)
