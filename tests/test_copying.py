"""Copies and pickles of the 1-bit optimizers go on stepping, bitwise as the original (issue 58):
``copy.deepcopy``, ``pickle`` and ``torch.save(opt)`` in the warm-up and past the freeze, on one rank
and on 2 and 3 gloo ranks; the process group is shared by a copy, and an explicit one refuses pickle
with a clear error; ``overlap=True`` refuses both."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from onebit import OnebitAdam, OnebitLamb, ZeroOneAdam

SHAPES = [(300, 230), (301,), (7,)]  # one tensor above the C passes' minimum and LAMB's sketch size


def _make(name: str, **kw):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    if name == "zoa":
        return params, ZeroOneAdam(params, lr=1e-2, var_freeze_step=3, var_update_scaler=1, **kw)
    cls = OnebitAdam if name == "adam" else OnebitLamb
    return params, cls(params, lr=1e-2, freeze_step=3, **kw)


def _copies(opt, how: str):
    if how == "deepcopy":
        return copy.deepcopy(opt)
    if how == "pickle":
        return pickle.loads(pickle.dumps(opt))
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _run(name: str, how: str, copy_at: int, rank: int = 0):
    """The original and its copy (made after ``copy_at`` steps) take the same 4 steps after; returns both
    parameter lists and whether the copy's are its own tensors."""
    params, opt = _make(name)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(copy_at):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    other = _copies(opt, how)
    theirs = [p for group in other.param_groups for p in group["params"]]
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for ps, o in ((params, opt), (theirs, other)):
            for p, grad in zip(ps, grads, strict=True):
                p.grad = grad.clone()
            o.step()
    return ([p.detach().clone() for p in params], [p.detach().clone() for p in theirs],
            all(a is not b for a, b in zip(params, theirs, strict=True)),
            other.state_dict()["onebit"]["counters"], opt.state_dict()["onebit"]["counters"])


def _check(result) -> None:
    mine, theirs, separate, their_counters, my_counters = result
    assert separate
    for a, b in zip(mine, theirs, strict=True):
        assert torch.equal(a, b)
    assert their_counters == my_counters


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("name", ["adam", "lamb", "zoa"])
@pytest.mark.parametrize("copy_at", [1, 5])  # the warm-up (phase 1), past the freeze (phase 2)
def test_a_copy_goes_on_bitwise_as_the_original_on_one_rank(name, how, copy_at):
    _check(_run(name, how, copy_at))


def _ranks_body(name: str, how: str, copy_at: int):
    import torch.distributed as dist

    return _run(name, how, copy_at, dist.get_rank())


@pytest.mark.parametrize(("name", "how", "W", "copy_at"), [
    ("adam", "deepcopy", 2, 5), ("lamb", "pickle", 3, 5), ("zoa", "deepcopy", 3, 5),
    ("zoa", "torch.save", 2, 5),
    # pickled in the warm-up: plain pickle gave the buckets' views storages of their own, so the copy's
    # warm-up wrote a momentum its compressed steps never read (BucketedReducer.__setstate__)
    ("adam", "pickle", 2, 1), ("lamb", "pickle", 2, 1)])
def test_a_copy_goes_on_bitwise_on_several_ranks(ranks, name, how, W, copy_at):
    # the copy and the original each run their collectives on the default group, in turn
    for result in ranks(W).run(_ranks_body, name, how, copy_at):
        _check(result)


def _explicit_group_body():
    import torch.distributed as dist

    group = dist.new_group(list(range(dist.get_world_size())))
    params, opt = _make("adam", group=group)
    for _ in range(4):
        for p in params:
            p.grad = torch.ones(p.shape)
        opt.step()
    other = copy.deepcopy(opt)
    assert other.process_group is group  # shared, not copied
    with pytest.raises(TypeError, match="pickle: the optimizer holds a ProcessGroup"):
        pickle.dumps(opt)
    for o in (opt, other):
        for p in o.param_groups[0]["params"]:
            p.grad = torch.ones(p.shape)
        o.step()
    return [torch.equal(a, b) for a, b in zip(opt.param_groups[0]["params"], other.param_groups[0]["params"],
                                              strict=True)]


def test_an_explicit_group_is_shared_by_a_deepcopy_and_refuses_pickle(ranks):
    for same in ranks(2).run(_explicit_group_body):
        assert all(same)


def test_overlap_refuses_copies_with_what_to_do():
    params, opt = _make("adam", overlap=True)
    for how in ("deepcopy", "pickle"):
        with pytest.raises(TypeError, match=f"{how}: an optimizer built with overlap=True cannot be copied"):
            _copies(opt, how)
