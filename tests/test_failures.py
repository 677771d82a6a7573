"""Faults in the numbers and between ranks: non-finite gradients, disagreeing ranks,
diverged replicas. Every rank must take the same action and no state may drift."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.distributed as dist
from helpers import HYPER, SHAPES, make_grads, make_optimizer, make_params, set_grads

from onebit.collectives import ReplicaMismatchError, fingerprints, verify_replicas

FREEZE = 3  # warm-up updates (0/1 Adam: variance steps); steps 4.. compress / run locally


def _state_bytes(opt, params) -> bytes:
    """Parameters and optimizer state, serialised (the skip counter and the byte counters left
    out: a skipped step still sent its non-finite checks)."""
    state = opt.state_dict()
    state["onebit"]["counters"].pop("skipped_steps")
    state["onebit"].pop("traffic")
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": state}, buf)
    return buf.getvalue()


def _body_nonfinite(name, steps, bad_step, bad_rank, policy, value):
    """Train ``steps`` loop iterations; at ``bad_step`` poison one gradient on ``bad_rank``
    (``bad_step`` None: that iteration is left out altogether, the reference run)."""
    r = dist.get_rank()
    params = make_params()
    opt = make_optimizer(name, params, dict(freeze_step=FREEZE, nonfinite=policy, **HYPER))
    caught, unchanged = [], None
    for t in range(steps):
        if bad_step is None and t == 6:
            continue
        grads = make_grads(t, r)
        if t == bad_step and r == bad_rank:
            grads[0].view(-1)[3] = value
        set_grads(params, grads)
        before = _state_bytes(opt, params) if t == bad_step else None
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                opt.step()
            except FloatingPointError as exc:
                caught.append(str(exc))
        caught += [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
        if before is not None:
            unchanged = before == _state_bytes(opt, params)
    return [p.detach().clone() for p in params], caught, unchanged, opt.skipped_steps


@pytest.mark.parametrize("name", ["adam", "lamb", "zero_one"])
@pytest.mark.parametrize("bad_step", [1, 6])  # warm-up, then compression / local step
def test_nonfinite_gradient_on_one_rank_skips_on_every_rank(ranks, name, bad_step):
    W, steps = 3, 10
    value = float("nan") if bad_step == 1 else float("inf")
    got = ranks(W).run(_body_nonfinite, name, steps, bad_step, 1, "skip", value)
    reference = ranks(W).run(_body_nonfinite, name, steps, None, 1, "skip", value) if bad_step == 6 else None
    for r, (params, caught, unchanged, skipped) in enumerate(got):
        assert unchanged, f"rank {r}: the skipped step changed parameters or optimizer state"
        assert skipped == 1
        if r == 0:  # a condition every rank sees: warned once, on group rank 0
            assert len(caught) == 1 and "step skipped on every rank" in caught[0]
            assert "rank(s) [1]" in caught[0]
        else:
            assert not caught
        for p, q in zip(params, got[0][0], strict=True):
            assert torch.equal(p, q), f"rank {r} drifted from rank 0"
            assert torch.isfinite(p).all()
    if reference is not None:  # skipping is exactly "this step never happened"
        for p, q in zip(got[0][0], reference[0][0], strict=True):
            assert torch.equal(p, q)


@pytest.mark.parametrize("name", ["adam", "zero_one"])
def test_nonfinite_gradient_raise_policy_raises_on_every_rank(ranks, name):
    got = ranks(3).run(_body_nonfinite, name, 9, 6, 2, "raise", float("-inf"))
    for r, (params, caught, unchanged, skipped) in enumerate(got):
        assert unchanged and skipped == 0
        assert len(caught) == 1, caught
        assert caught[0].startswith("step: non-finite gradient on group rank(s) [2]"), caught
        for p, q in zip(params, got[0][0], strict=True):
            assert torch.equal(p, q), f"rank {r} drifted from rank 0"


def test_nonfinite_none_policy_is_documented_propagation(ranks):
    """nonfinite=None: no check, no extra collective; the collective's NaN semantics apply:
    NaN everywhere, identically, and the error buffers are not poisoned."""
    got = ranks(2).run(_body_nonfinite_errors, 6)
    for params_nan, errors_finite in got:
        assert params_nan and errors_finite


def _body_nonfinite_errors(bad_step):
    r = dist.get_rank()
    params = make_params()
    opt = make_optimizer("adam", params, dict(freeze_step=FREEZE, nonfinite=None, **HYPER))
    for t in range(bad_step + 1):
        grads = make_grads(t, r)
        if t == bad_step and r == 1:
            grads[0].view(-1)[0] = float("nan")
        set_grads(params, grads)
        opt.step()
    errors = [e for pair in opt.reducer().errors() for e in pair]
    return bool(torch.isnan(params[0]).any()), all(bool(torch.isfinite(e).all()) for e in errors)


def _body_disagree(kind):
    r = dist.get_rank()
    shapes = list(SHAPES)
    if kind == "shape" and r == 2:
        shapes[3] = (3, 2, 4)  # same numel, other shape
    if kind == "numel" and r == 1:
        shapes[0] = (7, 6)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    opt = make_optimizer("adam", params, dict(freeze_step=FREEZE, **HYPER))
    if kind == "stage":
        for _ in range(FREEZE - 1):
            set_grads(params, [torch.ones(s) for s in shapes])
            opt.step()
        if r == 2:  # as if rank 2 had loaded a checkpoint one step newer than the others'
            opt.updates += 1
    set_grads(params, [torch.ones(s) for s in shapes])
    try:
        opt.step(check=True)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("shape", "group rank 2 disagrees with group rank 0: parameter 3 is float32 of shape [3, 2, 4]"),
        ("numel", "group rank 1 disagrees with group rank 0: parameter 0 is float32 of shape [7, 6] there"),
        ("stage", "group rank 2 disagrees with group rank 0: it is at the compression stage"),
    ],
)
def test_check_mode_names_the_disagreeing_rank(ranks, kind, expected):
    got = ranks(3).run(_body_disagree, kind)
    for r, message in enumerate(got):
        assert message is not None and message.startswith("check: " + expected), message
        assert message.endswith(f"(this is group rank {r})")


def _body_replicas(diverge_rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))
    checked = verify_replicas(model)
    if dist.get_rank() == diverge_rank:
        w = model[2].weight.data.view(-1)
        w[4] = torch.nextafter(w[4], torch.tensor(10.0))  # one ulp, one element
    try:
        verify_replicas(model)
    except ReplicaMismatchError as exc:
        return checked, str(exc)
    return checked, None


def test_verify_replicas_catches_a_one_ulp_divergence(ranks):
    got = ranks(3).run(_body_replicas, 2)
    for r, (checked, message) in enumerate(got):
        assert checked == 6
        assert message is not None and message.startswith(
            "verify_replicas: '2.weight' differs between replicas: group rank(s) [2]"
        ), message
        assert message.endswith(f"this is group rank {r})")


def test_verify_replicas_passes_identical_replicas(ranks):
    assert ranks(3).run(_body_replicas, None) == [(6, None)] * 3


def test_fingerprints_see_single_changes_and_swaps():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3 * 2**20 + 5, generator=g)
    variants = [a.clone() for _ in range(4)]
    variants[0][-1] = torch.nextafter(a[-1], torch.tensor(9.0))
    variants[1][[10, 2**20 + 10]] = variants[1][[2**20 + 10, 10]]
    variants[2][7] = -a[7]
    variants[3] = a.to(torch.bfloat16)
    fp = fingerprints([a, *variants, a.clone()])
    assert torch.equal(fp[0], fp[5])
    for k in range(1, 5):
        assert not torch.equal(fp[0], fp[k]), k


def test_huge_finite_gradients_are_not_taken_for_non_finite():
    """The fast check sums in float32, which overflows for 2 x 3e38; the exact test decides."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = make_optimizer("adam", [p], dict(freeze_step=FREEZE, nonfinite="raise", **HYPER))
    p.grad = torch.full((4,), 3e38)
    opt.step()
    assert opt.skipped_steps == 0 and opt.updates == 1
    p.grad = torch.tensor([3e38, 3e38, float("inf"), 0.0])
    with pytest.raises(FloatingPointError, match=r"rank\(s\) \[0\]"):
        opt.step()
    assert opt.updates == 1
