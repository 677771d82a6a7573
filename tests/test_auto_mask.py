"""The automatic momentum mask: which coordinates it picks, and that they stay put."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from onebit.optimizers import OnebitAdam, OnebitLamb, ZeroOneAdam
from onebit.optimizers._functional import MIN_SAMPLES, tiny_variance_mask


def test_mask_example():
    # sqrt(v) = [0, 1e-3, 1, 2, 3]: mean of the nonzero ones 1.50025, threshold 0.150025
    v = torch.tensor([0.0, 1e-6, 1.0, 4.0, 9.0])
    assert tiny_variance_mask(v, 0.1, MIN_SAMPLES).tolist() == [True, True, False, False, False]
    # a young variance: exact zeros only
    assert tiny_variance_mask(v, 0.1, MIN_SAMPLES - 1).tolist() == [True, False, False, False, False]
    assert tiny_variance_mask(torch.tensor([1.0, 4.0, 9.0]), 0.1, 100) is None  # nothing to mask
    assert tiny_variance_mask(torch.zeros(4), 0.1, 100).tolist() == [True] * 4  # no gradient ever


@pytest.mark.parametrize("value", [-0.1, 1.0, float("nan"), "0.1", True])
def test_bad_auto_mask(value):
    with pytest.raises(ValueError, match=r"^auto_mask: expected None or a number in \[0, 1\)"):
        OnebitAdam([torch.nn.Parameter(torch.zeros(3))], auto_mask=value)


FREEZE, STEPS = 10, 24


def _make(name, params, auto_mask):
    # the mask on top of the reference's maths (momentum compression, no floor)
    kw = dict(lr=1e-2, auto_mask=auto_mask, compression="momentum", variance_floor=None)
    if name == "adam":
        return OnebitAdam(params, freeze_step=FREEZE, **kw)
    if name == "lamb":
        return OnebitLamb(params, freeze_step=FREEZE, **kw)
    return ZeroOneAdam(params, var_freeze_step=FREEZE, var_update_scaler=4, local_step_scaler=4, **kw)


def _body(name, auto_mask):
    r = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 5, generator=g))
    b = torch.nn.Parameter(torch.randn(5, generator=g))
    start = w.detach().clone()
    opt = _make(name, [w, b], auto_mask)
    for t in range(STEPS):
        gg = torch.Generator().manual_seed(100 * t + r)
        gw = torch.randn(6, 5, generator=gg)
        gw[:, 0] = 0.0  # column 0 never has a gradient on any rank: v == 0 there
        w.grad, b.grad = gw, torch.randn(5, generator=gg)
        opt.step()
    return w.detach()[:, 0].clone(), start[:, 0], opt.stats()["masked_coordinates"]


@pytest.mark.parametrize("name", ["adam", "lamb", "zero_one"])
def test_masked_coordinates_keep_their_values(ranks, name):
    out = ranks(2).run(_body, name, 0.1)
    for col, start, masked in out:
        assert masked == 6
        assert torch.equal(col, start)  # no weight decay: Adam would not move them at all
    reference = ranks(2).run(_body, name, None)
    assert not torch.equal(reference[0][0], reference[0][1])  # the reference's maths moves them
