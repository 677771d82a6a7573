"""CUDA: Triton kernels against the torch path and the reference; NCCL at world size 1.

Skipped without a CUDA device (conftest.py); run them on a GPU machine and record the result.
"""

from __future__ import annotations

import datetime
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
from helpers import assert_rel, simulate_allreduce

from onebit.collectives import local_compressed_allreduce
from onebit.kernels import Layout, message_bits, message_scales, padded_numel, worker_compress
from onebit.kernels.reference import reference_allreduce

pytestmark = pytest.mark.cuda
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(W, n, N, dtype, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    xs = [torch.randn(n, generator=g, device=device).to(dtype) for _ in range(W)]
    we = [torch.randn(N, generator=g, device=device) * 0.1 for _ in range(W)]
    se = [torch.randn(N // W, generator=g, device=device) * 0.1 for _ in range(W)]
    return xs, we, se


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("W", [1, 4, 8])
@pytest.mark.parametrize("n", [1, 1000, (1 << 20) + 3, 1 << 24])
def test_triton_matches_torch_path_on_cuda(n, W, dtype):
    N = padded_numel(n, W)
    layout = Layout(N, W)
    runs = {}
    for backend in ("triton", "torch"):
        xs, we, se = _inputs(W, n, N, dtype, 1, "cuda")
        msgs = [worker_compress(x, e.clone(), W, backend=backend) for x, e in zip(xs, we, strict=True)]
        outs = simulate_allreduce(xs, we, se, backend=backend)
        runs[backend] = (msgs, outs, we, se)
    (m_a, o_a, we_a, se_a), (m_b, o_b, we_b, se_b) = runs["triton"], runs["torch"]
    for a, b in zip(m_a, m_b, strict=True):
        assert torch.equal(message_bits(a, layout), message_bits(b, layout))
        torch.testing.assert_close(message_scales(a, layout), message_scales(b, layout))
    for a, b in zip(o_a + we_a + se_a, o_b + we_b + se_b, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("W", [1, 4, 5])
@pytest.mark.parametrize("block", [8, 64, 4096])
@pytest.mark.parametrize("n", [1000, (1 << 20) + 3, 1 << 24])
def test_triton_blocks_match_torch_path_on_cuda(n, block, W, dtype):
    N = padded_numel(n, W, block)
    layout = Layout(N, W, block)
    runs = {}
    for backend in ("triton", "torch"):
        xs, we, se = _inputs(W, n, N, dtype, 1, "cuda")
        msgs = [worker_compress(x, e.clone(), W, backend=backend, block=block)
                for x, e in zip(xs, we, strict=True)]
        outs = local_compressed_allreduce([x.clone() for x in xs], we, se, backend=backend, block=block)
        runs[backend] = (msgs, outs, we, se)
    (m_a, o_a, we_a, se_a), (m_b, o_b, we_b, se_b) = runs["triton"], runs["torch"]
    for a, b in zip(m_a, m_b, strict=True):
        assert torch.equal(message_bits(a, layout), message_bits(b, layout))
        torch.testing.assert_close(message_scales(a, layout), message_scales(b, layout), rtol=2e-7, atol=0)
    for a, b in zip(o_a + we_a + se_a, o_b + we_b + se_b, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("W", [2, 5])
def test_cuda_chain_matches_reference(W):
    n = 100_003
    N = padded_numel(n, W)
    we = [torch.zeros(N, device="cuda") for _ in range(W)]
    se = [torch.zeros(N // W, device="cuda") for _ in range(W)]
    rwe = [torch.zeros(N, dtype=torch.float64) for _ in range(W)]
    rse = [torch.zeros(N // W, dtype=torch.float64) for _ in range(W)]
    g = torch.Generator().manual_seed(W)
    for _ in range(10):
        xs = [torch.randn(n, generator=g) for _ in range(W)]
        outs = simulate_allreduce([x.cuda() for x in xs], we, se)
        ref = reference_allreduce(xs, rwe, rse)
        rwe, rse = ref.worker_errors, ref.server_errors
        assert all(torch.equal(o, outs[0]) for o in outs)
        assert_rel(outs[0].cpu(), ref.output, 1e-6, "output")
    for a, b, s in zip(we, rwe, ref.worker_scales.tolist(), strict=True):
        assert_rel(a.cpu(), b, 1e-6, "worker_error", norm=s * N**0.5)


def _nccl_single(rank, init_file, results):
    import torch.distributed as dist

    from onebit.collectives import compressed_allreduce
    from onebit.collectives.allreduce import _compressed_allreduce

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        x = torch.randn(1000, device="cuda")
        x0 = x.clone()
        we, se = torch.zeros(1008, device="cuda"), torch.zeros(1008, device="cuda")
        compressed_allreduce(x, we, se, check=True)  # W = 1: identity, check goes over NCCL
        identity = torch.equal(x, x0) and not we.any() and not se.any()
        _compressed_allreduce(x, we, se, None, 1)  # the forced local compute
        ref = reference_allreduce([x0.cpu()], [torch.zeros(1008)], [torch.zeros(1008)],
                                  compress_single_rank=True)
        results.put((identity, float((x.cpu().double() - ref.output).norm() / ref.output.norm())))
    finally:
        dist.destroy_process_group()


def test_nccl_world_size_one():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "rdv")
    p = ctx.Process(target=_nccl_single, args=(0, init_file, results))
    p.start()
    identity, rel = results.get(timeout=120)
    p.join(timeout=60)
    assert identity and rel < 1e-6


@pytest.mark.parametrize("n", [(1 << 22) + 3, 1 << 22])
def test_last_program_finalisation_is_deterministic_on_cuda(n):
    """The scale is written by whichever program arrives last (a ticket per stream): 200
    back-to-back launches on many SMs, on the current stream and on a second one, give bitwise
    the same message and error every time, close to the torch path's; chained server
    reductions likewise."""
    W = 4
    N = padded_numel(n, W)
    layout = Layout(N, W)
    x = torch.randn(n, device="cuda")
    e = torch.randn(N, device="cuda") * 0.1
    torch_e = e.clone()
    torch_msg = worker_compress(x, torch_e, W, backend="torch")
    first_e = e.clone()
    first = worker_compress(x, first_e, W)
    assert torch.equal(message_bits(first, layout), message_bits(torch_msg, layout))
    torch.testing.assert_close(message_scales(first, layout), message_scales(torch_msg, layout))
    torch.testing.assert_close(first_e, torch_e)
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            runs = []
            for _ in range(200):
                e2 = e.clone()
                runs.append((worker_compress(x, e2, W), e2))
        torch.cuda.synchronize()
        for msg, err in runs:
            assert torch.equal(msg, first) and torch.equal(err, first_e)
    xs, we, se = _inputs(W, n, N, torch.float32, 3, "cuda")
    outs = simulate_allreduce(xs, [t.clone() for t in we], [t.clone() for t in se])
    for _ in range(20):
        again = simulate_allreduce(xs, [t.clone() for t in we], [t.clone() for t in se])
        assert all(torch.equal(a, b) for a, b in zip(outs, again, strict=True))


def test_call_timer_uses_cuda_events_resolved_when_read():
    from onebit.collectives.telemetry import CallTimer
    from onebit.collectives.wire import Traffic

    counter = Traffic()
    timer = CallTimer(torch.device("cuda"), counter)
    x = torch.randn(4096, 4096, device="cuda")
    with timer.stage("codec"):
        for _ in range(10):
            x = x @ x / 64
    assert counter.codec_seconds == 0 and len(counter._pending) == 1  # no host synchronisation yet
    counter.resolve()
    assert counter.codec_seconds > 0 and counter._pending == []


def test_a_counter_never_read_holds_a_bounded_number_of_events():
    """Issue 57's leak: every timed stage on a GPU records events into the process-wide counter (6
    per compressed call); one that nothing reads folds in the completed ones once more than
    PENDING_BOUND wait (no host synchronisation): 300 two-stage calls (600 events) leave fewer than
    2 PENDING_BOUND unread."""
    from onebit.collectives import traffic
    from onebit.collectives.telemetry import CallTimer
    from onebit.collectives.wire import PENDING_BOUND

    x = torch.randn(1 << 16, device="cuda")
    traffic.reset()
    for _ in range(300):
        timer = CallTimer(torch.device("cuda"))
        with timer.stage("codec"):
            x = x * 1.0001
        with timer.stage("comm", follows=True):
            x = x + 0.0
    assert len(traffic._pending) < 2 * PENDING_BOUND, len(traffic._pending)
    assert traffic.codec_seconds > 0  # the completed ones folded in
    traffic.resolve()
    assert traffic._pending == [] and traffic.comm_seconds > 0


def test_call_timer_chains_a_stage_that_follows_another():
    """``follows=True``: the stage starts at the previous stage's end event (one event fewer);
    the stream is the one current when the timer was made."""
    from onebit.collectives.telemetry import CallTimer
    from onebit.collectives.wire import Traffic

    counter = Traffic()
    timer = CallTimer(torch.device("cuda"), counter)
    x = torch.randn(2048, 2048, device="cuda")
    with timer.stage("codec"):
        x = x @ x / 64
    with timer.stage("comm", follows=True):
        x = x @ x / 64
    (_, s1, e1), (_, s2, e2) = counter._pending
    assert s2 is e1 and s1 is not e1 and e2 is not e1
    counter.resolve()
    assert counter.codec_seconds > 0 and counter.comm_seconds > 0


def test_a_fused_table_refills_without_a_host_synchronisation():
    # issue 57: the scalars change every step with a learning-rate schedule (and the addresses when a
    # gradient is made anew); a copy from pageable memory waits for the device, one from pinned memory not
    from onebit.kernels.fused.table import Table

    device = torch.device("cuda")
    xs = [torch.randn(n, device=device) for n in (5, 7)]
    table = Table([0, 5], [5, 7], ("grad", "param"), ("lr", "b1"), device)
    table.fill({"grad": xs, "param": xs}, [(1e-3, 0.9), (1e-3, 0.9)])
    torch.cuda.synchronize()
    ys = [torch.randn(n, device=device) for n in (5, 7)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):  # a schedule: new scalars every step, new gradient addresses once
            table.fill({"grad": ys if step else xs, "param": xs}, [(1e-3 / (step + 2), 0.9)] * 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert table.scal[:, 0].tolist() == [torch.tensor(1e-3 / 4).item()] * 2
    assert table.addr[0].tolist() == [y.data_ptr() for y in ys]


def _one_rank(tensor, worker_error, server_error, group=None):
    """An optimizer reducer's collective as a one-rank group's whole compute (the collectives as copies):
    the fused passes run as on any rank."""
    from onebit.collectives.allreduce import LocalCopies, _compressed_allreduce

    _compressed_allreduce(tensor, worker_error, server_error, None, 1, None, LocalCopies(1))
    return tensor


_one_rank.local_compute = 1


def test_a_steady_compressed_step_synchronises_the_same_whatever_the_buckets():
    # issue 57: OnebitAdam's compression stage on the fused Triton path (one rank's whole compute, the
    # collectives as copies): host synchronisations per steady step, with 1 and with 8 buckets, counted by
    # torch's sync debug mode: none from the second compressed step on (the agreement on the device,
    # optimizers/_device_agreement.py; the tables from pinned memory; the server's factor in Python); the
    # first compressed step agrees on the host (one at W = 1).
    import warnings

    from onebit.optimizers import OnebitAdam

    counts = {}
    for cap in (100.0, 0.3):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(256, 256, device="cuda")) for _ in range(8)]
        opt = OnebitAdam(params, lr=1e-3, freeze_step=2, bucket_cap_mb=cap)
        opt.reducer().allreduce = _one_rank
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (t + 1))  # new scalars every step
        seen = []
        for _ in range(6):
            for p in params:
                p.grad = torch.randn_like(p)
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    opt.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            sched.step()
            seen.append(sum("synchroniz" in str(w.message) for w in said))
        counts[len(opt.reducer().buckets)] = seen
    (one, many), (a, b) = sorted(counts), (counts[min(counts)], counts[max(counts)])
    assert one == 1 and many >= 4, counts
    assert a[2] == b[2] == 1 and a[3:] == b[3:] == [0, 0, 0], counts


def test_the_agreement_on_the_device_skips_bitwise_as_the_hosts():
    # a NaN gradient at a steady compression step: the same parameters after 8 steps either way
    from onebit.optimizers import OnebitAdam

    out = {}
    for on_device in (True, False):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in ((300, 200), (77,), (1000,))]
        opt = OnebitAdam(params, lr=1e-3, freeze_step=2, bucket_cap_mb=0.2, bias_correction=True)
        opt.reducer().allreduce = _one_rank
        opt._device_agreement = on_device
        g = torch.Generator(device="cuda").manual_seed(1)
        for t in range(8):
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=g)
            if t == 5:
                params[1].grad[3] = float("nan")
            opt.step()
        out[on_device] = ([p.detach().clone() for p in params], opt.updates, opt.stats()["skipped_steps"])
    for a, b in zip(out[True][0], out[False][0], strict=True):
        assert torch.equal(a, b)
    assert out[True][1:] == out[False][1:] == (7, 1)


def test_the_stage_is_bitwise_the_per_bucket_passes_on_cuda():
    # issue 57: OnebitAdam's compression step over every bucket in one launch per pass
    # (kernels/fused/stage.py) against the per-bucket launches (the stage route off), bfloat16 and float32
    # errors, odd sizes, 5+ buckets; and the launches per steady step, the same for 1 bucket and many
    from onebit.kernels.backends import use_routes
    from onebit.kernels.triton_kernels import Launch
    from onebit.optimizers import OnebitAdam

    shapes = ((300, 200), (77,), (1000,), (3, 5), (40000,))

    def run(stage: bool, error_dtype, cap: float):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
        opt = OnebitAdam(params, lr=1e-3, freeze_step=2, bucket_cap_mb=cap, bias_correction=True,
                         weight_decay=0.01, error_dtype=error_dtype)
        opt.reducer().allreduce = _one_rank
        g = torch.Generator(device="cuda").manual_seed(1)
        names, calls = [], Launch.__call__

        def counted(self):
            names.append(self.name)
            calls(self)

        with use_routes(stage=stage):
            for _ in range(7):
                for p in params:
                    p.grad = torch.randn(p.shape, device="cuda", generator=g)
                names.clear()
                Launch.__call__ = counted
                try:
                    opt.step()
                finally:
                    Launch.__call__ = calls
        errors = [e.clone() for pair in opt.reducer().errors() for e in pair]
        return [p.detach().clone() for p in params], errors, len(opt.reducer().buckets), list(names)

    for error_dtype in (torch.bfloat16, torch.float32):
        staged, alone = run(True, error_dtype, 0.05), run(False, error_dtype, 0.05)
        assert staged[2] >= 5
        for a, b in zip(staged[0] + staged[1], alone[0] + alone[1], strict=True):
            assert torch.equal(a, b)
        one = run(True, error_dtype, 100.0)
        assert one[2] == 1 and one[3] == staged[3] and len(staged[3]) == 5, (one[3], staged[3])


def test_zero_one_adams_steady_local_steps_synchronise_nothing():
    # issue 57: ZeroOneAdam's phase-2 steps but its first agree on the device, local steps and
    # synchronisations (loop indices 5-7, 9, 11) alike (one rank's whole compute, the collectives as
    # copies): no host synchronisation in them under torch's sync debug mode, the previous step's flag
    # having arrived (the test waits for the device between steps, as a training loop's backward gives it
    # time to); a NaN at one of them skips it bitwise as the host does
    import warnings

    from onebit.optimizers import ZeroOneAdam

    out = {}
    for on_device in (True, False):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in ((300, 200), (77,), (1000,))]
        opt = ZeroOneAdam(params, lr=1e-3, var_freeze_step=4, var_update_scaler=1, local_step_scaler=3,
                          local_step_clipper=4, bucket_cap_mb=0.2)
        opt.reducer().allreduce = _one_rank
        opt._device_agreement = on_device
        g = torch.Generator(device="cuda").manual_seed(1)
        syncs, agreed = [], []
        for t in range(18):
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=g)
            if t == 13:
                params[1].grad[3] = float("nan")
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    opt.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs.append(sum("synchroniz" in str(w.message) for w in said))
            agreed.append(bool(opt._pending_agreements))
        out[on_device] = ([p.detach().clone() for p in params], opt.updates, opt.stats()["skipped_steps"])
        if on_device:
            steady = [s for s, a in zip(syncs, agreed, strict=True) if a]
            assert len(steady) >= 12 and agreed[13] and steady == [0] * len(steady), (syncs, agreed)
            assert all(agreed[t] for t in (5, 6, 7, 9, 11)), agreed
    for a, b in zip(out[True][0], out[False][0], strict=True):
        assert torch.equal(a, b)
    assert out[True][1:] == out[False][1:] == (17, 1)


@pytest.mark.parametrize("name", ["adam", "zero_one"])
def test_the_warm_up_and_phase_one_agreed_on_the_device_synchronise_nothing(name):
    # issue 57: OnebitAdam's warm-up steps (but its last: freeze_step=12) and ZeroOneAdam's phase 1
    # (var_freeze_step=12: its compressed steps and its variance steps 1, 2, 4, 8, their floors on the device)
    # agree on the device: no host synchronisation in them under torch's sync debug mode (the previous flag
    # having arrived); a NaN at one of them skips it bitwise as the host does
    import warnings

    from onebit.optimizers import OnebitAdam, ZeroOneAdam

    out = {}
    for on_device in (True, False):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in ((300, 200), (77,), (1000,))]
        if name == "adam":
            opt = OnebitAdam(params, lr=1e-3, freeze_step=12, bias_correction=True, bucket_cap_mb=0.2)
        else:
            opt = ZeroOneAdam(params, lr=1e-3, var_freeze_step=12, var_update_scaler=1, bucket_cap_mb=0.2)
        opt.reducer().allreduce = _one_rank
        opt._device_agreement = on_device
        g = torch.Generator(device="cuda").manual_seed(1)
        syncs, agreed = [], []
        for t in range(10):
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=g)
            if t == 5:
                params[1].grad[3] = float("nan")
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    opt.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs.append(sum("synchroniz" in str(w.message) for w in said))
            agreed.append(bool(opt._pending_agreements))
        out[on_device] = ([p.detach().clone() for p in params], opt.updates, opt.stats()["skipped_steps"])
        if on_device:
            steady = [s for t, (s, a) in enumerate(zip(syncs, agreed, strict=True)) if a and t]
            assert len(steady) == 9 and agreed[5] and steady == [0] * len(steady), (syncs, agreed)
    for a, b in zip(out[True][0], out[False][0], strict=True):
        assert torch.equal(a, b)
    assert out[True][1:] == out[False][1:] == (9, 1)


@pytest.mark.parametrize("n", [1, 4097, (1 << 22) + 5])
def test_the_clip_sketch_on_the_gpu_is_the_plain_one_to_rounding(n):
    # the hooks' clip sketch (kernels/sketch.py): one Triton launch of atomic adds on a CUDA tensor, the same
    # index as the plain path, the float32 sums in no fixed order (to rounding), no host synchronisation
    from onebit.kernels.backends import use_backend
    from onebit.kernels.sketch import SketchHash, add_sums_

    x = torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n))
    h = SketchHash(n, 1024, 0xDEADBEEF)
    got = torch.zeros(2048, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        add_sums_(got, x, h, "clip")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with use_backend("plain"):
        want = add_sums_(torch.zeros(2048, device="cuda"), x, h, "clip")
    scale = float(x.abs().max()) * max(1.0, (n / 1024) ** 0.5)
    assert float((got - want).abs().max()) <= 1e-5 * scale


def test_a_captured_onebit_adam_step_replays_bitwise_the_eager_one():
    # issue 57: OnebitAdam(capturable=True)'s compression step captured in a CUDA graph (one rank's whole
    # compute, the collectives as copies) and replayed with new gradients, the bias correction, a tensor
    # lr that ExponentialLR writes into, and a NaN gradient at one replay (skipped on the device): bitwise
    # its eager twin (capturable too; its steady steps synchronise nothing under torch's sync debug
    # mode), within float32 rounding of the default optimizer (the device's pow), the counters read back
    # by state_dict() the eager ones
    from onebit.optimizers import OnebitAdam

    shapes = ((300, 200), (77,), (1000,), (3, 5))

    def make(capturable: bool):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
        opt = OnebitAdam(params, lr=torch.tensor(1e-3, device="cuda"), freeze_step=2, bucket_cap_mb=0.05,
                         bias_correction=True, weight_decay=0.01, capturable=capturable)
        opt.reducer().allreduce = _one_rank
        for p in params:
            p.grad = torch.zeros_like(p)
        return params, opt, torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)

    runs = {name: make(name != "default") for name in ("default", "eager", "graph")}
    g = torch.Generator(device="cuda").manual_seed(1)
    graph = torch.cuda.CUDAGraph()
    for t in range(10):
        grads = [torch.randn(p.shape, device="cuda", generator=g) for p in runs["default"][0]]
        if t == 7:
            grads[2][5] = float("nan")
        for params, _, _ in runs.values():
            for p, x in zip(params, grads, strict=True):
                p.grad.copy_(x)
        runs["default"][1].step()
        if t >= 4:  # a steady capturable step, eager: no host synchronisation at all (issue 57)
            torch.cuda.set_sync_debug_mode("error")
        try:
            runs["eager"][1].step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if t < 4:
            runs["graph"][1].step()
        else:
            if t == 4:
                with torch.cuda.graph(graph):
                    runs["graph"][1].step()
            graph.replay()
        for _, _, sched in runs.values():
            sched.step()
        torch.cuda.synchronize()
        for a, b, c in zip(*(r[0] for r in runs.values()), strict=True):
            assert torch.equal(b, c), t
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    counters = [(opt.state_dict(), opt.updates, opt.skipped_steps)[1:] for _, opt, _ in runs.values()]
    assert counters[1] == counters[2] == (9, 1), counters
