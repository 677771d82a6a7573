"""``onebit.optimizers.Combined``: several optimizers over disjoint parameters as one torch optimizer (Muon
on the hidden matrices, AdamW on the rest), for what takes one optimizer object (LR schedulers, the HF
Trainer, Lightning, DiLoCo's inner optimizer). Bitwise its members stepped each; its state dict resumes
bitwise; what it cannot mean is refused, naming the argument."""

from __future__ import annotations

import copy

import pytest
import torch

from onebit.optimizers import Combined

Muon = getattr(torch.optim, "Muon", None)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(30, 12)  # rows never drawn stay unused
        self.hidden = torch.nn.Linear(12, 24, bias=False)
        self.norm = torch.nn.LayerNorm(24)
        self.head = torch.nn.Linear(24, 7)

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.hidden(self.embed(x).mean(1)))))


def _pair(net):
    matrices = [net.hidden.weight]
    rest = [p for p in net.parameters() if p is not net.hidden.weight]
    first = Muon(matrices, lr=0.02, momentum=0.95) if Muon is not None else torch.optim.SGD(
        matrices, lr=0.05, momentum=0.9, nesterov=True)
    return first, torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01)


def _train(steps: int, combined: bool, load=None):
    """``steps`` steps from the start (``load``: the (weights, optimizer, scheduler) state saved after 4
    steps, then the steps after it); returns the model, the optimizer(s), the schedulers."""
    net = _Net()
    first, second = _pair(net)
    if combined:
        both = Combined([first, second])
        stepped = [both]
    else:
        stepped = [first, second]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in stepped]
    gen = torch.Generator().manual_seed(5)
    done = 0
    if load is not None:
        weights, opt_state, sched_state = load
        net.load_state_dict(weights)
        stepped[0].load_state_dict(opt_state)
        schedulers[0].load_state_dict(sched_state)
        done = 4
    for step in range(steps):
        x, y = torch.randint(0, 20, (8, 5), generator=gen), torch.randint(0, 7, (8,), generator=gen)
        if step < done:  # the same batches as the uninterrupted run
            continue
        for o in stepped:
            o.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        for o in stepped:
            o.step()
        for s in schedulers:
            s.step()
    return net, stepped, schedulers


def test_combined_steps_bitwise_as_its_members_and_schedulers_reach_them():
    apart, _, _ = _train(7, combined=False)
    together, (both,), _ = _train(7, combined=True)
    for a, b in zip(apart.parameters(), together.parameters(), strict=True):
        assert torch.equal(a, b)
    # one scheduler on the combination set each member's own groups (halved at 3 and 6)
    assert [g["lr"] for g in both.param_groups] == [(0.02 if Muon else 0.05) * 0.25, 3e-3 * 0.25]
    assert both.members[0].param_groups[0] is both.param_groups[0]
    # each parameter's entry is its member's (Muon: 1 matrix; AdamW: embedding, norm's 2, head's 2)
    assert len(both.state) == sum(len(m.state) for m in both.members) == 6
    assert both.state[together.hidden.weight] is both.members[0].state[together.hidden.weight]
    # a mapping as torch's optimizers' state is (frameworks walk it: Lightning moves it to the device)
    members = [(p, e) for m in both.members for p, e in m.state.items()]
    assert [(id(p), id(e)) for p, e in both.state.items()] == [(id(p), id(e)) for p, e in members]
    assert list(both.state.keys()) == [p for p, _ in members]
    stranger = torch.nn.Parameter(torch.zeros(3))
    assert stranger not in both.state and both.state.get(stranger) is None
    with pytest.raises(KeyError):
        both.state[stranger]
    with pytest.raises(KeyError):
        both.state[stranger] = {}
    head = together.head.weight
    entry = both.state[head]
    both.state[head] = {"moved": entry}  # set in its member, as torch's state[p] = ... is
    assert both.members[1].state[head] == {"moved": entry}
    both.state[head] = entry
    assert both.members[1].state[head] is entry


def test_its_state_dict_resumes_bitwise_and_a_wrong_one_is_refused_before_anything_loads():
    whole, _, _ = _train(8, combined=True)
    net, (both,), (sched,) = _train(4, combined=True)
    saved = copy.deepcopy(both.state_dict())
    assert list(saved) == ["members"] and len(saved["members"]) == 2
    fresh = Combined(_pair(_Net()))
    before = [copy.deepcopy(m.state_dict()) for m in fresh.members]
    for bad in ({"members": saved["members"][:1]}, {"state": {}}, {"members": saved["members"][::-1]}):
        with pytest.raises(ValueError, match="state_dict: "):
            fresh.load_state_dict(bad)
        for m, b in zip(fresh.members, before, strict=True):
            assert m.state_dict() == b  # untouched: no member loaded
    point = (copy.deepcopy(net.state_dict()), saved, sched.state_dict())
    resumed, _, _ = _train(8, combined=True, load=point)
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_what_it_cannot_mean_is_refused():
    net = _Net()
    first, second = _pair(net)
    with pytest.raises(TypeError, match="optimizers: expected a list"):
        Combined(first)
    with pytest.raises(ValueError, match="optimizers: expected at least one"):
        Combined([])
    with pytest.raises(TypeError, match="optimizers"):
        Combined([first, "adamw"])
    with pytest.raises(ValueError, match="stepped by both"):
        Combined([second, torch.optim.SGD([net.head.weight], lr=0.1)])
    both = Combined([first, second])
    with pytest.raises(TypeError, match="optimizers: expected plain optimizers"):
        Combined([both])
    with pytest.raises(TypeError, match="add_param_group: add the group to one of the members"):
        both.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    with pytest.raises(AttributeError, match="param_groups"):
        both.param_groups = []
    assert repr(both).startswith("Combined(")
