"""``add_param_group`` after the first update (issue 58; docs/ALGORITHMS.md 3.3.1): the new group
starts a cohort with its own warm-up, freeze, buckets and error buffers. On 1, 2 and 3 gloo ranks,
for every 1-bit optimizer: the groups given before run bitwise as without the new group; the new
group runs bitwise as an optimizer built over it alone at the step it joined, and it moves; a
checkpoint taken after the join resumes bitwise whether the resuming script builds the optimizer
with every group or adds the late group again before loading; a non-finite gradient in the new
group skips the step on every rank; under DDP with the warm-up hook, gradients DDP averaged are
not averaged again."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from helpers import ZO

from onebit.optimizers import OnebitAdam, OnebitLamb, ZeroOneAdam, register_ddp_hook

A_SHAPES, B_SHAPES = [(37, 5), (11,)], [(13, 7), (3,), (6, 4)]
JOIN, STEPS = 5, 16
B_LR = 2e-2


def _make(name, params, **kw):
    if name == "zero_one":
        return ZeroOneAdam(params, lr=1e-2, weight_decay=0.01, **{**ZO, "var_freeze_step": 4}, **kw)
    cls = OnebitLamb if name == "lamb" else OnebitAdam
    return cls(params, lr=1e-2, weight_decay=0.01, freeze_step=3, **kw)


def _params(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _grads(shapes, t, rank, seed):
    g = torch.Generator().manual_seed(1000 * seed + 10 * t + rank)
    return [torch.randn(s, generator=g) + 0.2 * rank for s in shapes]


def _give(params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _run(name, A, B, opt, t0, t1, join=JOIN):
    """Steps t0..t1-1 on fresh per-rank gradients; B joins (``add_param_group``) at step ``join``."""
    r = _rank()
    for t in range(t0, t1):
        if t == join:
            opt.add_param_group({"params": B, "lr": B_LR})
        _give(A, _grads(A_SHAPES, t, r, 1))
        if t >= join:
            _give(B, _grads(B_SHAPES, t, r, 2))
        opt.step(check=t == join + 1)  # the ranks agree on every cohort's stage and counters too


def _body_cohort(name):
    """The run with B joining at JOIN, and the references: A alone, B alone from JOIN."""
    r = _rank()
    A, B = _params(A_SHAPES, 0), _params(B_SHAPES, 1)
    B0 = [p.detach().clone() for p in B]
    opt = _make(name, A)
    _run(name, A, B, opt, 0, STEPS)
    A2, B2 = _params(A_SHAPES, 0), _params(B_SHAPES, 1)
    alone_a, alone_b = _make(name, A2), _make(name, [{"params": B2, "lr": B_LR}])
    for t in range(STEPS):
        _give(A2, _grads(A_SHAPES, t, r, 1))
        alone_a.step()
        if t >= JOIN:
            _give(B2, _grads(B_SHAPES, t, r, 2))
            alone_b.step()
    stats = opt.stats()
    return {"A": [p.detach().clone() for p in A], "B": [p.detach().clone() for p in B],
            "A_alone": [p.detach() for p in A2], "B_alone": [p.detach() for p in B2],
            "moved": [float((p.detach() - p0).abs().max()) for p, p0 in zip(B, B0, strict=True)],
            "cohorts": stats["cohorts"], "stage": stats["stage"],
            "bytes_compressed": stats["bytes_compressed"],
            "groups": [g.get("cohort") for g in opt.state_dict()["param_groups"]]}


@pytest.mark.parametrize("name", ["adam", "lamb", "zero_one"])
@pytest.mark.parametrize("W", [1, 2, 3])
def test_a_group_added_mid_run_gets_its_own_warm_up_and_buckets(ranks, name, W):
    results = [_body_cohort(name)] if W == 1 else ranks(W).run(_body_cohort, name)
    for r in results:
        for a, b in zip(r["A"] + r["B"], r["A_alone"] + r["B_alone"], strict=True):
            assert torch.equal(a, b)
        assert min(r["moved"]) > 1e-3
        (cohort,) = r["cohorts"]
        assert cohort["joined_at"] == JOIN and cohort["updates"] == STEPS - JOIN
        assert cohort["frozen_at"] == (4 if name == "zero_one" else 3) and cohort["steps_to_compression"] == 0
        assert cohort["coordinates"] == sum(torch.Size(s).numel() for s in B_SHAPES)
        assert r["groups"] == [None, 1]
        if W > 1:
            assert r["bytes_compressed"] > 0
    if W > 1 and name != "zero_one":  # (0/1 Adam's replicas meet at its synchronisations only)
        for r in results[1:]:
            for a, b in zip(r["A"] + r["B"], results[0]["A"] + results[0]["B"], strict=True):
                assert torch.equal(a, b)


def _body_resume(name, save_at, how):
    r = _rank()
    A, B = _params(A_SHAPES, 0), _params(B_SHAPES, 1)
    opt = _make(name, A)
    _run(name, A, B, opt, 0, save_at)
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in A + B], "opt": opt.state_dict()}, buf)
    copied = {"deepcopy": copy.deepcopy, "pickle": lambda o: pickle.loads(pickle.dumps(o))}.get(how, id)(opt)
    _run(name, A, B, opt, save_at, STEPS)
    blob = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    if how in ("deepcopy", "pickle"):
        o2 = copied
        A2, B2 = o2.param_groups[0]["params"], o2.param_groups[1]["params"]
    else:
        A2 = [torch.nn.Parameter(t.clone()) for t in blob["params"][: len(A_SHAPES)]]
        B2 = [torch.nn.Parameter(t.clone()) for t in blob["params"][len(A_SHAPES):]]
        if how == "every group":
            o2 = _make(name, [{"params": A2}, {"params": B2, "lr": B_LR}])
        else:  # the recipe's own add_param_group, then the checkpoint
            o2 = _make(name, A2)
            o2.add_param_group({"params": B2, "lr": B_LR})
        o2.load_state_dict(blob["opt"])
    for t in range(save_at, STEPS):
        _give(A2, _grads(A_SHAPES, t, r, 1))
        _give(B2, _grads(B_SHAPES, t, r, 2))
        o2.step()
    return {"resumed": [p.detach().clone() for p in A2 + B2], "ref": [p.detach().clone() for p in A + B],
            "cohorts": [c["updates"] for c in o2.stats()["cohorts"]], "foreign": o2._foreign_state}


@pytest.mark.parametrize("name", ["adam", "lamb", "zero_one"])
@pytest.mark.parametrize("how", ["every group", "added again", "deepcopy", "pickle"])
@pytest.mark.parametrize("save_at", [JOIN + 2, JOIN + 6])  # the new group in its warm-up, and compressing
def test_a_checkpoint_after_the_join_resumes_bitwise(ranks, name, how, save_at):
    for r in ranks(2).run(_body_resume, name, save_at, how):
        assert r["cohorts"] == [STEPS - JOIN] and not r["foreign"]
        for a, b in zip(r["resumed"], r["ref"], strict=True):
            assert torch.equal(a, b)


def _body_nonfinite(name):
    r = _rank()
    A, B = _params(A_SHAPES, 0), _params(B_SHAPES, 1)
    opt = _make(name, A)
    _run(name, A, B, opt, 0, JOIN + 4)
    before = [p.detach().clone() for p in A + B]
    _give(A, _grads(A_SHAPES, 99, r, 1))
    grads = _grads(B_SHAPES, 99, r, 2)
    if r == 1:
        grads[1][0] = float("nan")
    _give(B, grads)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        opt.step()
    return {"said": any("step skipped" in str(w.message) for w in said),
            "same": all(torch.equal(a, b) for a, b in zip(before, A + B, strict=True)),
            "skipped": opt.skipped_steps, "updates": [opt.updates, opt._cohorts[0].updates]}


@pytest.mark.parametrize("name", ["adam", "lamb", "zero_one"])
def test_a_nonfinite_gradient_in_the_new_group_skips_every_group(ranks, name):
    results = ranks(2).run(_body_nonfinite, name)
    for r in results:
        assert r["same"] and r["skipped"] == 1 and r["updates"] == [JOIN + 4, 4]
    assert results[0]["said"]  # group rank 0 names the ranks


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _body_ddp(ddp: bool):
    """OnebitAdam over ``a``; ``b`` (in the DDP model since it was built) joins at step 1, while the
    root is in its warm-up (DDP averages ``b``'s gradients: the cohort must not average them again)
    and goes on past the root's freeze (the hook passes local gradients: the cohort averages them)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    r = _rank()
    net = _Net()
    model = DDP(net) if ddp else net
    opt = OnebitAdam(net.a.parameters(), lr=1e-2, freeze_step=3)
    if ddp:
        register_ddp_hook(model, opt)
    averaged = []
    for t in range(8):
        if t == 1:
            opt.add_param_group({"params": list(net.b.parameters())})
        g = torch.Generator().manual_seed(100 * t + r)
        x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        net.zero_grad()  # b's too before it joins (the optimizer's zero_grad covers its own groups)
        if t >= 1:
            averaged.append(opt._cohorts[0].external_averaging)
    return {"params": [p.detach().clone() for p in net.parameters()], "averaged": averaged}


def test_under_ddp_a_cohort_averages_exactly_the_gradients_ddp_did_not(ranks):
    pool = ranks(2)
    with_ddp, without = pool.run(_body_ddp, True), pool.run(_body_ddp, False)
    for r, ref in zip(with_ddp, without, strict=True):
        # DDP averaged at the root's 2 remaining warm-up steps (t = 1, 2), the hook passed after
        assert r["averaged"] == [True, True] + [False] * 5
        assert not any(ref["averaged"])
        for a, b in zip(r["params"], ref["params"], strict=True):  # W = 2: the two averages agree bitwise
            assert torch.equal(a, b)


def _body_refusals():
    A, B = _params(A_SHAPES, 0), _params(B_SHAPES, 1)
    opt = OnebitAdam(A, lr=1e-2, freeze_step=2, overlap=True)
    out = []
    try:
        opt.add_param_group({"params": B})
    except ValueError as e:
        out.append(str(e))
    return out


def test_overlap_still_takes_its_groups_at_construction():
    (message,) = _body_refusals()
    assert "add_param_group" in message and "overlap=True" in message


def test_a_group_added_before_the_first_update_joins_the_optimizers_own_buckets():
    A, B = _params(A_SHAPES, 0), _params(B_SHAPES, 1)
    opt = _make("adam", A)
    opt.state_dict()  # builds the buckets (Accelerate's round trip does) before the first step
    opt.add_param_group({"params": B, "lr": B_LR})
    A2, B2 = _params(A_SHAPES, 0), _params(B_SHAPES, 1)
    ref = _make("adam", [{"params": A2}, {"params": B2, "lr": B_LR}])
    for t in range(6):
        for o, a, b in ((opt, A, B), (ref, A2, B2)):
            _give(a, _grads(A_SHAPES, t, 0, 1))
            _give(b, _grads(B_SHAPES, t, 0, 2))
            o.step()
    assert not opt._cohorts and "cohorts" not in opt.stats()
    for a, b in zip(A + B, A2 + B2, strict=True):
        assert torch.equal(a, b)


def _body_dcp(directory: str):
    """Through torch's DCP helpers with onebit's RankState: they load only the group keys that the
    resuming optimizer's own state dict has, so the cohorts come back from this rank's state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import onebit.checkpoint

    r = _rank()

    def model(seed=0):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def train(m, opt, t0, t1):
        for t in range(t0, t1):
            if t == 3 and len(opt.param_groups) == 1:
                opt.add_param_group({"params": list(m[2].parameters()), "lr": B_LR})
            g = torch.Generator().manual_seed(100 * t + r)
            x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
            m.zero_grad()

    m = model()
    opt = OnebitAdam(m[0].parameters(), lr=1e-2, freeze_step=2)
    train(m, opt, 0, 10)
    straight = [p.detach().clone() for p in m.parameters()]
    m = model()
    opt = OnebitAdam(m[0].parameters(), lr=1e-2, freeze_step=2)
    train(m, opt, 0, 6)
    msd, osd = get_state_dict(m, opt)
    saved = {"model": msd, "optim": osd, "onebit": onebit.checkpoint.RankState(opt)}
    dcp.save(saved, checkpoint_id=directory)
    m = model(seed=1)  # other weights: the checkpoint brings them back
    opt = OnebitAdam([{"params": list(m[0].parameters())}, {"params": list(m[2].parameters()), "lr": B_LR}],
                     lr=1e-2, freeze_step=2)
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd, "onebit": onebit.checkpoint.RankState(opt)}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    cohorts, foreign = len(opt._cohorts), opt._foreign_state
    train(m, opt, 6, 10)
    return cohorts, foreign, all(torch.equal(a, b) for a, b in zip(straight, m.parameters(), strict=True))


def test_a_checkpoint_through_dcp_brings_the_cohorts_back(ranks, tmp_path):
    assert ranks(2).run(_body_dcp, str(tmp_path)) == [(1, False, True)] * 2


def _body_zoa_identical():
    """0/1 Adam with a cohort: after each step, whether it says the replicas are identical, whether the
    root alone is synchronised, and the parameters."""
    r = _rank()
    A, B = _params(A_SHAPES, 0), _params(B_SHAPES, 1)
    opt = _make("zero_one", A)
    rows = []
    for t in range(STEPS + 8):
        if t == JOIN:
            opt.add_param_group({"params": B, "lr": B_LR})
        _give(A, _grads(A_SHAPES, t, r, 1))
        if t >= JOIN:
            _give(B, _grads(B_SHAPES, t, r, 2))
        opt.step()
        rows.append((opt.replicas_identical, opt.last_sync == opt.updates,
                     torch.cat([p.detach().reshape(-1) for p in A + B])))
    return rows


def test_zero_one_adam_says_replicas_are_identical_only_when_its_cohorts_synchronised_too(ranks):
    got = ranks(2).run(_body_zoa_identical)
    for t, (mine, theirs) in enumerate(zip(*got, strict=True)):
        assert mine[0] == theirs[0]
        if mine[0]:
            assert torch.equal(mine[2], theirs[2]), t
    # the root alone synchronised while the cohort was between its synchronisations: not identical
    assert any(root and not said for said, root, _ in got[0]), [row[:2] for row in got[0]]
