"""``error_dtype=torch.bfloat16``: the error buffers of the 1-bit optimizers, the DDP and FSDP hooks and
DiLoCo in half the bytes, stored with stochastic rounding (docs/ALGORITHMS.md 12). On 3 gloo ranks, in
each backend: the buffers stay bfloat16, the replicas stay bitwise identical, the run follows the
float32 errors' run to the rounding, checkpoints of either dtype load and resume; the state shrinks
by 2 + 2/W bytes per parameter."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import fused_steps

from onebit.kernels import cpu_simd  # noqa: F401  (read by the skip conditions)
from onebit.memory import bytes_per_parameter
from onebit.optimizers import OnebitAdam, OnebitLamb, ZeroOneAdam

SHAPES = [(37, 5), (9000,), (3,), (64, 17), (5000,)]  # n not a multiple of 16; several buckets
OPTIMIZERS = {
    "adam": lambda ps, dt: OnebitAdam(ps, lr=1e-2, freeze_step=2, bucket_cap_mb=0.03, error_dtype=dt),
    "lamb": lambda ps, dt: OnebitLamb(ps, lr=1e-2, freeze_step=2, error_dtype=dt),
    # phase 1's compressed steps (the variance at t = 1, 2, 4: compressed gradients at 3, 5, 6), then
    # phase 2's local steps and synchronisations
    "zoa": lambda ps, dt: ZeroOneAdam(ps, lr=1e-2, var_freeze_step=6, var_update_scaler=2,
                                      local_step_scaler=2, bucket_cap_mb=0.03, error_dtype=dt),
}
BACKENDS = [
    pytest.param("native", marks=pytest.mark.skipif("not cpu_simd.available()", reason="no C library")),
    "plain",
    "triton",  # the Triton passes and codec, under the interpreter on CPU tensors
]


def _run(name: str, dtype: torch.dtype, backend: str, steps: int = 10, save_at=None, load=None):
    """``name``'s optimizer with ``error_dtype=dtype`` on this rank's gradients, the fused steps (and
    the codec) on ``backend``; the parameters, the error buffers, the bytes per parameter and the
    state_dict saved after step ``save_at`` (``load``: loaded then instead: a resumed run)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = OPTIMIZERS[name](params, dtype)
    g = torch.Generator().manual_seed(1000 + rank)
    saved = None
    with fused_steps(None if backend == "native" else backend):
        for step in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
            if step == save_at:
                if load is not None:
                    opt.load_state_dict(load)
                saved = copy.deepcopy(opt.state_dict())
    errors = [e.clone() for pair in opt.reducer().errors() for e in pair]
    return [p.detach().clone() for p in params], errors, bytes_per_parameter(opt), saved


def _body(name: str, backend: str):
    return _run(name, torch.bfloat16, backend), _run(name, torch.float32, backend)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bfloat16_errors_follow_the_float32_run_and_replicas_agree(ranks, name, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    W = 3
    results = ranks(W).run(_body, name, backend)
    for bf, f32 in results:
        assert all(e.dtype == torch.bfloat16 for e in bf[1]) and all(e.dtype == torch.float32 for e in f32[1])
        assert all(torch.isfinite(e).all() for e in bf[1])
        assert any(bool(e.ne(0).any()) for e in bf[1])  # the errors were used
        # the same run to the rounding of the errors: close, not equal
        moved = [_rel(a, b) for a, b in zip(bf[0], f32[0], strict=True)]
        assert max(moved) < 2e-2, moved
        assert any(not torch.equal(a, b) for a, b in zip(bf[0], f32[0], strict=True))
        # errors of the same size: the rounding does not grow them
        for a, b in zip(bf[1], f32[1], strict=True):
            assert float(a.float().norm()) < 1.5 * float(b.norm()) + 1e-6
        # half the error bytes: 2 + 2/W per parameter (with the padding's share)
        saved = f32[2] - bf[2]
        assert 2 + 2 / W <= saved < 2 + 2 / W + 0.05, saved
    if name != "zoa":  # 0/1 Adam's replicas differ between synchronisations by design
        for other in results[1:]:
            for a, b in zip(other[0][0], results[0][0][0], strict=True):
                assert torch.equal(a, b)


def _resume_body(name: str):
    full = _run(name, torch.bfloat16, "native" if cpu_simd.available() else "plain", save_at=3)
    resumed = _run(name, torch.bfloat16, "native" if cpu_simd.available() else "plain", save_at=3,
                   load=full[3])
    f32 = _run(name, torch.float32, "plain", save_at=3)
    from_f32 = _run(name, torch.bfloat16, "plain", save_at=3, load=f32[3])
    errors = full[3]["onebit"]["worker_errors"] + full[3]["onebit"]["server_errors"]
    return (all(torch.equal(a, b) for a, b in zip(full[0] + full[1], resumed[0] + resumed[1], strict=True)),
            all(e.dtype == torch.bfloat16 for e in errors),
            max(_rel(a, b) for a, b in zip(from_f32[0], f32[0], strict=True)),
            all(e.dtype == torch.bfloat16 for e in from_f32[1]))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_checkpoints_resume_bitwise_and_float32_checkpoints_load(ranks, name):
    # a bfloat16 run's checkpoint holds its bfloat16 errors and resumes bitwise; a float32 run's
    # checkpoint loads into a bfloat16 optimizer (its errors rounded once) and goes on close to it
    for same, saved_bf16, rel, stays in ranks(2).run(_resume_body, name):
        assert same and saved_bf16 and stays
        assert rel < 2e-2, rel


def test_error_dtype_is_checked():
    p = [torch.nn.Parameter(torch.zeros(3))]
    for make in OPTIMIZERS.values():
        with pytest.raises(ValueError, match="error_dtype: expected torch.float32 or torch.bfloat16"):
            make(p, torch.float16)
    from onebit.collectives import OnebitCompressHookState

    with pytest.raises(TypeError, match="error_dtype"):
        OnebitCompressHookState(error_dtype="bf16")


def _hook_body(dtype: torch.dtype):
    from torch.nn.parallel import DistributedDataParallel

    from onebit.collectives import OnebitCompressHookState, onebit_compress_hook

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = OnebitCompressHookState(optimizer=opt, freeze_step=3, error_dtype=dtype)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)
    ddp.register_comm_hook(state, onebit_compress_hook)
    for step in range(8):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    moved = [p.detach() - p0 for p, p0 in zip(model.parameters(), start, strict=True)]
    return moved, [e for pair in state.errors.values() for e in pair]


def _hooks_body():
    return _hook_body(torch.bfloat16), _hook_body(torch.float32)


def test_ddp_hook_with_bfloat16_errors(ranks):
    results = ranks(3).run(_hooks_body)
    for bf, f32 in results:
        assert bf[1] and all(e.dtype == torch.bfloat16 for e in bf[1])
        # the parameters' movement over the run, to within a tenth of it (1-bit signs flip where the
        # rounding moves an error across zero: the runs part like two seeds of the sign noise, slowly)
        assert max(_rel(a, b) for a, b in zip(bf[0], f32[0], strict=True)) < 0.1
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other[0][0], results[0][0][0], strict=True))


def _diloco(dtype: torch.dtype | None):
    from onebit.optimizers import DiLoCo

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    kw = {} if dtype is None else {"error_dtype": dtype}
    return model, DiLoCo(model, inner, outer, sync_every=3, **kw)


def _diloco_body(dtype: torch.dtype | None, steps: int = 9):
    model, diloco = _diloco(dtype)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 2, (8,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        diloco.step()
        diloco.zero_grad()
    return [p.detach().clone() for p in model.parameters()], [e for pair in diloco._errors for e in pair]


def _diloco_both():
    return _diloco_body(None), _diloco_body(torch.float32)


def test_diloco_with_bfloat16_errors(ranks):
    # bfloat16 is DiLoCo's default
    for bf, f32 in ranks(2).run(_diloco_both):
        assert all(e.dtype == torch.bfloat16 for e in bf[1]) and any(bool(e.ne(0).any()) for e in bf[1])
        assert max(_rel(a, b) for a, b in zip(bf[0], f32[0], strict=True)) < 5e-2


def _diloco_cross_load():
    """A float32 DiLoCo's state loaded into a bfloat16 one and the other way round, after 4 steps (a
    sync done, one on its way): the buffers keep the loading DiLoCo's dtype, rounded to nearest or
    widened exactly, and the run goes on."""
    out = {}
    for saved, loading in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
        model, diloco = _diloco(saved)
        for step in range(4):
            g = torch.Generator().manual_seed(100 * step + dist.get_rank())
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 2, (8,), generator=g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            diloco.step()
            diloco.zero_grad()
        state, weights = diloco.state_dict(), copy.deepcopy(model.state_dict())
        model2, other = _diloco(loading)
        model2.load_state_dict(weights)
        other.load_state_dict(state)
        before = [e.clone() for pair in other._errors for e in pair]
        for step in range(4, 7):
            g = torch.Generator().manual_seed(100 * step + dist.get_rank())
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 2, (8,), generator=g)
            torch.nn.functional.cross_entropy(model2(x), y).backward()
            other.step()
            other.zero_grad()
        out[str(loading)] = ([e for pair in state["errors"] for e in pair], before,
                             [e for pair in other._errors for e in pair], other.syncs,
                             [t.clone() for t in other.theta])  # the global weights
    return out


def test_diloco_checkpoints_load_across_error_dtypes(ranks):
    results = ranks(2).run(_diloco_cross_load)
    for got in results:
        for loading, (saved, loaded, after, syncs, params) in got.items():
            dtype = torch.bfloat16 if loading.endswith("bfloat16") else torch.float32
            assert syncs == 2 and all(torch.isfinite(t).all() for t in params)
            assert any(bool(e.ne(0).any()) for e in saved)
            for s_, l_, a_ in zip(saved, loaded, after, strict=True):
                assert l_.dtype == dtype and a_.dtype == dtype
                assert torch.equal(l_, s_.to(dtype))  # rounded to nearest, or widened exactly
                if dtype == torch.float32:
                    assert torch.equal(l_.to(torch.bfloat16).float(), l_)
    for got in results[1:]:  # the replicas' global weights identical
        for k, v in got.items():
            assert all(torch.equal(a, b) for a, b in zip(v[4], results[0][k][4], strict=True))


def _in_pass_body(in_pass: bool, message: bool, nonfinite_at=None):
    """OnebitAdam with bfloat16 errors on the fused C passes: the passes read and store the bfloat16
    error themselves (``in_pass``), or the collective widens it for them and stores it after (the
    path every other pass takes); the momentum kept as a message or as a float32 buffer."""
    from onebit.kernels.backends import use_routes

    with use_routes(errors_in_pass=in_pass, message=message):
        rank = dist.get_rank()
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        opt = OnebitAdam(params, lr=1e-2, freeze_step=2, bucket_cap_mb=0.03, error_dtype=torch.bfloat16,
                         nonfinite=None if nonfinite_at is not None else "skip")
        g = torch.Generator().manual_seed(1000 + rank)
        before = None
        for step in range(7):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            red = opt.reducer()
            (k,) = [k for k, b in enumerate(red.buckets) if 3 in b.indices]  # the inf's bucket
            if step == nonfinite_at:
                before = [e.clone() for e in red.errors()[k]]
                if rank == 1:
                    params[3].grad[5, 7] = float("inf")
            opt.step()
            if step == nonfinite_at:
                after = red.errors()[k]
                return all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                           for a, b in zip(before, after, strict=True)) and bool(before[0].ne(0).any())
        red = opt.reducer()
        fused = all((b.message is not None) == message for b in red.buckets)  # the C passes ran
        return ([p.detach().clone() for p in params], [red.decoded(b).clone() for b in red.buckets],
                [e.clone() for pair in red.errors() for e in pair], fused)


def _in_pass_both(message: bool):
    return _in_pass_body(True, message), _in_pass_body(False, message)


@pytest.mark.skipif("not cpu_simd.available()", reason="no C library here")
@pytest.mark.parametrize("message", [True, False])
def test_the_c_passes_store_bfloat16_errors_bitwise_as_the_widened_call(ranks, message):
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)

    for own, staged in ranks(4).run(_in_pass_both, message):
        assert own[3] and staged[3]
        for a, b in zip(own[0] + own[1] + own[2], staged[0] + staged[1] + staged[2], strict=True):
            assert a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def _nonfinite_body():
    return _in_pass_body(True, True, nonfinite_at=4), _in_pass_body(True, False, nonfinite_at=4)


@pytest.mark.skipif("not cpu_simd.available()", reason="no C library here")
def test_a_non_finite_gradient_leaves_the_bfloat16_errors_bitwise(ranks):
    # without the check (nonfinite=None) the compressed step runs: the inf's bucket's scales are all
    # NaN, so none of its errors is updated, and a bfloat16 buffer is left exactly as it was (no
    # refold, no rounding)
    assert ranks(3).run(_nonfinite_body) == [(True, True)] * 3
