"""OnebitLamb's word at the freeze (issue 58): the tensors more than half of whose coordinates never
had a gradient in the warm-up (zero variance), what that costs and which settings recover it, said
once per run (group rank 0), naming each tensor (by its parameter name where the optimizer was given
named parameters), and nothing where no tensor is mostly zero-variance."""

from __future__ import annotations

import warnings

import pytest
import torch

from onebit import OnebitLamb


def _run(zero_share: float, named: bool = False, steps: int = 6, dead: bool = True):
    """Three tensors: ``a`` (200) with its first ``zero_share`` never given a gradient, ``b`` (50 x 4)
    with 20% never, ``c`` (30) never at all (``dead``; else always); freeze after 3 updates. Returns
    the warnings per step."""
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(s)) for s in [(200,), (50, 4), (30,)])
    params = [("emb.weight", a), ("w", b), ("dead.bias", c)] if named else [a, b, c]
    opt = OnebitLamb(params, lr=1e-3, freeze_step=3)
    g = torch.Generator().manual_seed(1)
    said = []
    for _ in range(steps):
        a.grad, b.grad, c.grad = (torch.randn(200, generator=g), torch.randn(50, 4, generator=g),
                                  torch.zeros(30) if dead else torch.randn(30, generator=g))
        a.grad[: int(zero_share * 200)] = 0
        b.grad[:10] = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        said.append([str(w.message) for w in caught if "never had a gradient" in str(w.message)])
    return said, opt


def test_the_freeze_names_the_mostly_zero_variance_tensors_once():
    said, opt = _run(0.7)
    assert [len(s) for s in said] == [0, 0, 1, 0, 0, 0]  # at the third update, the freeze; once
    (message,) = said[2]
    assert "2 tensor(s)" in message
    assert "param_groups[0]['params'][0] (70% of 200)" in message
    assert "param_groups[0]['params'][2] (100% of 30)" in message
    assert "params'][1]" not in message  # 20% at zero variance: not named
    assert "1.29x LAMB" in message and "block=16 with variance_floor=2.0" in message
    assert opt.zero_variance_tensors() == [("param_groups[0]['params'][0]", 140, 200),
                                           ("param_groups[0]['params'][2]", 30, 30)]


def test_named_parameters_are_named():
    said, _ = _run(0.7, named=True)
    (message,) = said[2]
    assert "emb.weight (70% of 200)" in message and "dead.bias (100% of 30)" in message


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_nothing_is_said_where_no_tensor_is_mostly_zero_variance(share):
    said, opt = _run(share, dead=False)  # a: at most half (exactly half is not more than half)
    assert all(not s for s in said)
    assert opt.zero_variance_tensors() == []
