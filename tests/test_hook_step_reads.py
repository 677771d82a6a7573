"""The DDP hook reads the optimizer's step counts together (issue 57): torch's fused and capturable
AdamW keep each parameter's ``step`` as a tensor on its device, where each read is a host
synchronisation; the hook's pre-hook (``freeze_step``) and the Adam-type hook without it (per bucket)
read them in one stacked read per device, whatever the number of parameters; where the counts live on
a GPU, not at all: the bias corrections are made on the device (forced here on a CPU, the same route).
Counted on CPU: the reads of tensor values into Python (helpers.ValueReads) made of the step tensors
themselves (one per parameter before), and all reads."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import ValueReads
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit.collectives import OnebitCompressHookState, onebit_compress_hook


def _model(layers: int):
    torch.manual_seed(0)
    mods = [torch.nn.Linear(12, 12) for _ in range(layers)] + [torch.nn.Linear(12, 3)]
    return torch.nn.Sequential(*mods)


class _OtherAdamW(torch.optim.AdamW):
    """An Adam-type optimizer other than torch's own: the hook prepares its state for its own step."""


def _body(layers: int, freeze: bool, device: bool | None = None, kind=torch.optim.AdamW):
    r = dist.get_rank()
    model = DDP(_model(layers))
    opt = kind(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    kw = dict(freeze_step=2) if freeze else dict(start_iter=1)
    state = OnebitCompressHookState(optimizer=opt, block=16, **kw)
    state._device_counts = device
    if state._frozen_adam is not None:
        state._frozen_adam.device_counts = device
    model.register_comm_hook(state, onebit_compress_hook)
    counts, where, params = [], [], []
    for t in range(6):
        g = torch.Generator().manual_seed(100 * t + r)
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        steps = [opt.state[p]["step"] for p in model.parameters() if "step" in opt.state[p]]
        with ValueReads() as reads:
            loss.backward()
            opt.step()
        opt.zero_grad()
        counts.append((reads.of(steps), len(reads.ids)))
        where.append(dict(reads.where))
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(isinstance(opt.state[p]["step"], torch.Tensor) for p in model.parameters())
    if device is not None:
        return where, params, [float(opt.state[p]["step"]) for p in model.parameters()]
    return counts, sum(1 for _ in model.parameters())


@pytest.mark.parametrize("freeze", [True, False], ids=["freeze_step", "Adam-type hook"])
@pytest.mark.parametrize("layers", [1, 6])
def test_the_hook_reads_the_step_counts_together(ranks, freeze, layers):
    for counts, params in ranks(2).run(_body, layers, freeze):
        assert params == 2 * layers + 2
        # past the freeze (or the start iteration): no step tensor read on its own (one per parameter
        # before: a host synchronisation each on a GPU)
        assert [of_steps for of_steps, _ in counts[3:]] == [0, 0, 0], counts


@pytest.mark.parametrize(("freeze", "kind"), [(True, torch.optim.AdamW), (True, _OtherAdamW),
                                              (False, torch.optim.AdamW)],
                         ids=["freeze_step", "freeze_step-prepared", "Adam-type hook"])
def test_step_counts_on_the_device_are_never_read(ranks, freeze, kind):
    # the route a GPU takes (counts kept there by a fused AdamW), forced on the CPU: past the freeze (or
    # the start iteration) no line of the hook's reads a value, and the run is the host route's: bitwise
    # without the freeze (the same float64 bias correction and roundings); with it, the first frozen
    # step to float32 rounding (the own step's ``-lr / bc1`` made on the device as torch's capturable
    # Adam makes it; the 1-bit messages of the next steps then tell ulps apart, as any rounding does)
    pool = ranks(2)
    on = pool.run(_body, 3, freeze, True, kind)
    off = pool.run(_body, 3, freeze, False, kind)
    for (where, params, steps), (_, ref, ref_steps) in zip(on, off, strict=True):
        assert steps == ref_steps == [6.0] * len(steps)
        for t in range(3, 6):
            assert not [w for w in where[t] if w.startswith(("_frozen_adam", "ddp_hook"))], where[t]
        for t in range(6):
            for a, b in zip(params[t], ref[t], strict=True):
                if not freeze:
                    assert torch.equal(a, b), t
                elif t <= 2:  # (steps 0 and 1 in full precision; step 2 the first frozen one)
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
                    assert t == 2 or torch.equal(a, b)
                else:
                    assert torch.isfinite(a).all()
    for t in range(6):  # replicas identical
        assert all(torch.equal(a, b) for a, b in zip(on[0][1][t], on[1][1][t], strict=True))
