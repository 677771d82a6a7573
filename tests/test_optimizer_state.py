"""Optimizer state: ranks bitwise identical past the freeze, exact resume mid-schedule, a
foreign rank's state."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from helpers import HYPER, body_resume, body_train

from onebit.optimizers import OnebitAdam


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_ranks_stay_bitwise_identical_past_the_freeze(ranks, name):
    got = ranks(4).run(body_train, (0, 110), dict(freeze_step=10, **HYPER), 25.0, None, None, name)
    for t in range(110):
        for r in range(1, 4):
            for x, y in zip(got[r][0][t], got[0][0][t], strict=True):
                assert torch.equal(x, y), f"step {t}: rank {r} differs"

@pytest.mark.parametrize("name", ["adam", "lamb"])
@pytest.mark.parametrize("k", [3, 5, 9], ids=["resume-in-warmup", "resume-at-freeze", "resume-compressing"])
def test_exact_resume(ranks, k, name):
    W, freeze, m = 3, 5, 6
    kwargs = dict(freeze_step=freeze, **HYPER)
    first = ranks(W).run(body_train, (0, k + m), kwargs, 25.0, None, k, name)
    states = [f[1] for f in first]
    second = ranks(W).run(body_resume, k, k + m, kwargs, states, name)
    for r in range(W):
        for x, y in zip(first[r][0][-1], second[r], strict=True):
            assert torch.equal(x, y), f"rank {r}: resumed run differs"

@pytest.mark.parametrize("k", [5, 10, 13], ids=["phase1", "phase2-after-sync", "phase2-between-syncs"])
def test_exact_resume_zero_one_adam(ranks, k):
    W, m = 3, 9
    kwargs = dict(**HYPER)
    first = ranks(W).run(body_train, (0, k + m), kwargs, 25.0, None, k, "zero_one")
    states = [f[1] for f in first]
    second = ranks(W).run(body_resume, k, k + m, kwargs, states, "zero_one")
    for r in range(W):
        for x, y in zip(first[r][0][-1], second[r], strict=True):
            assert torch.equal(x, y), f"rank {r}: resumed run differs"

def _body_foreign_state(states, foreign_ranks):
    import warnings

    r = dist.get_rank()
    source = (0 if r else 1) if r in foreign_ranks else r  # rank 0's state (rank 0: rank 1's), or its own
    blob = torch.load(io.BytesIO(states[source]), weights_only=True)
    params = [torch.nn.Parameter(t.clone()) for t in blob["model"]]
    opt = OnebitAdam(params, freeze_step=2, **HYPER)
    with warnings.catch_warnings(record=True) as at_load:
        warnings.simplefilter("always")
        opt.load_state_dict(blob["opt"])
    errors = [float(we.abs().sum() + se.abs().sum()) for we, se in opt.reducer().errors()]
    saved = torch.load(io.BytesIO(states[r]), weights_only=True)["opt"]["onebit"]
    own = [float(we.abs().sum() + se.abs().sum())
           for we, se in zip(saved["worker_errors"], saved["server_errors"], strict=True)]
    updates = opt.updates
    with warnings.catch_warnings(record=True) as at_step:  # the group agrees at the next step
        warnings.simplefilter("always")
        for _ in range(2):
            for p in params:
                p.grad = torch.ones_like(p)
            opt.step()
    return [str(w.message) for w in at_load], [str(w.message) for w in at_step], errors, own, updates


@pytest.mark.parametrize(("W", "foreign"), [(2, (0, 1)), (2, (1,)), (3, (1, 2))],
                         ids=["both-ranks", "rank-1-only", "W3-rank-0-only-save"])
def test_loading_another_ranks_state_resets_errors_with_one_warning(ranks, W, foreign):
    # (1, 2) at W = 3: a rank-0-only torch.save loaded on every rank
    first = ranks(W).run(body_train, (0, 5), dict(freeze_step=2, **HYPER), 25.0, None, 5)
    got = ranks(W).run(_body_foreign_state, [f[1] for f in first], foreign)
    for r, (at_load, at_step, errors, own, updates) in enumerate(got):
        assert at_load == []  # said at the next step, once for the group, on rank 0
        if r == 0:
            assert len(at_step) == 1, at_step
            assert f"{len(foreign)} of {W} ranks loaded an optimizer state saved by another" in at_step[0]
            assert "onebit.checkpoint.save" in at_step[0]  # the message says what to do
        else:
            assert at_step == []
        if r in foreign:
            assert errors == [0.0] * len(errors) and sum(own) > 0  # there was something to lose
        else:
            assert errors == own  # its own state: the errors are restored
        assert updates == 5  # counters and moments are still restored
