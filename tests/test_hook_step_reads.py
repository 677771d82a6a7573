"""The DDP hook reads the optimizer's step counts together (issue 57): torch's fused and capturable
AdamW keep each parameter's ``step`` as a tensor on its device, where each read is a host
synchronisation; the hook's pre-hook (``freeze_step``) and the Adam-type hook without it (per bucket)
read them in one stacked read per device, whatever the number of parameters. Counted on CPU: the reads
of tensor values into Python (helpers.ValueReads) made of the step tensors themselves (one per
parameter before), and all reads."""

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


def _body(layers: int, freeze: bool):
    r = dist.get_rank()
    model = DDP(_model(layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    kw = dict(freeze_step=2) if freeze else dict(start_iter=1)
    state = OnebitCompressHookState(optimizer=opt, block=16, **kw)
    model.register_comm_hook(state, onebit_compress_hook)
    counts = []
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
    assert all(isinstance(opt.state[p]["step"], torch.Tensor) for p in model.parameters())
    return counts, sum(1 for _ in model.parameters())


@pytest.mark.parametrize("freeze", [True, False], ids=["freeze_step", "Adam-type hook"])
@pytest.mark.parametrize("layers", [1, 6])
def test_the_hook_reads_the_step_counts_together(ranks, freeze, layers):
    for counts, params in ranks(2).run(_body, layers, freeze):
        assert params == 2 * layers + 2
        # past the freeze (or the start iteration): no step tensor read on its own (one per parameter
        # before: a host synchronisation each on a GPU)
        assert [of_steps for of_steps, _ in counts[3:]] == [0, 0, 0], counts
