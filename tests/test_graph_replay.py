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


def _step_captured(opt, rec: Recorder, t: int, at: int) -> None:
    """``opt``'s step ``t``: eager before ``at``, recorded at ``at``, the recording replayed after."""
    if t < at:
        opt.step()
    elif t == at:
        with rec.record():
            opt.step()
    else:
        rec.replay()


def _adam_replays(W, nonfinite, skip_at, capturable=False, steps=9, capture_at=4):
    import torch.distributed as dist

    from onebit.kernels.backends import use_backend
    from onebit.optimizers import OnebitAdam

    r = dist.get_rank()

    def make(capture: bool):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(*s)) for s in ((40, 33), (7,), (64, 16), (3, 5, 11))]
        groups = [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.1, "betas": (0.8, 0.99)}]
        # with capturable=True, the bias correction and a tensor lr that a scheduler writes into
        lr = torch.tensor(1e-2) if capturable else 1e-2
        opt = OnebitAdam(groups, lr=lr, freeze_step=2, bucket_cap_mb=0.004, nonfinite=nonfinite,
                         bias_correction=capturable, capturable=capture)
        opt._device_agreement = nonfinite == "skip"  # (a GPU's default; here forced on the CPU)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.7) if capturable else None
        for p in ps:
            p.grad = torch.zeros_like(p)  # static gradients, refilled each step (a captured model's)
        return ps, opt, sched

    (pa, a, sa), (pb, b, sb) = make(False), make(capturable)
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
            _step_captured(b, rec, t, capture_at)
            for sched in (sa, sb):
                if sched is not None:
                    sched.step()
            rows.append((t, stage, all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))))
        sda, sdb = a.state_dict(), b.state_dict()  # the momenta materialised; b's counters read back
    moments = [torch.equal(sda["state"][k]["exp_avg"], sdb["state"][k]["exp_avg"]) for k in range(len(pa))]
    counters = ((a.updates, a.skipped_steps), (b.updates, b.skipped_steps))
    staged = b._fused_cache.staged is not None
    from onebit.memory import bytes_per_parameter

    extra = bytes_per_parameter(b) - bytes_per_parameter(a)  # the capturable step's kept messages
    return rows, moments, rec.reads, rec.fresh, rec.launches, counters, (staged, extra)


@pytest.mark.parametrize("W, nonfinite", [(2, None), (3, "skip")])
def test_onebit_adams_compression_step_replays_bitwise_its_eager_steps(ranks, W, nonfinite):
    # the momentum kept as its message in the same buffer every step (the stage's keep pass copies each
    # gathered message into it): a replay reads what the previous replay kept. Before, each step kept
    # its gathered buffer itself, and a replay read the capture's old message again (step 5 differed).
    skip_at = 6 if nonfinite else None
    out = ranks(W).run(_adam_replays, W, nonfinite, skip_at)
    for rows, moments, reads, _, launches, _, (staged, extra) in out:
        assert staged and launches >= 5, (staged, launches)  # the Triton stage took the steps
        assert extra == 0.0, extra
        assert all(stage == "compression" for _, stage, _ in rows[2:]), rows
        assert all(same for _, _, same in rows), rows
        assert all(moments), moments
        if nonfinite is None:
            assert reads == [], reads
        else:  # the previous step's skip flag, from (pinned) host memory
            assert len(reads) <= 1, reads


@pytest.mark.parametrize("W, nonfinite", [(2, None), (3, "skip")])
def test_a_capturable_step_replays_bitwise_the_eager_steps_with_a_schedule_and_a_skip(ranks, W, nonfinite):
    # OnebitAdam(capturable=True) (optimizers/_capture.py) against the default optimizer, both with the
    # bias correction and a tensor lr that ExponentialLR writes into after every step: the replays follow
    # the schedule and the step count on the device (without, both are the capture's: replays differ
    # from step 5 on), a skip at a replayed step (3 ranks) is counted on the device; the captured step
    # reads nothing back and writes no table from the host; the counters read back by state_dict()
    skip_at = 6 if nonfinite else None
    out = ranks(W).run(_adam_replays, W, nonfinite, skip_at, True)
    for rows, moments, reads, fresh, launches, (host, device), (staged, extra) in out:
        assert staged and launches >= 5, (staged, launches)
        # its four kinds of messages kept: (3 + 1/W) / 8 bytes per element, + the scales and padding of
        # these small buckets (+ 16 bytes of counters)
        assert (3 + 1 / W) / 8 < extra < (3 + 1 / W) / 8 + 0.1, extra
        assert all(same for _, _, same in rows), rows
        assert all(moments), moments
        assert reads == [] and fresh == [], (reads, fresh)
        assert host == device == ((9, 0) if nonfinite is None else (8, 1)), (host, device)


def _capture_refusals():
    from unittest import mock

    import torch.distributed as dist

    from onebit.kernels.backends import use_backend
    from onebit.optimizers import OnebitAdam, _base

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(40, 33)), torch.nn.Parameter(torch.randn(7))]
    made = {flag: OnebitAdam(ps, lr=1e-2, freeze_step=2, capturable=flag) for flag in (False, True)}
    for opt in made.values():
        opt._device_agreement = True
    g = torch.Generator().manual_seed(dist.get_rank())
    said = []
    with use_backend("triton"):
        for t in range(4):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            for flag, opt in made.items():
                before = [p.detach().clone() for p in ps]
                with mock.patch.object(_base, "capturing", lambda: True):
                    try:
                        opt.step()
                        said.append((t, flag, None))
                    except RuntimeError as exc:
                        said.append((t, flag, str(exc)))
                        assert all(torch.equal(p, q) for p, q in zip(ps, before, strict=True))
                if said[-1][2] is not None:
                    opt.step()  # the same step, not captured
    return said


def test_a_step_that_cannot_be_captured_says_so_and_changes_nothing(ranks):
    # a CUDA graph's capture (torch.cuda.is_current_stream_capturing, patched): without capturable=True,
    # in the warm-up, and at the first compression step (its agreement on the host) the step raises
    # before it changes anything; from the second compression step on a capturable one is taken
    said = ranks(2).run(_capture_refusals)[0]
    refused = {(t, flag) for t, flag, msg in said if msg is not None}
    assert refused == {(0, False), (1, False), (2, False), (3, False), (0, True), (1, True), (2, True)}, said
    assert all("capturable=True" in msg for t, flag, msg in said if msg is not None and not flag), said
    assert all("compression stage" in msg for t, flag, msg in said if msg is not None and flag), said


def _capturable_eager(backend):
    import torch.distributed as dist

    from onebit.kernels.backends import use_backend
    from onebit.optimizers import OnebitAdam

    def make(flag: bool):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(40, 33)), torch.nn.Parameter(torch.randn(7))]
        opt = OnebitAdam(ps, lr=torch.tensor(1e-2), freeze_step=2, bias_correction=True, capturable=flag)
        opt._device_agreement = backend == "triton"
        return ps, opt, torch.optim.lr_scheduler.ExponentialLR(opt, 0.8)

    runs = [make(False), make(True)]
    g = torch.Generator().manual_seed(dist.get_rank())
    with use_backend(backend):
        for t in range(7):
            grads = [torch.randn(p.shape, generator=g) for p in runs[0][0]]
            if t in (3, 5) and dist.get_rank() == 1:
                grads[0][0, 0] = float("nan")
            for ps, opt, sched in runs:
                for p, x in zip(ps, grads, strict=True):
                    p.grad = x.clone()
                opt.step()
                sched.step()
    same = all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0], strict=True))
    counters = [(opt.stats()["skipped_steps"], opt.updates) for _, opt, _ in runs]
    return same, counters


@pytest.mark.parametrize("backend", ["native", "triton"])
def test_capturable_run_eagerly_is_the_default_run(ranks, backend):
    # capturable=True stepped eagerly: on the C (the host's counts and scalars; its counters on the device
    # beside them) and in the Triton stage (the device's): bitwise the default optimizer, two skipped
    # compression steps (in Triton the agreement on the device's) counted the same
    for same, counters in ranks(2).run(_capturable_eager, backend):
        assert same and counters[0] == counters[1] == (2, 5), counters


def _capturable_resume(W):
    import torch.distributed as dist

    from onebit.kernels.backends import use_backend
    from onebit.optimizers import OnebitAdam

    def make(flag: bool, seed: int = 0):
        torch.manual_seed(seed)
        ps = [torch.nn.Parameter(torch.randn(40, 33)), torch.nn.Parameter(torch.randn(75))]
        opt = OnebitAdam(ps, lr=torch.tensor(1e-2), freeze_step=2, bias_correction=True, capturable=flag,
                         bucket_cap_mb=0.002)
        opt._device_agreement = True
        for p in ps:
            p.grad = torch.zeros_like(p)
        return ps, opt

    (pa, a), (pb, b) = make(False), make(True)
    g = torch.Generator().manual_seed(dist.get_rank())
    rec, same = Recorder(), []

    def feed(*ps_list, nan=False):
        grads = [torch.randn(p.shape, generator=g) for p in pa]
        if nan and dist.get_rank() == 0:
            grads[1][3] = float("inf")
        for ps in ps_list:
            for p, x in zip(ps, grads, strict=True):
                p.grad.copy_(x)

    with use_backend("triton"):
        for t in range(6):  # eager, then captured at 4, replayed at 5 with a skip
            feed(pa, pb, nan=t == 5)
            a.step()
            _step_captured(b, rec, t, 4)
        saved = b.state_dict()  # the counters read back; a new capturable optimizer resumes from it
        (pc, c) = make(True, seed=1)
        with torch.no_grad():
            for p, q in zip(pc, pb, strict=True):
                p.copy_(q)
        c.load_state_dict(saved)
        rec2 = Recorder()
        for t in range(6, 11):  # eager, captured again at 8, replayed
            feed(pa, pc)
            a.step()
            _step_captured(c, rec2, t, 8)
            same.append(all(torch.equal(x, y) for x, y in zip(pa, pc, strict=True)))
        sda, sdc = a.state_dict(), c.state_dict()
    moments = all(torch.equal(sda["state"][k]["exp_avg"], sdc["state"][k]["exp_avg"]) for k in range(2))
    return same, moments, (a.updates, a.skipped_steps), (c.updates, c.skipped_steps)


def test_a_capturable_optimizer_resumes_from_its_checkpoint_and_captures_again(ranks):
    # state_dict() after replays (a skip among them) reads the counters back; a new capturable optimizer
    # loads it, steps eagerly (its counters made again from the loaded ones), is captured and replayed:
    # bitwise the default optimizer run straight through
    for same, moments, straight, resumed in ranks(3).run(_capturable_resume, 3):
        assert all(same) and moments, (same, moments)
        assert straight == resumed == (10, 1), (straight, resumed)
