"""compressed_allreduce(..., async_op=True) on gloo: several calls in flight, bitwise the
synchronous call, identical on every rank, whatever the timing of each rank."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from onebit.collectives import compressed_allreduce, padded_numel

SIZES = [1, 37, 1000, 4099, 20000, 8]


def _calls(seed: int, rank: int, W: int):
    """Per call: input (one non-contiguous), worker and server errors with history."""
    out = []
    for k, n in enumerate(SIZES):
        g = torch.Generator().manual_seed(seed * 7919 + k * 31 + rank)
        N = padded_numel(n, W)
        x = torch.randn(n, generator=g)
        if k == 2:  # a transposed view: not contiguous
            x = torch.randn(n // 25, 25, generator=g).t()
        out.append((x, torch.randn(N, generator=g) * 0.1, torch.randn(N // W, generator=g) * 0.1))
    return out


def _body_in_flight(seed: int, rounds: int):
    W, r = dist.get_world_size(), dist.get_rank()
    calls = _calls(seed, r, W)
    sync = [(x.clone(), we.clone(), se.clone()) for x, we, se in calls]
    asyn = [(x.clone(), we.clone(), se.clone()) for x, we, se in calls]
    for _ in range(rounds):  # the same buffers reused round after round (errors carry over)
        for x, we, se in sync:
            compressed_allreduce(x, we, se)
    g = torch.Generator().manual_seed(seed + 100 * r)
    store = dist.distributed_c10d._get_default_store()
    for k in range(rounds):
        futures = []
        for j, (x, we, se) in enumerate(asyn):
            if j == len(asyn) - 1 and r != 0:  # rank 0's last call cannot finish before it probed
                store.wait([f"in-flight-{seed}-{k}"])
            time.sleep(float(torch.rand((), generator=g)) * 0.02)  # a different timing per rank
            futures.append(compressed_allreduce(x, we, se, async_op=True))
        if r == 0:  # a call whose buffers are still in flight is refused and touches nothing
            x, we, se = asyn[-1]
            before = (x.clone(), we.clone(), se.clone())
            with pytest.raises(ValueError, match="worker_error"):
                compressed_allreduce(torch.zeros_like(x), we, se, async_op=True)
            assert all(torch.equal(a, b) for a, b in zip(before, (x, we, se), strict=True))
            store.set(f"in-flight-{seed}-{k}", "probed")
        for fut, (x, _, _) in zip(futures[::-1], asyn[::-1], strict=True):  # waited out of order
            assert fut.wait() is x
    same = all(torch.equal(a, b) for s, t in zip(sync, asyn, strict=True) for a, b in zip(s, t, strict=True))
    return same, [x for x, _, _ in asyn]


@pytest.mark.parametrize("W", [2, 3, 4])
def test_several_calls_in_flight_equal_the_synchronous_calls(ranks, W):
    got = ranks(W).run(_body_in_flight, W, 3)
    assert all(same for same, _ in got)
    for outs in (o for _, o in got[1:]):
        assert all(torch.equal(a, b) for a, b in zip(outs, got[0][1], strict=True))


def _body_nonfinite():
    W, r = dist.get_world_size(), dist.get_rank()
    n = 5000
    N = padded_numel(n, W)
    x = torch.randn(n)
    if r == 1:
        x[4321] = float("nan")
    we, se = torch.randn(N) * 0.1, torch.randn(N // W) * 0.1
    we0, se0 = we.clone(), se.clone()
    out = compressed_allreduce(x, we, se, async_op=True).wait()
    return bool(torch.isnan(out).all()), torch.equal(we, we0) and torch.equal(se, se0)


def test_nonfinite_through_the_async_path(ranks):
    assert ranks(3).run(_body_nonfinite) == [(True, True)] * 3


def _body_part_of_the_world():
    r = dist.get_rank()
    # rank 1 knows one group more than rank 0 ({1, 2}): the async call's companion group over
    # {0, 1}, which only they create, must still get one name on both (it hung before)
    g01, _ = dist.new_group([0, 1]), dist.new_group([1, 2])
    if r == 2:
        return None
    n = 1000
    N = padded_numel(n, 2)
    x = torch.randn(n, generator=torch.Generator().manual_seed(r))
    we, se = torch.zeros(N), torch.zeros(N // 2)
    sync = (x.clone(), we.clone(), se.clone())
    out = compressed_allreduce(x, we, se, group=g01, async_op=True).wait()
    compressed_allreduce(*sync, group=g01)
    return out, torch.equal(out, sync[0]) and torch.equal(we, sync[1]) and torch.equal(se, sync[2])


def test_an_async_call_on_part_of_the_world_whose_ranks_know_different_groups(ranks):
    got = ranks(3).run(_body_part_of_the_world)
    assert got[2] is None and got[0][1] and got[1][1]  # bitwise the synchronous call
    assert torch.equal(got[0][0], got[1][0])


def test_async_arguments():
    x, we, se = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    fut = compressed_allreduce(x, we, se, async_op=True)  # W == 1: complete at once
    assert fut.done() and fut.wait() is x
    with pytest.raises(TypeError, match=r"^async_op: expected a bool"):
        compressed_allreduce(x, we, se, async_op=1)
    with pytest.raises(ValueError, match=r"^raise_on_nonfinite: expected False with async_op=True"):
        compressed_allreduce(x, we, se, async_op=True, raise_on_nonfinite=True)


def test_sequencer_issues_in_call_order():
    """All-gathers are issued in call order even when calls become ready out of order (an
    all-to-all completing before an earlier one's) or give their slot up (a failed call)."""
    from onebit.collectives._async import _Sequencer

    seq, issued = _Sequencer(), []
    tickets = [seq.ticket() for _ in range(5)]
    assert tickets == [0, 1, 2, 3, 4]
    seq.ready(2, lambda: issued.append(2))
    seq.ready(1, lambda: issued.append(1))
    assert issued == []  # 0 not ready yet: nothing may go before it
    seq.ready(0, lambda: issued.append(0))
    assert issued == [0, 1, 2]
    seq.ready(4, lambda: issued.append(4))
    seq.ready(3, None)  # a failed call gives its slot up
    assert issued == [0, 1, 2, 4]
