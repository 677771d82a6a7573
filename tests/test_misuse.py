"""The mistakes a new user makes (issue 27): each is refused at the moment it is made, with a
message that says what to do instead, or made harmless. Every case runs at W = 2 and W = 3.
(freeze_step=0: tests/test_auto_freeze.py; another rank's state: tests/test_optimizer_state.py;
renamed names: tests/test_ddp_hook.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from onebit.optimizers import OnebitAdam, OnebitLamb, ZeroOneAdam


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _body_add_param_group_after_start(name: str):
    cls = {"adam": OnebitAdam, "lamb": OnebitLamb, "zero_one": ZeroOneAdam}[name]
    model = _model()
    extra = torch.nn.Parameter(torch.ones(5))
    freeze = {"var_freeze_step" if name == "zero_one" else "freeze_step": 2}  # 3 steps cross the freeze
    opt = cls(list(model.parameters())[:2], lr=1e-2, **freeze)
    opt.add_param_group({"params": list(model.parameters())[2:]})  # before training: allowed
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    groups = len(opt.param_groups)
    try:
        opt.add_param_group({"params": [extra]})
    except ValueError as e:
        message = str(e)
    else:
        message = ""
    unchanged = len(opt.param_groups) == groups and all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # training goes on as before
    model(torch.randn(4, 8, generator=g)).square().mean().backward()
    opt.step()
    return message, unchanged, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("name", ["adam", "lamb", "zero_one"])
def test_add_param_group_after_training_started_is_refused(ranks, W, name):
    # was: KeyError 'exp_avg_sq' in warm-up, IndexError after the freeze, at the next step
    got = ranks(W).run(_body_add_param_group_after_start, name)
    for message, unchanged, flat in got:
        assert message.startswith("add_param_group: ") and "training started" in message, message
        assert "pass every parameter group to the constructor" in message
        assert unchanged
        assert torch.equal(flat, got[0][2])  # replicas still identical after the next step
