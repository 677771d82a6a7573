"""OnebitAdam's momentum kept as its last 1-bit message between fused compression steps (issue 56):
after a compressed step each bucket's momentum is exactly the decode of the step's gathered message,
so the reducer keeps that message (1/8 byte per element and the scales) instead of the float32
buffer. The run is bitwise the one that keeps the buffer, on 4 ranks, in the native C and the
Triton passes; ``state_dict()`` still holds a float32 ``exp_avg``; a checkpoint from either form
loads and resumes bitwise; an unfused step in between decodes the buffer back."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import compiled_local, fused_steps, resume_point, torch_local

from onebit.kernels import cpu_simd  # noqa: F401  (read by the skip condition)
from onebit.kernels.backends import use_routes
from onebit.memory import bytes_per_parameter
from onebit.optimizers import OnebitAdam

SHAPES = [(37, 5), (9000,), (3,), (64, 17), (5000,)]  # buckets of several tensors, n not a multiple of 16


def _run(backend: str, message: bool, steps: int = 7, plain_at=(), save_at=None, load=None,
         device: str = "cpu"):
    """OnebitAdam on this rank's gradients (the freeze at 2, buckets of about 7,800 elements, two
    groups, a missing gradient at step 3) with the ``message`` route ``message``; the fused steps on
    ``backend`` except at ``plain_at`` (the unfused path). Returns the parameters, the decoded
    momenta, the error buffers, whether the buckets were kept as messages at the end, the state's
    bytes per parameter, and the state_dict saved after step ``save_at``. ``load``: a state_dict
    loaded after step ``save_at`` instead (a resumed run)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    with use_routes(message=message):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s).to(device)) for s in SHAPES]
        groups = [{"params": params[:2], "weight_decay": 0.1},
                  {"params": params[2:], "lr": 3e-3, "betas": (0.8, 0.99)}]
        opt = OnebitAdam(groups, lr=1e-2, freeze_step=2, bucket_cap_mb=0.03, bias_correction=True)
        if not dist.is_initialized():  # one rank's whole compute: the fused steps run
            opt.reducer().allreduce = compiled_local if device == "cpu" else torch_local
        g = torch.Generator().manual_seed(1000 + rank)
        saved = None
        for step in range(steps):
            grads = [None if (step == 3 and i == 2) else torch.randn(p.shape, generator=g).to(device)
                     for i, p in enumerate(params)]
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad
            with fused_steps("plain" if step in plain_at else backend):
                opt.step()
            if step == save_at:
                if load is not None:
                    opt.load_state_dict(load)
                saved = copy.deepcopy(opt.state_dict())
        red = opt.reducer()
        return ([p.detach().cpu() for p in params], [red.decoded(b).cpu() for b in red.buckets],
                [e.cpu() for pair in red.errors() for e in pair],
                all(b.message is not None and b.flat is None for b in red.buckets),
                bytes_per_parameter(opt), saved)


def _assert_same(a, b) -> None:
    for x, y in zip(a[0] + a[1] + a[2], b[0] + b[1] + b[2], strict=True):
        assert torch.equal(x, y)


def _four_ranks_body(backend: str):
    return _run(backend, True), _run(backend, False)


@pytest.mark.parametrize("backend", [
    pytest.param("native", marks=pytest.mark.skipif("not cpu_simd.available()", reason="no C library here")),
    "triton",  # the Triton passes, under the interpreter on CPU tensors
])
def test_the_momentum_kept_as_a_message_is_bitwise_the_float32_run_on_four_ranks(ranks, backend):
    results = ranks(4).run(_four_ranks_body, backend)
    for message, buffer in results:
        _assert_same(message, buffer)
        assert message[3] and not buffer[3]  # kept as messages / as float32 buffers
        # the float32 momentum (4 bytes per element) became its message (1/8 and the scales, which
        # the C passes' run kept already for a skipped step's restore); Triton's passes decode it as
        # they read it too (kernels/fused/stage.py: no scratch buffer), so there the message is new
        saved = buffer[4] - message[4]
        if backend == "native":
            assert saved == 4.0, saved
        else:
            assert 4 - 0.2 <= saved < 4, saved
    for other in results[1:]:  # and every rank holds the same parameters and momenta
        for a, b in zip(other[0][0] + other[0][1], results[0][0][0] + results[0][0][1], strict=True):
            assert torch.equal(a, b)


@pytest.mark.cuda
def test_the_momentum_kept_as_a_message_is_bitwise_the_float32_run_in_cudas_triton_passes():
    # one rank's whole compute on CUDA tensors (the Triton stage's passes decode the message as they
    # read it), an unfused step in between
    message, buffer = (_run("triton", m, plain_at=(4,), device="cuda") for m in (True, False))
    _assert_same(message, buffer)
    assert message[3] and not buffer[3]


@pytest.mark.skipif("not cpu_simd.available()", reason="no C library here")
def test_an_unfused_step_in_between_decodes_the_buffer_back_and_the_run_stays_bitwise():
    # the unfused path reads the reducer's views: the kept messages decode into float32 buffers
    # (the state's exp_avg again), and the next fused step keeps them as messages again
    mixed, buffer = _run("native", True, plain_at=(4,)), _run("native", False, plain_at=(4,))
    _assert_same(mixed, buffer)
    assert mixed[3]


@pytest.mark.skipif("not cpu_simd.available()", reason="no C library here")
@pytest.mark.parametrize(("save_form", "load_form"), [(True, True), (False, True), (True, False)])
def test_a_checkpoint_holds_the_float32_momentum_and_resumes_bitwise(save_form, load_form):
    # state_dict() of a run that keeps messages holds exp_avg as float32, equal to the buffer run's;
    # either form's checkpoint loads into either form and the run goes on bitwise
    full = _run("native", save_form, save_at=4)
    other = _run("native", not save_form, save_at=4)
    saved = full[5]
    for key, entry in saved["state"].items():
        assert entry["exp_avg"].dtype == torch.float32
        assert torch.equal(entry["exp_avg"], other[5]["state"][key]["exp_avg"])
    resumed = _run("native", load_form, save_at=4, load=saved)
    _assert_same(resumed, full)
    assert resumed[3] == load_form


@pytest.mark.skipif("not cpu_simd.available()", reason="no C library here")
def test_a_kept_bucket_leaves_the_state_and_comes_back_when_read():
    # between fused steps the compressed parameters' state has no exp_avg (the bucket is a
    # message); reading the reducer's views puts it back, decoded, as views of a new buffer
    with use_routes(message=True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        opt = OnebitAdam(params, lr=1e-2, freeze_step=1, bucket_cap_mb=0.03)
        opt.reducer().allreduce = compiled_local
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape)
            with fused_steps("native"):
                opt.step()
        red = opt.reducer()
        assert all(b.flat is None for b in red.buckets)
        assert all("exp_avg" not in opt.state[p] and "exp_avg_sq" in opt.state[p] for p in params)
        decoded = [red.decoded(b).clone() for b in red.buckets]
        views = red.views  # decodes every bucket back
        assert all(b.message is None and b.flat is not None for b in red.buckets)
        for p, v in zip(params, views, strict=True):
            assert opt.state[p]["exp_avg"] is v
        for b, d in zip(red.buckets, decoded, strict=True):
            assert torch.equal(b.flat, d)


def _nonfinite(message: bool):
    """OnebitAdam without the check (``nonfinite=None``), one fused step whose gradient holds an
    inf: every scale is non-finite, so the worker error must not be updated."""
    with use_routes(message=message):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        opt = OnebitAdam(params, lr=1e-2, freeze_step=1, bucket_cap_mb=0.03, nonfinite=None)
        opt.reducer().allreduce = compiled_local
        g = torch.Generator().manual_seed(3)
        for step in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            if step == 3:
                errors = [we.clone() for we, _ in opt.reducer().errors()]
                params[1].grad[17] = float("inf")
            with fused_steps("native"):
                opt.step()
        red = opt.reducer()
        (k,) = [k for k, b in enumerate(red.buckets) if 1 in b.indices]  # the inf's bucket
        return errors[k], red.errors()[k][0].clone()


@pytest.mark.skipif("not cpu_simd.available()", reason="no C library here")
@pytest.mark.parametrize("message", [False, True])
def test_a_non_finite_scale_leaves_the_worker_error_untouched(message):
    # the worker pass writes no error in either form (with a kept message the decompress pass folds
    # the worker's u again): where the scales are not finite the error stays as it was, bitwise
    before, after = _nonfinite(message)
    assert torch.equal(before, after)


# -- the unfused compressed steps (the plain backend's OnebitAdam, OnebitLamb on every device) ----------
LAMB_SHAPES = [(37, 9), (301,), (3,), (20, 17)]  # n = 981: the padding to 8 W is data (flat_padding)


def _unfused(name: str, keep: bool, steps: int = 7, save_at=None, load=None):
    """OnebitAdam through its unfused step (``fused_steps("plain")``) or OnebitLamb, on this rank's
    gradients past the freeze (at 2), with the ``message`` route ``keep``. Returns the parameters, the
    buckets' values with their padding (decoded where kept), the error buffers, whether every bucket
    was kept as a message at the end, the bytes per parameter, the state_dict after ``save_at``
    (``load``: loaded there instead)."""
    import torch.distributed as dist

    from onebit import OnebitLamb

    cls = OnebitAdam if name == "adam" else OnebitLamb
    shapes = SHAPES if name == "adam" else LAMB_SHAPES
    with use_routes(message=keep):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "lr": 3e-3}]
        kw = {"bucket_cap_mb": 0.03} if name == "adam" else {}
        opt = cls(groups, lr=1e-2, freeze_step=2, **kw)
        g = torch.Generator().manual_seed(1000 + dist.get_rank())
        saved = None
        for step in range(steps):
            for i, p in enumerate(params):
                p.grad = None if (step == 3 and i == 2) else torch.randn(p.shape, generator=g)
            with fused_steps("plain"):
                opt.step()
            if step == save_at:
                if load is not None:
                    opt.load_state_dict(load)
                saved = copy.deepcopy(opt.state_dict())
        red = opt.reducer()
        values = [torch.cat([red.decoded(b), red.flat_tail(b)]).clone() for b in red.buckets]
        errors = [e.clone() for pair in red.errors() for e in pair]
        return ([p.detach().clone() for p in params], values, errors,
                all(b.message is not None and b.flat is None for b in red.buckets), bytes_per_parameter(opt),
                saved)


def _unfused_body(name: str):
    return _unfused(name, True), _unfused(name, False)


@pytest.mark.parametrize(("name", "W"), [("adam", 4), ("lamb", 4), ("lamb", 3)])
def test_the_unfused_steps_keep_the_momentum_as_a_message_bitwise_the_float32_run(ranks, name, W):
    # the plain backend's OnebitAdam step and OnebitLamb's (whose padding is data, compressed again:
    # decoded from the message too) keep each bucket as its call's gathered message; the run is bitwise
    # the one that keeps the float32 buffers, on every rank, and the state loses the buffer's 4 bytes
    results = ranks(W).run(_unfused_body, name)
    for message, buffer in results:
        _assert_same(message, buffer)
        assert message[3] and not buffer[3]
        assert 3.8 <= buffer[4] - message[4] <= 4.0, (buffer[4], message[4])
    for other in results[1:]:
        for a, b in zip(other[0][0] + other[0][1], results[0][0][0] + results[0][0][1], strict=True):
            assert torch.equal(a, b)


def _unfused_checkpoint_body(name: str):
    full = _unfused(name, True, save_at=4)
    other = _unfused(name, False, save_at=4)
    # (a copy each: as torch's optimizers, a loaded state's tensors may become the optimizer's own)
    resumed = [_unfused(name, form, save_at=4, load=copy.deepcopy(full[5])) for form in (True, False)]
    return full, other, resumed


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_an_unfused_runs_checkpoint_holds_the_float32_momentum_and_resumes_bitwise(ranks, name):
    for full, other, resumed in ranks(2).run(_unfused_checkpoint_body, name):
        for key, entry in full[5]["state"].items():
            assert entry["exp_avg"].dtype == torch.float32
            assert torch.equal(entry["exp_avg"], other[5]["state"][key]["exp_avg"])
        for a, b in zip(full[5]["onebit"]["flat_tails"], other[5]["onebit"]["flat_tails"], strict=True):
            assert torch.equal(a, b)  # the padding's data (OnebitLamb), decoded from the message
        for run in resumed:
            _assert_same(run, full)


# -- ZeroOneAdam at rest after a synchronisation: its momentum as the sync's messages ---------------------
def _zoa(backend: str | None, keep: bool, steps: int = 12, save_at=None, load=None):
    """ZeroOneAdam past its variance freeze (at 3) with the local-step interval doubling every 2 steps
    up to 4 (syncs at 4, 5, 6, 8, 12: rests after them, local steps from rests), two groups, on
    ``backend``'s fused steps (None: the default), the ``message`` route ``keep``. Returns the parameters,
    the momenta and sync_params as the next step reads them, the errors, whether it ended at rest,
    the bytes per parameter at the end, the state_dict after ``save_at`` (``load``: loaded there)."""
    import torch.distributed as dist

    from onebit import ZeroOneAdam

    with use_routes(message=keep):
        torch.manual_seed(0)
        # a tensor above cpu_fused.MIN_NUMEL: its momentum made again by the C pass (the others: torch ops);
        # not in Triton's interpreter (a minute on 3 ranks), where every tensor takes the kernels' path
        big = [] if backend == "triton" else [(300, 230)]
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES + big]
        groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "lr": 3e-3}]
        opt = ZeroOneAdam(groups, lr=1e-2, var_freeze_step=3, bucket_cap_mb=0.03, var_update_scaler=1,
                          local_step_scaler=2, local_step_clipper=4)
        g = torch.Generator().manual_seed(1000 + dist.get_rank())
        saved = None
        for step in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            with fused_steps(backend):
                opt.step()
            if step == save_at:
                saved = resume_point(opt, params, load)
        resting = opt._kept is not None
        size = bytes_per_parameter(opt)
        opt._wake()
        state = [opt.state[p][k].clone() for p in params for k in ("exp_avg", "sync_params")]
        errors = [e.clone() for pair in opt.reducer().errors() for e in pair]
        return [p.detach().clone() for p in params], state, errors, resting, size, saved


def _zoa_body(backend):
    return _zoa(backend, True), _zoa(backend, False)


@pytest.mark.parametrize(("backend", "W"), [
    pytest.param("native", 4, marks=pytest.mark.skipif("not cpu_simd.available()", reason="no C library")),
    ("plain", 4), ("plain", 3), ("triton", 3),
])
def test_zero_one_adam_at_rest_is_bitwise_the_run_that_holds_its_state(ranks, backend, W):
    # after each synchronisation the momentum is (mean d) / nl of the sync's message, sync_params is p
    # and the accumulator zero: kept as the messages (1/8 byte and the scales) and made again by the next
    # step, local or synchronising; the run is bitwise the one that holds them, on every rank
    results = ranks(W).run(_zoa_body, backend)
    for rest, held in results:
        _assert_same(rest, held)
        assert rest[3] and not held[3]  # the last step (12) synchronised
        # exp_avg and sync_params (the accumulator is freed between phase 2's steps in both runs)
        assert 7.8 <= held[4] - rest[4] <= 8.001, (held[4], rest[4])
    for other in results[1:]:
        for a, b in zip(other[0][0] + other[0][1], results[0][0][0] + results[0][0][1], strict=True):
            assert torch.equal(a, b)


def _zoa_checkpoint_body():
    # saved at rest (after the sync of step 6) and between syncs (step 7: a local step from a rest)
    out = []
    for save_at in (5, 6):
        full = _zoa(None, True, save_at=save_at)
        entries = full[5]["state"].values()
        assert entries and all("exp_avg" in e and "sync_params" in e for e in entries)
        resumed = [_zoa(None, form, save_at=save_at, load=full[5]) for form in (True, False)]
        out.append((full, resumed))
    return out


def test_zero_one_adams_checkpoint_at_rest_holds_its_state_and_resumes_bitwise(ranks):
    for runs in ranks(2).run(_zoa_checkpoint_body):
        for full, resumed in runs:
            for run in resumed:
                _assert_same(run, full)
