"""Mixed precision: GradScaler with a one-rank overflow, bf16 parameters, bf16 autocast."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from onebit.optimizers import GradScaler, OnebitAdam, OnebitLamb, ZeroOneAdam


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(dtype)


def _batch(step, rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 8, generator=g)
    return x.to(dtype), (x.sum(1, keepdim=True) * 0.1).to(dtype)


def _make(name, params):
    if name == "adam":
        return OnebitAdam(params, lr=1e-2, freeze_step=3)
    if name == "lamb":
        return OnebitLamb(params, lr=1e-2, freeze_step=3)
    return ZeroOneAdam(params, lr=1e-2, var_freeze_step=3, var_update_scaler=1, local_step_scaler=2,
                       local_step_clipper=2)


def _body_scaler(name, overflow_steps):
    r = dist.get_rank()
    model = _model()
    opt = _make(name, model.parameters())
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    log = []
    for t in range(10):
        x, y = _batch(t, r)
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if (t, r) in overflow_steps:
            next(model.parameters()).grad[0, 0] = float("inf")  # an overflow on this rank only
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        log.append((skipped, scaler.get_scale(), getattr(opt, "updates", None)))
    return log, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["adam", "lamb", "zero_one"])
def test_overflow_on_one_rank_skips_the_step_everywhere(ranks, name):
    overflow = {(1, 1), (6, 0)}  # step 1 (warm-up) on rank 1, step 6 (compressing) on rank 0
    got = ranks(2).run(_body_scaler, name, overflow)
    for r in range(2):
        log = got[r][0]
        assert [s for s, _, _ in log] == [t in (1, 6) for t in range(10)], log
        assert log == got[0][0]  # same skips, same scales, same update counts on every rank
        assert log[-1][2] == 8  # two skipped steps were not counted as updates
    if name != "zero_one":  # 0/1 Adam's replicas differ between syncs by design
        assert all(torch.equal(a, b) for a, b in zip(got[0][1], got[1][1], strict=True))


def _body_bf16(name):
    r = dist.get_rank()
    model = _model(torch.bfloat16)
    opt = _make(name, model.parameters())
    losses = []
    for t in range(12):
        x, y = _batch(t, r, torch.bfloat16)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    p = next(model.parameters())
    state_dtypes = {v.dtype for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.dim()
                    and not (k == "exp_avg_sq" and opt._frozen_for_good())}
    frozen = {opt.state[p]["exp_avg_sq"].dtype} if opt._frozen_for_good() else set()
    return [q.detach().clone() for q in model.parameters()], losses, state_dtypes, p.dtype, frozen


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_bf16_parameters_with_float32_state(ranks, name):
    got = ranks(2).run(_body_bf16, name)
    params, losses, state_dtypes, pdtype, frozen = got[0]
    # float32 state for bfloat16 parameters; the variance, once frozen, stored as variance_dtype says
    assert pdtype == torch.bfloat16 and state_dtypes <= {torch.float32}
    assert frozen <= {torch.bfloat16}
    assert all(torch.equal(a, b) for a, b in zip(params, got[1][0], strict=True))
    assert all(torch.isfinite(q).all() for q in params)
    assert losses[-1] < losses[0]


def test_bf16_autocast_single_process():
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    losses = []
    for t in range(8):
        x, y = _batch(t, 0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert next(model.parameters()).dtype == torch.float32 and losses[-1] < losses[0]
