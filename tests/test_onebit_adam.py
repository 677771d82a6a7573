"""OnebitAdam: AdamW equivalence, the float64 spec reference, masks, groups, missing gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from helpers import HYPER, REFERENCE, SHAPES, body_train, make_grads, make_params, set_grads
from optim_reference import reference_onebit_adam, relative

from onebit.optimizers import OnebitAdam


def test_freeze_inf_matches_adamw_single_process():
    a, b = make_params(), make_params()
    opt_a = OnebitAdam(a, freeze_step=math.inf, bias_correction=True, **HYPER)
    opt_b = torch.optim.AdamW(b, foreach=False, **HYPER)
    for t in range(30):
        for params, opt in ((a, opt_a), (b, opt_b)):
            set_grads(params, make_grads(t, 0))
            opt.step()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y)

@pytest.mark.parametrize("W", [2, 3])
def test_freeze_inf_matches_adamw_on_several_ranks(ranks, W):
    # migrating from AdamW (issue 27, docs/migrating.md): bias_correction=True is AdamW's step
    kwargs = dict(freeze_step=math.inf, bias_correction=True, **HYPER)
    got = ranks(W).run(body_train, (0, 20), kwargs, 25.0)
    b = make_params()
    opt = torch.optim.AdamW(b, foreach=False, **HYPER)
    for t in range(20):
        gs = [make_grads(t, r) for r in range(W)]
        set_grads(b, [sum(g) / W for g in zip(*gs, strict=True)])
        opt.step()
    for r in range(W):
        for x, y in zip(got[r][0][-1], b, strict=True):
            torch.testing.assert_close(x, y)

@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("cap", [25.0, 0.0], ids=["one-bucket", "per-param"])
def test_warmup_and_compression_match_float64_reference(ranks, W, cap):
    freeze, steps = 4, 12
    kwargs = dict(freeze_step=freeze, **HYPER, **REFERENCE)
    got = ranks(W).run(body_train, (0, steps), kwargs, cap)
    ref = reference_onebit_adam(
        make_params(), [[make_grads(t, r) for r in range(W)] for t in range(steps)],
        freeze_step=freeze, bucket_cap_mb=cap, **HYPER,
    )
    for r in range(W):
        final = got[r][0][-1]
        for i, (x, y) in enumerate(zip(final, ref, strict=True)):
            if y.numel():
                assert relative(x, y) < 2e-6, (r, i, relative(x, y))
    for r in range(1, W):
        assert all(torch.equal(x, y) for x, y in zip(got[r][0][-1], got[0][0][-1], strict=True))

def _body_mask(steps, freeze):
    r = dist.get_rank()
    params = make_params()
    mask = (torch.arange(SHAPES[0][0] * SHAPES[0][1]) % 3 != 0).float().view(SHAPES[0])
    groups = [{"params": params[:1], "exp_avg_mask": mask}, {"params": params[1:]}]
    opt = OnebitAdam(groups, freeze_step=freeze, **HYPER, **REFERENCE)
    for t in range(steps):
        set_grads(params, make_grads(t, r))
        opt.step()
    return [p.detach().clone() for p in params], mask, opt.state[params[0]]["exp_avg"].clone()

def test_momentum_mask_matches_reference(ranks):
    W, freeze, steps = 3, 3, 8
    got = ranks(W).run(_body_mask, steps, freeze)
    mask = got[0][1]
    ref = reference_onebit_adam(
        make_params(), [[make_grads(t, r) for r in range(W)] for t in range(steps)],
        freeze_step=freeze, masks=[mask] + [None] * (len(SHAPES) - 1), **HYPER,
    )
    for x, y in zip(got[0][0], ref, strict=True):
        if y.numel():
            assert relative(x, y) < 2e-6
    assert not got[0][2][mask == 0].any()  # masked momentum stays exactly zero

def test_single_process_freeze_counts_real_updates():
    params = make_params()
    opt = OnebitAdam(params, freeze_step=2, **HYPER)
    states = []
    for t in range(3):
        set_grads(params, make_grads(t, 0))
        states.append(opt.compressing)
        opt.step()
    assert states == [False, False, True] and opt.updates == 3

def test_eps_inside_sqrt_and_bias_correction_single_process():
    params = make_params()
    opt = OnebitAdam(params, freeze_step=3, bias_correction=True, eps_inside_sqrt=True, **HYPER, **REFERENCE)
    grads = []
    for t in range(8):
        grads.append([make_grads(t, 0)])
        set_grads(params, grads[-1][0])
        opt.step()
    ref = reference_onebit_adam(make_params(), grads, freeze_step=3, bias_correction=True,
                                eps_inside_sqrt=True, **HYPER)
    for x, y in zip(params, ref, strict=True):
        if y.numel():
            assert relative(x, y) < 2e-6

def _body_groups_and_missing_grads(steps, missing):
    r = dist.get_rank()
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    params = make_params()
    groups = [{"params": params[:2], "non_freeze": True}, {"params": params[2:]}]
    opt = OnebitAdam(groups, freeze_step=3, group=pair[r // 2], **HYPER, **REFERENCE)
    for t in range(steps):
        set_grads(params, make_grads(t, r))
        for step, rank, i in missing:
            if step == t and rank == r:
                params[i].grad = None
        opt.step()
    out = [p.detach().clone() for p in params]
    for g in pair:
        dist.destroy_process_group(g)
    return out

def test_non_freeze_groups_subgroups_and_missing_grads(ranks):
    """Two independent pairs of ranks; non_freeze parameters stay full precision; a gradient
    missing on one rank in one step counts as zeros there (warm-up step 2, compressed step 6)."""
    steps, missing = 8, {(1, 0, 1), (5, 2, 3), (5, 3, 5)}
    got = ranks(4).run(_body_groups_and_missing_grads, steps, missing)
    for members in ([0, 1], [2, 3]):
        grads = []
        for t in range(steps):
            per_rank = []
            for r in members:
                gr = make_grads(t, r)
                for step, rank, i in missing:
                    if step == t and rank == r:
                        gr[i] = torch.zeros_like(gr[i])
                per_rank.append(gr)
            grads.append(per_rank)
        head = [[g[:2] for g in s] for s in grads]
        tail = [[g[2:] for g in s] for s in grads]
        live = reference_onebit_adam(make_params()[:2], head, freeze_step=math.inf, **HYPER)
        frozen = reference_onebit_adam(make_params()[2:], tail, freeze_step=3, **HYPER)
        for r in members:
            for x, y in zip(got[r], live + frozen, strict=True):
                if y.numel():
                    assert relative(x, y) < 2e-6, (r, relative(x, y))
            assert all(torch.equal(x, y) for x, y in zip(got[r], got[members[0]], strict=True))
