"""Copies of the DDP hook's state and of DiLoCo go on bitwise as the originals (issue 58): a copy made in
one ``copy.deepcopy`` with the model and the optimizers runs beside the original, on 2 and 3 gloo
ranks, and the two end identical; the hook state copied alone takes over the same model and optimizer
(with ``freeze_step``, whose step hooks then sit twice on the optimizer and act only for their own
state); a DiLoCo copied with a fragment's all-reduce in flight."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from test_frozen_adam_hook import _batch, _model  # the same model and batches as the hook's tests
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit.collectives import OnebitCompressHookState, onebit_compress_hook
from onebit.optimizers import DiLoCo

F = 3  # the hook's freeze_step


def _hooked(module, opt, state):
    model = DDP(module)
    model.register_comm_hook(state, onebit_compress_hook)
    return model


def _hook_step(model, opt, t):
    x, y = _batch(t, dist.get_rank())
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _body_hook(freeze: bool, copy_at: int, alone: bool):
    """Train ``copy_at`` iterations, copy, then 5 more with the original and the copy (or, ``alone``,
    with the copied state on a new DDP of the same module and optimizer) and without any copy."""
    def make():
        module = _model()
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.01)
        kw = dict(optimizer=opt, freeze_step=F) if freeze else dict(start_iter=2)
        return module, opt, OnebitCompressHookState(block=16, **kw)

    module, opt, state = make()
    model = _hooked(module, opt, state)
    ref_module, ref_opt, ref_state = make()
    ref = _hooked(ref_module, ref_opt, ref_state)
    for t in range(copy_at):
        _hook_step(model, opt, t)
        _hook_step(ref, ref_opt, t)
    if alone:
        state2 = copy.deepcopy(state)
        assert state2.optimizer is (opt if freeze else None) and state2.process_group is state.process_group
        model2, opt2, module2 = _hooked(module, opt, state2), opt, module  # the copy takes over
        runs = [(model2, opt2)]
    else:
        module2, opt2, state2 = copy.deepcopy((module, opt, state))
        assert state2.optimizer is (opt2 if freeze else None) and module2 is not module
        model2 = _hooked(module2, opt2, state2)
        runs = [(model, opt), (model2, opt2)]
    for t in range(copy_at, copy_at + 5):
        for m, o in runs + [(ref, ref_opt)]:
            _hook_step(m, o, t)
    assert state2.stats()["resets"] == 0 and state2.iter == ref_state.iter
    out = {"ref": [p.detach().clone() for p in ref_module.parameters()],
           "copy": [p.detach().clone() for p in module2.parameters()]}
    if not alone:
        out["original"] = [p.detach().clone() for p in module.parameters()]
    return out


@pytest.mark.parametrize("freeze, copy_at", [(True, 2), (True, 5), (False, 4)])
@pytest.mark.parametrize("alone", [False, True])
def test_a_hook_state_copy_goes_on_bitwise(ranks, freeze, copy_at, alone):
    for r in ranks(2).run(_body_hook, freeze, copy_at, alone):
        for key in ("copy", "original"):
            for a, b in zip(r.get(key, r["copy"]), r["ref"], strict=True):
                assert torch.equal(a, b), key


def _diloco(model, **kw):
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return inner, outer, DiLoCo(model, inner, outer, sync_every=4, **kw)


def _diloco_step(model, opt, t):
    x, y = _batch(t, dist.get_rank())
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _body_diloco(copy_at: int, kw: dict):
    model = _model()
    _, _, opt = _diloco(model, **kw)
    t = 0
    while t < copy_at or ("delay" in kw and opt._in_flight is None):  # with delay: copy one in flight
        _diloco_step(model, opt, t)
        t += 1
    copy_at, in_flight = t, opt._in_flight is not None
    model2, _, _, opt2 = copy.deepcopy((model, opt.inner, opt.outer, opt))
    assert opt2.process_group is opt.process_group and opt2.params[0] is next(model2.parameters())
    for t in range(copy_at, copy_at + 9):
        for m, o in ((model, opt), (model2, opt2)):
            _diloco_step(m, o, t)
    return {"in_flight": in_flight, "a": [p.detach().clone() for p in model.parameters()],
            "b": [p.detach().clone() for p in model2.parameters()], "syncs": (opt.syncs, opt2.syncs)}


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("copy_at, kw", [(5, {}), (5, {"fragments": 2, "delay": 1})])
def test_a_diloco_copy_goes_on_bitwise(ranks, W, copy_at, kw):
    for r in ranks(W).run(_body_diloco, copy_at, kw):
        assert r["in_flight"] == ("delay" in kw) and r["syncs"][0] == r["syncs"][1] > 0
        for a, b in zip(r["a"], r["b"], strict=True):
            assert torch.equal(a, b)
