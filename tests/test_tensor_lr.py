"""A 0-dim tensor learning rate, as torch's optimizers take it (issue 58): accepted for the optimizer
and per group, read as its value once per group and step, the same results as that value given as a
float (through the warm-up, the freeze and the compression stage; the fused C passes and the plain
path), the group keeping its tensor (a scheduler writes into it), and a clear error for a tensor that
is not a 0-dim floating one, before anything moves."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import compiled_local, fused_steps

from onebit import OnebitLamb
from onebit.kernels import cpu_simd  # noqa: F401  (read by the skip condition)
from onebit.optimizers import OnebitAdam, ZeroOneAdam

SHAPES = [(37, 5), (9000,), (3,), (70001,)]


def _make(name: str, params, lr, group_lr=None):
    groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}]
    if group_lr is not None:
        groups[1]["lr"] = group_lr
    if name == "zoa":  # phase 1 from step 3, phase 2 (local steps and syncs) from step 6
        return ZeroOneAdam(groups, lr=lr, var_freeze_step=3, local_step_scaler=6, local_step_clipper=2)
    cls = OnebitAdam if name == "adam" else OnebitLamb
    return cls(groups, lr=lr, freeze_step=3)


def _run(name: str, lr, group_lr=None, local: bool = False, steps: int = 10, save_at=None):
    """``steps`` steps under a LinearLR schedule; the parameters, each group's lr object after each
    step, and the state_dict saved after ``save_at``."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = _make(name, params, lr, group_lr)
    if local:  # one rank's whole compute: the fused C passes run
        opt.reducer().allreduce = compiled_local
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.2, total_iters=steps)
    g = torch.Generator().manual_seed(1)
    lrs, saved = [], None
    with fused_steps("native" if local else "plain"):
        for step in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
            sched.step()
            lrs.append([grp["lr"] for grp in opt.param_groups])
            if step == save_at:
                saved = copy.deepcopy(opt.state_dict())
    return [p.detach().clone() for p in params], lrs, saved, opt


def _f64(x: float) -> torch.Tensor:  # a scheduler's products stored without rounding: the float's value
    return torch.tensor(x, dtype=torch.float64)


@pytest.mark.parametrize("name", ["adam", "lamb", "zoa"])
def test_a_tensor_lr_equals_the_float_lr(name):
    want, _, _, _ = _run(name, 3e-3)
    lr = _f64(3e-3)
    got, lrs, _, _ = _run(name, lr)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert all(step[0] is lr for step in lrs)  # the group kept the tensor the scheduler writes into
    assert float(lr) == pytest.approx(3e-3 * 0.2)
    torch.manual_seed(0)
    assert all(not torch.equal(a, torch.randn(s)) for a, s in zip(got, SHAPES, strict=True))  # it moved


@pytest.mark.parametrize("name", ["adam", "lamb", "zoa"])
def test_a_tensor_lr_per_group_equals_the_float_lr(name):
    want, _, _, _ = _run(name, 3e-3, group_lr=1e-3)
    got, lrs, _, _ = _run(name, 3e-3, group_lr=_f64(1e-3))
    torch.manual_seed(0)
    start = [torch.randn(s) for s in SHAPES]
    for a, b, s in zip(got, want, start, strict=True):
        assert torch.equal(a, b) and not torch.equal(a, s)
    assert all(isinstance(step[1], torch.Tensor) and not isinstance(step[0], torch.Tensor) for step in lrs)


@pytest.mark.skipif("not cpu_simd.available()", reason="no C passes on this CPU")
def test_a_tensor_lr_in_the_fused_c_passes():
    want, _, _, _ = _run("adam", 3e-3, local=True)
    got, _, _, _ = _run("adam", _f64(3e-3), group_lr=_f64(3e-3), local=True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["adam", "zoa"])
def test_a_tensor_lr_state_dict_resumes(name):
    full, _, saved, _ = _run(name, _f64(3e-3), save_at=4)
    assert isinstance(saved["param_groups"][0]["lr"], torch.Tensor)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = _make(name, params, _f64(3e-3))
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.2, total_iters=10)
    g = torch.Generator().manual_seed(1)
    with fused_steps("plain"):
        for step in range(10):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            if step == 5:  # resumed from the state saved after step 4, into the live optimizer
                opt.load_state_dict(saved)
            opt.step()
            sched.step()
    for a, b in zip(params, full, strict=True):
        assert torch.equal(a.detach(), b)


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([1e-3]), r"lr: expected a number >= 0 or a 0-dim floating tensor, got a torch.float32 "
                           r"tensor of shape \[1\]"),
    (torch.tensor(1), "lr: expected a number >= 0 or a 0-dim floating tensor, got a torch.int64 tensor"),
    (torch.tensor(-1e-3), r"lr: expected a number >= 0, got -0.001"),
    (torch.tensor(float("nan")), "lr: expected a number >= 0, got nan"),
])
def test_a_bad_tensor_lr_is_refused(bad, match):
    p = torch.nn.Parameter(torch.randn(10))
    for cls in (OnebitAdam, OnebitLamb, ZeroOneAdam):
        with pytest.raises(ValueError, match=match):
            cls([p], lr=bad)
    # given per group it is refused at the step, naming the group, before anything moves
    q = torch.nn.Parameter(torch.randn(10))
    opt = OnebitAdam([{"params": [p]}, {"params": [q], "lr": bad}], lr=1e-3)
    before = [p.detach().clone(), q.detach().clone()]
    p.grad, q.grad = torch.randn(10), torch.randn(10)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['lr'\]: expected a number >= 0"):
        opt.step()
    assert torch.equal(p.detach(), before[0]) and torch.equal(q.detach(), before[1]) and not opt.state
    assert opt.param_groups[1]["lr"] is bad
