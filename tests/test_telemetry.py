"""Telemetry: the seconds onebit's collectives spend in compute and in communication,
per call (the global counter) and per optimizer or hook (stats())."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from onebit.collectives import compressed_allreduce, padded_numel, traffic
from onebit.optimizers import OnebitAdam


def _body_call(n: int, async_op: bool, block):
    W = dist.get_world_size()
    N = padded_numel(n, W, block)
    we, se = torch.zeros(N), torch.zeros(N // W)
    x = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()))
    # one call first, as the timed ones: a process's first call sets up what later ones reuse (the
    # asynchronous calls' thread, the native library), once and outside the stages
    first = compressed_allreduce(x.clone(), we.clone(), se.clone(), async_op=async_op, block=block)
    if async_op:
        first.wait()
    traffic.reset()
    wall = 0.0
    for _ in range(4):
        t0 = time.perf_counter()
        out = compressed_allreduce(x.clone(), we, se, async_op=async_op, block=block)
        if async_op:
            out.wait()
        wall += time.perf_counter() - t0
    return traffic.codec_seconds, traffic.comm_seconds, wall


@pytest.mark.serial  # timings: alone (beside the parallel tests an asynchronous call's thread
# waited 0.1 s of 0.19 to be scheduled between its stages, outside both)
@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize(("async_op", "block"), [(False, None), (True, None), (False, 64)])
def test_a_call_splits_its_time_into_compute_and_communication(ranks, W, async_op, block):
    for codec, comm, wall in ranks(W).run(_body_call, 300_007, async_op, block):
        assert codec > 0 and comm > 0
        # the stages cover the call (argument checks and bookkeeping outside them); asynchronous:
        # the completion callbacks may run just after wait() returns, never long after
        assert 0.5 * wall <= codec + comm <= 1.05 * wall + 1e-3, (codec, comm, wall)


def _body_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=4)
    g = torch.Generator().manual_seed(dist.get_rank())
    windows = []
    for _stage in range(2):  # 4 warm-up updates, then 4 compressed ones
        for _ in range(4):
            model(torch.randn(32, 64, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        windows.append(opt.stats())
    return windows


@pytest.mark.parametrize("W", [2, 3])
def test_optimizer_stats_report_time_per_step(ranks, W):
    for warm, compressed in ranks(W).run(_body_optimizer):
        assert warm["ms_per_step_full"] > 0 and warm["ms_per_step_control"] > 0
        assert warm["ms_per_step_codec"] == 0 and warm["ms_per_step_comm"] == 0
        # the second window: compressed steps only
        assert compressed["ms_per_step_codec"] > 0 and compressed["ms_per_step_comm"] > 0
        assert compressed["ms_per_step_full"] == 0
        for kind in ("codec", "comm", "full", "control"):
            total = warm[f"seconds_{kind}"] + 4 * compressed[f"ms_per_step_{kind}"] / 1000
            assert compressed[f"seconds_{kind}"] == pytest.approx(total, rel=1e-9, abs=1e-12)


def _body_hook():
    from torch.nn.parallel import DistributedDataParallel

    from onebit.collectives import OnebitCompressHookState, onebit_compress_hook

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 8))
    state = OnebitCompressHookState(start_iter=2)
    model.register_comm_hook(state, onebit_compress_hook)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(5):
        model(torch.randn(16, 64, generator=g)).square().mean().backward()
    return state.stats()


@pytest.mark.parametrize("W", [2, 3])
def test_ddp_hook_stats_report_time(ranks, W):
    for stats in ranks(W).run(_body_hook):
        assert stats["seconds_full"] > 0 and stats["seconds_codec"] > 0 and stats["seconds_comm"] > 0


class _Event:
    """What a counter reads of a ``torch.cuda.Event`` (whether it completed, the milliseconds to
    another), on the CPU: the counter's bookkeeping without a GPU (tests/test_cuda.py has the
    real events)."""

    def __init__(self, t: float, done: bool = True) -> None:
        self.t, self.done = t, done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: _Event) -> float:
        return (end.t - self.t) * 1000.0


def test_pending_gpu_stages_are_folded_in_once_completed_without_waiting():
    """Issue 57: a counter that nothing reads held every stage's events (a million after 10,000
    steps); past PENDING_BOUND it folds in the completed ones, oldest first, and stops at the first
    that has not completed (no wait); resolve() waits for the rest."""
    from onebit.collectives.wire import PENDING_BOUND, Traffic

    c = Traffic()
    for i in range(10_000):
        c.add_pending("codec", _Event(i), _Event(i + 0.25))
    assert len(c._pending) <= PENDING_BOUND
    folded = 10_000 - len(c._pending)
    assert c.codec_seconds == pytest.approx(0.25 * folded)
    late = _Event(1e6 + 0.5, done=False)  # the GPU has not reached this one yet
    c.add_pending("comm", _Event(1e6), late)
    for i in range(3 * PENDING_BOUND):
        c.add_pending("codec", _Event(2e6 + i), _Event(2e6 + i + 0.25))
    kinds = [k for k, _, _ in c._pending]
    assert kinds[0] == "comm" and len(kinds) == 3 * PENDING_BOUND + 1 and c.comm_seconds == 0
    c.resolve()
    assert c._pending == [] and c.comm_seconds == pytest.approx(0.5)
    assert c.codec_seconds == pytest.approx(0.25 * (10_000 + 3 * PENDING_BOUND))
