"""ZeroOneAdam when a group's learning rate sums to 0 over a phase-2 interval (issue 58;
docs/ALGORITHMS.md 6.4): a group frozen with ``lr=0`` never moves and stays finite, a schedule that
decays to 0 stops the parameters where it reaches 0, the other groups train, and the replicas are
bitwise identical after every sync; on the default (fused) path and the plain one."""

from __future__ import annotations

import pytest
import torch
from helpers import fused_steps

from onebit import ZeroOneAdam


def _body(backend: str | None, schedule: bool):
    import torch.distributed as dist

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(300, 230), (301,), (40, 7), (9,)]]
    start = [p.detach().clone() for p in params]
    groups = [{"params": params[:2], "weight_decay": 0.01},
              {"params": params[2:], "lr": 0.0 if not schedule else 3e-3}]
    opt = ZeroOneAdam(groups, lr=1e-2, var_freeze_step=3, var_update_scaler=1, local_step_scaler=2,
                      local_step_clipper=4)
    steps = 14
    sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=8, power=1.0) if schedule else None
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    identical, at_zero = [], None
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        with fused_steps(backend):
            opt.step()
        if sched is not None:
            sched.step()
            if at_zero is None and all(gr["lr"] == 0 for gr in opt.param_groups):
                at_zero = [p.detach().clone() for p in params]
        if opt.replicas_identical:
            identical.append((step, [p.detach().clone() for p in params]))
    return start, [p.detach().clone() for p in params], identical, at_zero, opt.phase


@pytest.mark.parametrize("backend", [None, "plain"])
@pytest.mark.parametrize("schedule", [False, True])
def test_a_group_at_lr_zero_stays_finite_and_still(ranks, backend, schedule):
    results = ranks(3).run(_body, backend, schedule)
    for start, end, identical, at_zero, phase in results:
        assert phase == 2 and len(identical) >= 6
        assert all(torch.isfinite(p).all() for p in end)
        if schedule:  # every group at 0 from step 8 on: the parameters stop where it reached 0
            assert at_zero is not None
            assert all(torch.equal(a, b) for a, b in zip(at_zero, end, strict=True))
            assert not torch.equal(start[0], end[0])
        else:  # the frozen group never moves, the other trains
            assert torch.equal(start[2], end[2]) and torch.equal(start[3], end[3])
            assert not torch.equal(start[0], end[0])
    for r in results[1:]:  # after every sync the replicas are bitwise the same
        for (s0, a), (s1, b) in zip(results[0][2], r[2], strict=True):
            assert s0 == s1 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
