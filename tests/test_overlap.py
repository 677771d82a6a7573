"""OnebitAdam / ZeroOneAdam (overlap=True): compressed all-reduces started from backward, bucket by bucket."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from helpers import fused_steps

from onebit.optimizers import GradScaler, OnebitAdam, ZeroOneAdam


def _model():
    torch.manual_seed(0)
    # bucket_cap_mb=0.002 (524 floats): the first Linear is bucket 0, each later weight a bucket
    return torch.nn.Sequential(torch.nn.Linear(24, 20), torch.nn.Linear(20, 40), torch.nn.Tanh(),
                               torch.nn.Linear(40, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))


def _loss(model, step, rank, unused_on):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(12, 24, generator=g), torch.randint(0, 5, (12,), generator=g)
    # on the ranks in unused_on the first layer gets no gradient (its .grad stays None)
    x = x[:, :20] if rank in unused_on else model[0](x)
    return torch.nn.functional.cross_entropy(model[1:](x), y)


def _state(model, opt):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    red = opt.reducer()
    buckets = red.buckets  # the momenta decoded where the synchronous step kept them as messages
    return flat, [red.decoded(b).clone() for b in buckets], [b.worker_error.clone() for b in buckets], \
        [b.server_error.clone() for b in buckets]


def _optimizer(kind: str, model, overlap: bool, block: int | None = None, error_dtype=torch.float32):
    if kind == "onebit_adam":
        return OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3, bucket_cap_mb=0.002, overlap=overlap,
                          block=block, error_dtype=error_dtype)
    # phase 1 for 10 updates: variance (full-precision) updates 1, 2, 4, 6, 8 (the interval doubles
    # after every 2: 1, 1, 2, 2, 4), compressed gradients on 3, 5, 7, 9, 10; then phase 2 (local
    # steps; syncs on 11, 12, 14: the sync interval doubles after every 2)
    return ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=10, var_update_scaler=2,
                       local_step_scaler=2, bucket_cap_mb=0.002, overlap=overlap, block=block,
                       error_dtype=error_dtype)


# the step indices (0-based) whose compressed all-reduces run from backward
FROM_BACKWARD = {"onebit_adam": lambda s: s >= 3, "zero_one_adam": lambda s: s + 1 in (3, 5, 7, 9, 10)}


def _body(overlap: bool, steps: int, nan_at: tuple[int, int] | None, micro: int, kind: str = "onebit_adam",
          block: int | None = None, error_dtype=torch.float32):
    r = dist.get_rank()
    model = _model()
    opt = _optimizer(kind, model, overlap, block, error_dtype)
    # overlap=True runs the step's maths as separate passes; the synchronous step compared with it
    # does too (its fused passes, C on an x86 CPU, agree with them to float32 rounding:
    # tests/test_fused_cpu.py)
    with fused_steps(None if overlap else "plain"):
        return _run(model, opt, overlap, steps, nan_at, micro, r)


def _run(model, opt, overlap, steps, nan_at, micro, r):
    launched_in_backward = []
    before_nan = after_nan = None
    for step in range(steps):
        if nan_at is not None and step == nan_at[0]:
            before_nan = _state(model, opt)  # before backward, which starts the all-reduces
        opt.zero_grad(set_to_none=True)
        for k in range(micro):
            last = k == micro - 1
            loss = _loss(model, step * micro + k, r, unused_on={1} if step % 2 else set())
            if nan_at == (step, r) and last:
                loss = loss * float("nan")
            if last:
                loss.backward()
            else:
                with opt.no_sync():
                    loss.backward()
        if overlap:
            launched_in_backward.append(opt._overlap.launched)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
        if nan_at is not None and step == nan_at[0]:
            after_nan = _state(model, opt)
    same = None
    if before_nan is not None:
        same = all(torch.equal(a, b) if torch.is_tensor(a) else all(map(torch.equal, a, b))
                   for a, b in zip(before_nan, after_nan, strict=True))
    return _state(model, opt), launched_in_backward, len(opt.reducer().buckets), opt.stats(), same


def _equal(a, b):
    rest = zip(a[1:], b[1:], strict=True)
    return torch.equal(a[0], b[0]) and all(all(map(torch.equal, x, y)) for x, y in rest)


BF16 = torch.bfloat16


@pytest.mark.parametrize(("kind", "W", "steps", "block", "error_dtype"), [
    ("onebit_adam", 2, 8, None, None), ("onebit_adam", 3, 8, None, None),
    ("zero_one_adam", 2, 14, None, None), ("zero_one_adam", 3, 14, None, None),
    ("onebit_adam", 3, 8, 64, None), ("zero_one_adam", 2, 14, 16, None),
    ("onebit_adam", 3, 8, None, BF16), ("zero_one_adam", 2, 14, 16, BF16)])
def test_overlap_is_bitwise_the_synchronous_step(ranks, kind, W, steps, block, error_dtype):
    pool = ranks(W)
    dtype = error_dtype or torch.float32  # bfloat16 errors: widened and stored by the same passes either way
    sync = pool.run(_body, False, steps, None, 1, kind, block, dtype)
    over = pool.run(_body, True, steps, None, 1, kind, block, dtype)
    assert all(e.dtype == dtype for e in over[0][0][2] + over[0][0][3])
    for r in range(W):
        assert _equal(over[r][0], sync[r][0])  # parameters, momentum/accumulator, both error buffers
        # the bytes counted are the same whether the all-reduces ran from backward or from step()
        counted = [{k: v for k, v in out[r][3].items() if k.startswith("bytes")} for out in (sync, over)]
        assert counted[0] == counted[1] and counted[0]["bytes_compressed"] > 0
        mine, first = over[r][0], over[0][0]  # after a sync, replicas are identical
        if kind == "onebit_adam" or steps % 2 == 0:  # ZeroOneAdam: local_step_scaler 2 -> sync at 14
            assert torch.equal(mine[0], first[0]) and all(map(torch.equal, mine[1], first[1]))
    nb = over[0][2]
    assert nb >= 3
    for r in range(W):
        # compressed steps: every bucket from backward, except (on rank 1, odd steps) bucket 0,
        # whose parameters got no gradient and which is last in launch order: step() sends it;
        # other steps (warm-up, variance steps, phase 2): nothing from backward
        expect = [(nb - (1 if (r == 1 and s % 2) else 0)) if FROM_BACKWARD[kind](s) else 0
                  for s in range(steps)]
        assert over[r][1] == expect


@pytest.mark.parametrize("kind", ["onebit_adam", "zero_one_adam"])
def test_overlap_skips_a_non_finite_step_on_every_rank_without_a_trace(ranks, kind):
    pool = ranks(3)
    # step index 4 is update 5: compressed for both optimizers (ZeroOneAdam: a phase-1 gradient step)
    over = pool.run(_body, True, 7, (4, 2), 1, kind)
    sync = pool.run(_body, False, 7, (4, 2), 1, kind)
    for r in range(3):
        assert over[r][4] is True  # the skipped step left parameters, momentum, errors bitwise
        assert over[r][3]["skipped_steps"] == 1
        assert _equal(over[r][0], sync[r][0])


@pytest.mark.parametrize("kind", ["onebit_adam", "zero_one_adam"])
def test_overlap_with_gradient_accumulation_under_no_sync(ranks, kind):
    pool = ranks(2)
    over = pool.run(_body, True, 6, None, 3, kind)
    sync = pool.run(_body, False, 6, None, 3, kind)
    for r in range(2):
        assert _equal(over[r][0], sync[r][0])


def _body_accumulate_without_no_sync():
    model = _model()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=1, bucket_cap_mb=0.002, overlap=True)
    _loss(model, 0, dist.get_rank(), set()).backward()  # the warm-up update
    opt.step()
    opt.zero_grad()
    _loss(model, 0, dist.get_rank(), set()).backward()
    try:
        _loss(model, 1, dist.get_rank(), set()).backward()
    except RuntimeError as e:
        message = str(e)
    else:
        message = ""
    opt.step()  # the buckets launched so far (and the rest) complete on every rank
    return message


def test_accumulating_after_launch_raises(ranks):
    for message in ranks(2).run(_body_accumulate_without_no_sync):
        assert "no_sync" in message and "after its bucket" in message


def test_overlap_refuses_grad_scaler():
    model = _model()
    opt = OnebitAdam(model.parameters(), overlap=True)
    with pytest.raises(ValueError, match=r"^optimizer: built with overlap=True"):
        GradScaler("cpu").unscale_(opt)
