"""OnebitLamb: the float64 spec reference (with and without the automatic mask), masks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import LAMB_SHAPES, make_grads, set_grads
from optim_reference import reference_onebit_lamb, relative

from onebit.optimizers import OnebitLamb


def _body_lamb(steps, freeze, wd, zero_param, auto_mask=None):
    r = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in LAMB_SHAPES]
    opt = OnebitLamb(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=wd, freeze_step=freeze,
                     compression="momentum", variance_floor=None, auto_mask=auto_mask)
    for t in range(steps):
        grads = make_grads(t, r, LAMB_SHAPES)
        if zero_param:
            grads[1] = torch.zeros_like(grads[1])  # its momentum is exactly zero at the freeze
        set_grads(params, grads)
        opt.step()
    return [p.detach().clone() for p in params], opt.get_lamb_coeffs()

@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("wd,zero_param,auto_mask", [
    (0.0, False, 0.1), (0.01, False, 0.1), (0.01, True, None), (0.01, True, 0.1)],
    ids=["no-wd", "wd", "wd-zero-momentum-reference", "wd-zero-momentum-masked"])
def test_onebit_lamb_matches_float64_reference(ranks, W, wd, zero_param, auto_mask):
    """The reference mode (compression="momentum", variance_floor=None). Random inputs (no zero
    variance): auto_mask on is bitwise the reference's maths. A parameter with zero gradient:
    auto_mask=None is the reference's m/eps update, the mask keeps its momentum zero."""

    freeze, steps = 4, 10
    got = ranks(W).run(_body_lamb, steps, freeze, wd, zero_param, auto_mask)
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) for s in LAMB_SHAPES]
    grads = []
    for t in range(steps):
        per_rank = []
        for r in range(W):
            gr = make_grads(t, r, LAMB_SHAPES)
            if zero_param:
                gr[1] = torch.zeros_like(gr[1])
            per_rank.append(gr)
        grads.append(per_rank)
    ref, ref_coeffs = reference_onebit_lamb(params, grads, lr=1e-2, betas=(0.9, 0.99), eps=1e-6,
                                            weight_decay=wd, freeze_step=freeze, auto_mask=auto_mask)
    # A parameter whose gradient is always zero has v = 0: without the mask its update is
    # m / eps, 1e6 times the float32 rounding of m (measured 2.4e-6 at W = 3); elsewhere
    # measured < 1e-6.
    tol = 1e-5 if zero_param and auto_mask is None else 2e-6
    for r in range(W):
        for i, (x, y) in enumerate(zip(got[r][0], ref, strict=True)):
            assert relative(x, y) < tol, (r, i, relative(x, y))
            assert bool(torch.isfinite(x).all())
        torch.testing.assert_close(torch.tensor(got[r][1], dtype=torch.float64),
                                   torch.tensor(ref_coeffs, dtype=torch.float64), rtol=1e-5, atol=0)
    for r in range(1, W):
        assert all(torch.equal(x, y) for x, y in zip(got[r][0], got[0][0], strict=True))

def _body_lamb_mask(steps):
    r = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in LAMB_SHAPES]
    mask = (torch.arange(35) % 4 != 0).float().view(LAMB_SHAPES[0])
    opt = OnebitLamb([{"params": params[:1], "exp_avg_mask": mask}, {"params": params[1:]}], lr=1e-2,
                     betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01, freeze_step=3, compression="momentum")
    for t in range(steps):
        set_grads(params, make_grads(t, r, LAMB_SHAPES))
        opt.step()
    return [p.detach().clone() for p in params], opt.state[params[0]]["exp_avg"].clone(), mask

def test_onebit_lamb_mask_keeps_masked_momentum_zero(ranks):
    got = ranks(2).run(_body_lamb_mask, 8)
    params, m, mask = got[0]
    assert not m[mask == 0].any() and m[mask == 1].abs().min() > 0
    assert all(torch.equal(x, y) for x, y in zip(params, got[1][0], strict=True))
