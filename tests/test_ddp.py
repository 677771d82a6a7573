"""DDP with the onebit communication hook: same trajectory as standalone, no double averaging."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from onebit.kernels.backends import use_backend
from onebit.optimizers import OnebitAdam, OnebitLamb, ZeroOneAdam, register_ddp_hook
from onebit.optimizers._functional import TRUST_SKETCH


def _model():
    torch.manual_seed(0)
    # 401 parameters, one tensor above TRUST_SKETCH: OnebitLamb's sketches (337 and 674 floats)
    # differ in size from every gradient all-reduce, which the counter below relies on
    return torch.nn.Sequential(torch.nn.Linear(8, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1))


def _make(name, params):
    if name == "adam":
        return OnebitAdam(params, lr=1e-2, freeze_step=3)
    if name == "lamb":
        return OnebitLamb(params, lr=1e-2, freeze_step=3)
    return ZeroOneAdam(params, lr=1e-2, var_freeze_step=6, var_update_scaler=1, local_step_scaler=100)


def _body(name, use_ddp, steps, accumulate=1, backend=None):
    with contextlib.nullcontext() if backend is None else use_backend(backend):
        return _run(name, use_ddp, steps, accumulate)


def _run(name, use_ddp, steps, accumulate):
    r = dist.get_rank()
    model = _model()
    opt = _make(name, model.parameters())
    forward = model
    if use_ddp:
        forward = DistributedDataParallel(model)
        register_ddp_hook(forward, opt)
    real = dist.all_reduce
    counter = {"n": 0, "step": False}
    # OnebitLamb all-reduces its trust-ratio sketches (S m at the freeze, [S(g/d), S p] on each
    # compressed step; at most TRUST_SKETCH floats per tensor, docs/ALGORITHMS.md 6.3): not an
    # average of gradients
    sketch = sum(min(p.numel(), TRUST_SKETCH) for p in model.parameters()) if name == "lamb" else -1

    def counting(tensor, *args, **kwargs):
        # not the optimizer's one-element non-finite check, nor OnebitLamb's sketches
        sketching = counter["step"] and tensor.numel() in (sketch, 2 * sketch)
        counter["n"] += tensor.numel() > 1 and not sketching
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    counts = []
    try:
        for t in range(steps):
            wants = opt.wants_averaged_gradients()
            counter["n"] = 0
            for micro in range(accumulate):  # DDP communicates on the last micro-batch only
                g = torch.Generator().manual_seed(100 * t + 10 * micro + r)
                x = torch.randn(16, 8, generator=g)
                last = micro == accumulate - 1
                with contextlib.nullcontext() if last or not use_ddp else forward.no_sync():
                    loss = torch.nn.functional.mse_loss(forward(x), x.sum(1, keepdim=True))
                    loss.backward()
            in_backward = counter["n"]
            counter["n"], counter["step"] = 0, True
            opt.step()
            counter["step"] = False
            opt.zero_grad()
            counts.append((wants, in_backward, counter["n"]))
    finally:
        dist.all_reduce = real
    return [p.detach().clone() for p in model.parameters()], counts, hasattr(opt, "_zov_cache")


# ("zero_one", "triton"): its variance steps in Triton (optimizers/_fused.py VarianceStep), the gradients
# DDP averaged copied into the accumulators, none averaged again
@pytest.mark.parametrize("name, backend", [("adam", None), ("lamb", None), ("zero_one", None),
                                           ("zero_one", "triton")])
def test_ddp_hook_matches_standalone(ranks, name, backend):
    steps = 9
    ddp = ranks(2).run(_body, name, True, steps, 1, backend)
    alone = ranks(2).run(_body, name, False, steps, 1, backend)
    assert all(out[2] == (backend == "triton") for out in ddp + alone)  # (the Triton variance steps ran)
    for r in range(2):
        for a, b in zip(ddp[r][0], alone[r][0], strict=True):
            torch.testing.assert_close(a, b)  # DDP divides before summing: float32 rounding only
        for (wants, backward, step), (wants2, backward2, step2) in zip(ddp[r][1], alone[r][1], strict=True):
            assert wants == wants2
            assert (backward > 0) == wants and step == 0  # DDP averages, the optimizer never does
            assert backward2 == 0 and (step2 > 0) == wants  # standalone: the optimizer averages
    assert any(w for w, _, _ in ddp[0][1]) and not all(w for w, _, _ in ddp[0][1])


def test_ddp_gradient_accumulation_with_no_sync(ranks):
    ddp = ranks(2).run(_body, "adam", True, 6, 3)
    alone = ranks(2).run(_body, "adam", False, 6, 3)
    for r in range(2):
        for a, b in zip(ddp[r][0], alone[r][0], strict=True):
            torch.testing.assert_close(a, b)
        assert [c[1] > 0 for c in ddp[r][1]] == [c[0] for c in ddp[r][1]]


def test_register_ddp_hook_checks_its_arguments():
    with pytest.raises(TypeError, match="model"):
        register_ddp_hook(torch.nn.Linear(2, 2), OnebitAdam(torch.nn.Linear(2, 2).parameters()))
