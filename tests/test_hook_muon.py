"""torch.optim.Muon behind the DDP hook (issue 59; docs/ALGORITHMS.md 8.3): Muon's momentum is a lerp,
``buf.lerp_(g, 1 - mu)``, SGD's form with the dampening equal to the momentum, so each rank compresses
``g + mu / (1 - mu) * buf`` (its own momentum in gradient units) and Muon's buffer after the step is
``(1 - mu)`` times the compressed mean. Replayed with compressed_allreduce on 2 and 3 gloo ranks (replicas
identical); an optimizer whose momentum onebit does not know is refused, naming it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from onebit.collectives import (
    OnebitCompressHookState,
    compressed_allreduce,
    onebit_compress_hook,
    padded_numel,
)

Muon = getattr(torch.optim, "Muon", None)
pytestmark = pytest.mark.skipif(Muon is None, reason="torch.optim.Muon: torch 2.9+")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(24, 24, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(24, 5, bias=False))


def _body(steps: int, mu: float, nesterov: bool):
    W, r = dist.get_world_size(), dist.get_rank()
    model = _model()
    opt = Muon(model.parameters(), lr=0.02, momentum=mu, nesterov=nesterov, weight_decay=0.01)
    state = OnebitCompressHookState(start_iter=1, optimizer=opt)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)  # several buckets
    record, errors, replay_equal, momentum_close = [], {}, True, True

    def hook(st, bucket):
        compressed = st.iter >= st.start_iter
        grad = bucket.buffer().clone()
        c = None
        if compressed:  # docs/ALGORITHMS.md 8.3, written out: mu / (1 - mu) * buffer (0 before Muon made it)
            c = torch.cat([(opt.state[p]["momentum_buffer"] * (mu / (1.0 - mu))).reshape(-1)
                           if "momentum_buffer" in opt.state[p] else torch.zeros(p.numel())
                           for p in bucket.parameters()])
        fut = onebit_compress_hook(st, bucket)
        if not compressed:
            return fut

        def keep(f):
            record.append((bucket.index(), grad, c, f.value().clone(), list(bucket.parameters())))
            return f.value()

        return fut.then(keep)

    ddp.register_comm_hook(state, hook)
    gen = torch.Generator().manual_seed(10 + r)
    for _ in range(steps):
        x, y = torch.randn(16, 12, generator=gen), torch.randint(0, 5, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        record.sort(key=lambda row: row[0])  # the same order on every rank
        for index, grad, c, out, params in record:
            N = padded_numel(grad.numel(), W, 64)
            we, se = errors.setdefault(index, (torch.zeros(N, dtype=torch.bfloat16),  # (the hook's default)
                                               torch.zeros(N // W, dtype=torch.bfloat16)))
            average = compressed_allreduce(grad + c, we, se, block=64)
            replay_equal &= torch.equal(average - c, out)
            offset = 0
            for p in params:  # Muon's momentum now: (1 - mu) times the compressed mean
                a = average[offset:offset + p.numel()].view_as(p)
                buf = opt.state[p]["momentum_buffer"]
                momentum_close &= torch.allclose(buf, (1.0 - mu) * a, rtol=1e-4,
                                                 atol=1e-5 * float(buf.abs().max()))
                offset += p.numel()
        record.clear()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    buffers = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    return flat, buffers, replay_equal, momentum_close, len(errors), bool(torch.isfinite(flat).all())


@pytest.mark.parametrize("W, mu, nesterov", [(2, 0.95, True), (3, 0.9, False)])
def test_muon_behind_the_hook_compresses_each_ranks_own_momentum(ranks, W, mu, nesterov):
    # read as SGD's buffer (dampening 0) the hook compressed g + mu * buf: the replay and Muon's momentum
    # then disagree with the lerp's construction
    got = ranks(W).run(_body, 6, mu, nesterov)
    for flat, buffers, replay_equal, momentum_close, buckets, finite in got:
        assert torch.equal(flat, got[0][0]) and torch.equal(buffers, got[0][1])  # replicas identical
        assert replay_equal and momentum_close and buckets >= 2 and finite


def test_an_unknown_momentum_is_refused_naming_the_optimizer():
    params = [torch.nn.Parameter(torch.randn(4, 4))]
    with pytest.raises(TypeError, match=r"^optimizer: RMSprop keeps a momentum"):
        OnebitCompressHookState(optimizer=torch.optim.RMSprop(params, momentum=0.9))

    class Mine(torch.optim.Optimizer):
        def __init__(self, ps):
            super().__init__(ps, {"lr": 0.1, "momentum": 0.9})

    with pytest.raises(TypeError, match=r"^optimizer: Mine keeps a momentum"):
        OnebitCompressHookState(optimizer=Mine(params))
    with pytest.raises(ValueError, match=r"^optimizer: a group's momentum is 1.0"):
        OnebitCompressHookState(optimizer=Muon(params, momentum=1.0))
    # without a momentum (or a known one) nothing is refused
    for opt in (torch.optim.RMSprop(params), torch.optim.SGD(params, lr=0.1, momentum=0.9), Muon(params)):
        assert OnebitCompressHookState(optimizer=opt).optimizer is opt
