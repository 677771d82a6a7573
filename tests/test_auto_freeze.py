"""freeze_step="auto": when it freezes, bounds, rank agreement, checkpoints."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist

from onebit.optimizers import AutoFreeze, OnebitAdam, OnebitLamb, ZeroOneAdam
from onebit.optimizers._freeze import FreezeSchedule


def _feed(schedule, roots):
    """roots[t-1]: sqrt(v) after update t, for one tensor of two coordinates."""
    for t, (a, b) in enumerate(roots, start=1):
        schedule.observe(t, [torch.tensor([a * a, b * b], dtype=torch.float32)], None)
        if schedule.frozen_at(t) is not None:
            return schedule.frozen_at(t)
    return None


def test_freezes_after_patience_calm_windows_and_ignores_scale():
    s = FreezeSchedule("freeze_step", AutoFreeze(window=2, tolerance=0.1, patience=2, min_step=0))
    # checks at t = 2, 4, 6, 8 see shapes (.5, .5), (.75, .25) [moved 0.5], (.75, .25) [0],
    # and (.75, .25) again although sqrt(v) shrank tenfold [0]: calm twice -> frozen at 8
    roots = [(1, 1), (1, 1), (3, 1), (3, 1), (6, 2), (6, 2), (0.6, 0.2), (0.6, 0.2), (9, 1), (9, 1)]
    assert _feed(s, roots) == 8
    assert s.state()["calm"] == 2


def test_a_moved_shape_resets_the_calm_count():
    s = FreezeSchedule("freeze_step", AutoFreeze(window=1, tolerance=0.1, patience=3, min_step=0))
    roots = [(1, 1), (1, 1), (1, 1), (3, 1), (3, 1), (3, 1), (3, 1)]
    assert _feed(s, roots) == 7


def test_tolerance_is_an_l1_distance_between_shapes():
    # (1, 1) -> (1.5, 1): shapes (.5, .5) -> (.6, .4), distance 0.2
    s = FreezeSchedule("freeze_step", AutoFreeze(window=1, tolerance=0.21, patience=1, min_step=0))
    assert _feed(s, [(1, 1), (1.5, 1)]) == 2
    s = FreezeSchedule("freeze_step", AutoFreeze(window=1, tolerance=0.19, patience=1, min_step=0))
    assert _feed(s, [(1, 1), (1.5, 1)]) is None


def test_min_and_max_step_bound_it():
    s = FreezeSchedule("freeze_step", AutoFreeze(window=1, tolerance=0.1, patience=1, min_step=6))
    assert _feed(s, [(1, 2)] * 10) == 6  # calm from t = 2, but not before min_step
    s = FreezeSchedule("freeze_step", AutoFreeze(window=1, tolerance=0.1, patience=1, min_step=0, max_step=5))
    assert _feed(s, [(1, 2), (2, 1)] * 4) == 5  # never calm: max_step decides


def test_fixed_schedules():
    assert FreezeSchedule("freeze_step", 3).frozen_at(2) is None
    assert FreezeSchedule("freeze_step", 3).frozen_at(3) == 3
    assert FreezeSchedule("freeze_step", math.inf).frozen_at(10**9) is None


@pytest.mark.parametrize("value", [-1, 2.5, "Auto", None, True])
def test_bad_freeze_step(value):
    with pytest.raises(ValueError, match="^freeze_step: expected an int >= 1, math.inf, 'auto'"):
        OnebitAdam([torch.nn.Parameter(torch.zeros(3))], freeze_step=value)


def _body_freeze_at_zero():
    messages = []
    pairs = ((OnebitAdam, "freeze_step"), (OnebitLamb, "freeze_step"), (ZeroOneAdam, "var_freeze_step"))
    for cls, name in pairs:
        p = torch.nn.Parameter(torch.zeros(3))
        try:
            cls([p], **{name: 0})
        except ValueError as e:
            messages.append(str(e))
    return messages


@pytest.mark.parametrize("W", [2, 3])
def test_freeze_at_zero_is_refused(ranks, W):
    # a user's mistake (issue 27): freeze_step=0 froze a variance never estimated (zero
    # everywhere); every optimizer refuses it on every rank, saying what to give instead
    for messages in ranks(W).run(_body_freeze_at_zero):
        assert len(messages) == 3
        for m, name in zip(messages, ("freeze_step", "freeze_step", "var_freeze_step"), strict=True):
            assert m.startswith(f"{name}: 0 would freeze a variance that was never estimated"), m
            assert "at least 1 full-precision update" in m and "'auto'" in m


@pytest.mark.parametrize("kw,name", [
    (dict(window=0), "window"), (dict(tolerance=0), "tolerance"), (dict(tolerance=2.0), "tolerance"),
    (dict(patience=0), "patience"), (dict(min_step=-1), "min_step"),
    (dict(min_step=10, max_step=5), "min_step"),
])
def test_bad_auto_freeze(kw, name):
    with pytest.raises(ValueError, match=f"^AutoFreeze.{name}: expected"):
        AutoFreeze(**kw)


SHAPES = [(6, 5), (7,), (3, 4, 2)]
AUTO = AutoFreeze(window=4, tolerance=0.2, patience=2, min_step=8, max_step=200)  # measured: 0.06-0.15


def _grads(t, rank):
    g = torch.Generator().manual_seed(1000 * t + rank)
    scale = torch.linspace(1.0, 3.0, 6).repeat_interleave(5)[:1]  # coordinates of unequal size
    return [torch.randn(s, generator=g) * (1 + torch.arange(math.prod(s)).view(s) % 3) * scale
            for s in SHAPES]


def _make(name, params, auto):
    kw = dict(lr=1e-2, betas=(0.9, 0.9))
    if name == "adam":
        return OnebitAdam(params, freeze_step=auto, **kw)
    if name == "lamb":
        return OnebitLamb(params, freeze_step=auto, **kw)
    return ZeroOneAdam(params, var_freeze_step=auto, var_update_scaler=2, local_step_scaler=4, **kw)


def _body(name, steps, save_at=None, state=None, auto=AUTO, odd_rank_auto=None):
    r = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = _make(name, params, odd_rank_auto if (odd_rank_auto is not None and r == 1) else auto)
    start = 0
    if state is not None:
        blob = torch.load(io.BytesIO(state[r]), weights_only=True)
        with torch.no_grad():
            for p, q in zip(params, blob["params"], strict=True):
                p.copy_(q)
        opt.load_state_dict(blob["opt"])
        start = blob["step"]
    saved = None
    for t in range(start + 1, steps + 1):
        for p, gr in zip(params, _grads(t, r), strict=True):
            p.grad = gr
        opt.step()
        if t == save_at:
            buf = io.BytesIO()
            blob = {"params": [p.detach().clone() for p in params], "opt": opt.state_dict(), "step": t}
            torch.save(blob, buf)
            saved = buf.getvalue()
    return [p.detach().clone() for p in params], opt.frozen_at, opt.stats(), saved


@pytest.mark.parametrize("name", ["adam", "lamb", "zero_one"])
def test_auto_freeze_agrees_on_every_rank_and_resumes_exactly(ranks, name):
    pool = ranks(3)
    full = pool.run(_body, name, 60)
    frozen = full[0][1]
    assert frozen is not None and AUTO.min_step <= frozen < 60 and frozen % AUTO.window == 0, frozen
    assert all(r[1] == frozen for r in full) and all(r[2]["frozen_at"] == frozen for r in full)
    if name != "zero_one":  # 0/1 Adam's replicas differ between synchronisations by design
        assert all(torch.equal(a, b) for r in full[1:] for a, b in zip(r[0], full[0][0], strict=True))
    # a checkpoint in the middle of the calm count (one window before the freeze), then resume
    first = pool.run(_body, name, frozen - 2, frozen - 2)
    assert all(r[1] is None for r in first)
    resumed = pool.run(_body, name, 60, None, [r[3] for r in first])
    for a, b in zip(resumed, full, strict=True):
        assert a[1] == b[1]
        assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))


def test_one_rank_that_disagrees_holds_everyone_back(ranks):
    assert ranks(3).run(_body, "adam", 60)[0][1] < 60  # all with AUTO: frozen within 60
    strict = AutoFreeze(window=4, tolerance=1e-9, patience=2, min_step=8, max_step=200)
    out = ranks(3).run(_body, "adam", 60, None, None, AUTO, strict)
    assert [r[1] for r in out] == [None, None, None]  # rank 1 never calls a window calm


def _check_mismatch():
    r = dist.get_rank()
    params = [torch.nn.Parameter(torch.zeros(4))]
    auto = AutoFreeze(max_step=400 if r == 1 else 500)
    opt = OnebitAdam(params, freeze_step=auto)
    params[0].grad = torch.ones(4)
    try:
        opt.step(check=True)
    except ValueError as exc:
        return str(exc)
    return None


def test_check_names_a_rank_with_other_freeze_settings(ranks):
    out = ranks(3).run(_check_mismatch)
    for m in out:
        assert m is not None and m.startswith("check: group rank 1 disagrees") and "freeze" in m, out
