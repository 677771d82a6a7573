"""Issue 57's capturable step, without a GPU: tests/graph_replay.py emulates a CUDA graph's replay (the
recorded device work run again with the arguments and buffers of its capture). First the emulator
itself (what it replays, what it flags), then OnebitAdam's compression step on the Triton stage: its
replays are bitwise its eager steps, a step skipped on the device included."""

from __future__ import annotations

import pytest
import torch
from graph_replay import Recorder

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, a_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(a_ptr)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + a * tl.load(y_ptr + offs, mask=offs < n),
             mask=offs < n)


def _work(x, y, a, lr: float):
    # a step of the kinds a captured step holds: a functional op read later, in-place ops, a kernel
    # reading a device scalar, a device counter advanced, and a host value (lr) baked in
    z = y * 2.0
    _axpy_kernel[(2,)](x, z, a, x.numel(), BLOCK=64)
    a.mul_(0.5)
    x.add_(y, alpha=lr)


def test_the_emulator_replays_the_device_work_with_the_host_values_of_its_capture():
    g = torch.Generator().manual_seed(0)
    x, y, a = torch.randn(100, generator=g), torch.randn(100, generator=g), torch.ones(1)
    ex, ea = x.clone(), a.clone()
    rec = Recorder()
    with rec.record():
        _work(x, y, a, lr=0.1)
    _work(ex, y.clone(), ea, lr=0.1)
    assert torch.equal(x, ex) and rec.launches == 1 and not rec.reads and not rec.fresh
    for t in range(3):
        y.copy_(torch.randn(100, generator=g))  # a static input refilled, as before a replay
        bx, ba = ex.clone(), ea.clone()
        _work(ex, y.clone(), ea, lr=0.1)  # the device scalar a follows its device updates
        _work(bx, y.clone(), ba, lr=0.2 + t)  # a host value that changes is not seen by a replay
        rec.replay()
        assert torch.equal(x, ex) and torch.equal(a, ea)
        assert not torch.equal(x, bx)


def test_the_emulator_lists_host_reads_and_python_data():
    x = torch.randn(10)
    rec = Recorder()
    with rec.record():
        if bool((x > 0).any()):
            x.add_(torch.tensor([1.0] * 10))
    assert rec.reads == ["aten.is_nonzero.default"] or rec.reads == ["aten._local_scalar_dense.default"]
    assert rec.fresh == [(10,)]


def _adam_replays(W, nonfinite, skip_at, steps=9, capture_at=4):
    import torch.distributed as dist

    from onebit.kernels.backends import use_backend
    from onebit.optimizers import OnebitAdam

    r = dist.get_rank()

    def make():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(*s)) for s in ((40, 33), (7,), (64, 16), (3, 5, 11))]
        opt = OnebitAdam(ps, lr=1e-2, freeze_step=2, bucket_cap_mb=0.004, nonfinite=nonfinite)
        opt._device_agreement = nonfinite == "skip"  # (a GPU's default; here forced on the CPU)
        for p in ps:
            p.grad = torch.zeros_like(p)  # static gradients, refilled each step (a captured model's)
        return ps, opt

    (pa, a), (pb, b) = make(), make()
    g = torch.Generator().manual_seed(r)
    rec, rows = Recorder(), []
    with use_backend("triton"):
        for t in range(steps):
            grads = [torch.randn(p.shape, generator=g) for p in pa]
            if t == skip_at and r == W - 1:
                grads[2][3, 5] = float("nan")
            for ps in (pa, pb):
                for p, x in zip(ps, grads, strict=True):
                    p.grad.copy_(x)
            stage = a.stage
            a.step()
            if t < capture_at:
                b.step()
            elif t == capture_at:
                with rec.record():
                    b.step()
            else:
                rec.replay()
            rows.append((t, stage, all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))))
        sa, sb = a.state_dict()["state"], b.state_dict()["state"]  # the momenta materialised
        moments = [torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in range(len(pa))]
    staged = b._fused_cache.staged is not None
    return rows, moments, rec.reads, rec.launches, a.skipped_steps, staged


@pytest.mark.parametrize("W, nonfinite", [(2, None), (3, "skip")])
def test_onebit_adams_compression_step_replays_bitwise_its_eager_steps(ranks, W, nonfinite):
    # the momentum kept as its message in the same buffer every step (the stage's keep pass copies each
    # gathered message into it): a replay reads what the previous replay kept. Before, each step kept
    # its gathered buffer itself, and a replay read the capture's old message again (step 5 differed).
    skip_at = 6 if nonfinite else None
    out = ranks(W).run(_adam_replays, W, nonfinite, skip_at)
    for rows, moments, reads, launches, skipped, staged in out:
        assert staged and launches >= 5, (staged, launches)  # the Triton stage took the steps
        assert all(stage == "compression" for _, stage, _ in rows[2:]), rows
        assert all(same for _, _, same in rows), rows
        assert all(moments), moments
        if nonfinite is None:
            assert reads == [], reads
        else:  # the previous step's skip flag, from (pinned) host memory; the skip at step 6 replayed
            assert len(reads) <= 1, reads
            assert skipped == 1
