"""The frozen variance stored in bfloat16 (issue 56, docs/ALGORITHMS.md 12.1): once the variance is frozen
for good (OnebitAdam and OnebitLamb: the freeze; ZeroOneAdam: phase 2) each compressed parameter's
``exp_avg_sq`` is rounded once to nearest into bfloat16 and every reader widens it exactly. So the run is
bitwise the float32-variance run whose ``v`` is rounded in place at the same point, in the plain, C and
Triton paths, on 4 and 3 ranks; the C passes read a bfloat16 ``v`` as they read its widened float32 at
every ISA level, edge values included; ``state_dict()`` holds float32 and a resume is bitwise; a warm-up
checkpoint keeps its live variance; the state is 2 bytes per parameter lighter, counted from outside."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import fused_steps

from onebit.kernels import cpu_fused, cpu_simd
from onebit.memory import bytes_per_parameter
from onebit.optimizers import OnebitAdam, OnebitLamb, ZeroOneAdam

SHAPES = [(37, 5), (9000,), (3,), (64, 17), (5000,)]  # buckets of several tensors, n not a multiple of 16
BIG = [(300, 230)]  # above cpu_fused.MIN_NUMEL: the per-tensor C passes where the fused ones decline


def _make(kind: str, params, variance_dtype):
    """``kind``: adam, lamb or zoa, with "-ref" the reference's maths (its variance asked in bfloat16)."""
    groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "lr": 3e-3}]
    kw = dict(variance_dtype=variance_dtype)
    if kind.endswith("-ref"):
        kw.update(compression="momentum", variance_floor=None, auto_mask=None)
    if kind.startswith("adam"):
        return OnebitAdam(groups, lr=1e-2, freeze_step=2, bucket_cap_mb=0.03, bias_correction=True, **kw)
    if kind.startswith("lamb"):
        return OnebitLamb(groups, lr=1e-2, freeze_step=2, **kw)
    return ZeroOneAdam(groups, lr=1e-2, var_freeze_step=3, bucket_cap_mb=0.03, var_update_scaler=1,
                       local_step_scaler=2, local_step_clipper=4, **kw)


def _round_in_place(opt) -> None:
    """What storing v in bfloat16 must equal: the float32 v rounded to nearest bfloat16 in place, at the
    point where the variance is frozen for good (the optimizer's own narrowing point)."""
    if opt._frozen_for_good():
        for p, _ in opt.compressed_params():
            v = opt.state[p]["exp_avg_sq"]
            v.copy_(v.to(torch.bfloat16).float())
        opt._variance_changed()


def _run(kind: str, backend: str, narrow: bool, steps: int = 8, save_at=None, load=None):
    """``kind`` on this rank's gradients (a missing gradient at step 4); ``narrow``: the bfloat16 variance,
    else float32 rounded in place where it freezes. Returns the parameters, the momenta, the errors, the
    variances' dtypes and, with ``save_at``, the state dict after that step (``load``: loaded there)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    big = [] if backend == "triton" else BIG  # (Triton's interpreter: every tensor takes the kernels' path)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES + big]
    opt = _make(kind, params, torch.bfloat16 if narrow else torch.float32)
    if not narrow:
        opt._narrow_variance = lambda: _round_in_place(opt)
    g = torch.Generator().manual_seed(1000 + rank)
    saved = None
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = None if (step == 4 and i == 2) else torch.randn(p.shape, generator=g)
        with fused_steps(backend):
            opt.step()
        if step == save_at:
            if load is not None:
                opt.load_state_dict(load)
            saved = copy.deepcopy(opt.state_dict())
    state = opt.state_dict()  # the momenta (decoded where kept as messages) and every state tensor
    momenta = [s[name] for s in state["state"].values() for name in ("exp_avg", "sync_params") if name in s]
    errors = [e.clone() for pair in opt.reducer().errors() for e in pair]
    dtypes = {opt.state[p]["exp_avg_sq"].dtype for p, _ in opt.compressed_params()}
    return [p.detach().clone() for p in params], momenta, errors, dtypes, saved


def _body(kind: str, backend: str):
    return _run(kind, backend, True), _run(kind, backend, False)


def _assert_same(a, b) -> None:
    for x, y in zip(a[0] + a[1] + a[2], b[0] + b[1] + b[2], strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


NATIVE = pytest.mark.skipif("not cpu_simd.available()", reason="no C library here")


@pytest.mark.parametrize(("kind", "backend", "W"), [
    ("adam", "plain", 4), pytest.param("adam", "native", 4, marks=NATIVE), ("adam", "triton", 3),
    ("lamb", "plain", 3), pytest.param("lamb", "native", 4, marks=NATIVE),
    ("zoa", "plain", 3), pytest.param("zoa", "native", 4, marks=NATIVE), ("zoa", "triton", 4),
    # the reference's maths (float32 by default there) with a bfloat16 variance asked for: every reader widens
    ("adam-ref", "plain", 3), ("lamb-ref", "plain", 3), ("zoa-ref", "plain", 3),
])
def test_the_bfloat16_variance_is_bitwise_the_float32_one_rounded_where_it_freezes(ranks, kind, backend, W):
    for narrowed, rounded in ranks(W).run(_body, kind, backend):
        assert narrowed[3] == {torch.bfloat16} and rounded[3] == {torch.float32}
        _assert_same(narrowed, rounded)


def test_the_variance_is_float32_until_it_is_frozen_for_good_and_in_the_reference_maths():
    torch.manual_seed(0)
    # (ZeroOneAdam: rounded at the start of phase 2's first step, the 4th here)
    for kind, frozen_after in (("adam", 2), ("lamb", 2), ("zoa", 4)):
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        opt = _make(kind, params, None)  # the default
        for step in range(frozen_after + 2):
            for p in params:
                p.grad = torch.randn(p.shape)
            opt.step()
            dtypes = {opt.state[p]["exp_avg_sq"].dtype for p in params}
            want = torch.bfloat16 if step + 1 >= frozen_after else torch.float32
            assert dtypes == {want}, (kind, step, dtypes)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = OnebitAdam(params, lr=1e-2, freeze_step=1, compression="momentum", variance_floor=None)
    live = torch.nn.Parameter(torch.randn(40))
    groups = [{"params": params[:1]}, {"params": [live], "non_freeze": True}]
    opt2 = OnebitAdam(groups, lr=1e-2, freeze_step=1)
    for _ in range(3):
        for p in params + [live]:
            p.grad = torch.randn(p.shape)
        opt.step()
        opt2.step()
    assert opt.variance_dtype == torch.float32  # the reference's maths, bitwise: float32 by default
    assert {opt.state[p]["exp_avg_sq"].dtype for p in params} == {torch.float32}
    assert opt2.state[params[0]]["exp_avg_sq"].dtype == torch.bfloat16
    assert opt2.state[live]["exp_avg_sq"].dtype == torch.float32  # a non_freeze group's variance is live


@pytest.mark.parametrize("bad", [torch.float16, torch.float64, "bfloat16", 16])
def test_a_bad_variance_dtype_is_refused_naming_it(bad):
    params = [torch.nn.Parameter(torch.randn(4))]
    for make in (OnebitAdam, OnebitLamb, ZeroOneAdam):
        with pytest.raises((TypeError, ValueError), match="variance_dtype"):
            make(params, lr=1e-2, variance_dtype=bad)


def _resume_body(kind: str, backend: str):
    whole = _run(kind, backend, True, save_at=4)
    saved = whole[4]
    # the checkpoint holds float32 (exact: every value is a bfloat16's)
    for entry in saved["state"].values():
        v = entry["exp_avg_sq"]
        assert v.dtype == torch.float32 and torch.equal(v, v.to(torch.bfloat16).float())
    resumed = _run(kind, backend, True, save_at=4, load=saved)
    return whole, resumed


@pytest.mark.parametrize(("kind", "backend"), [
    pytest.param("adam", "native", marks=NATIVE), ("adam", "plain"), ("zoa", "plain"), ("lamb", "plain"),
])
def test_a_checkpoint_holds_float32_and_resumes_bitwise(ranks, kind, backend):
    for whole, resumed in ranks(3).run(_resume_body, kind, backend):
        assert resumed[3] == {torch.bfloat16}
        _assert_same(whole, resumed)


def test_a_warmup_checkpoint_loaded_past_the_freeze_keeps_its_live_variance():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = OnebitAdam(params, lr=1e-2, freeze_step=3)

    def step():
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step()

    step()
    warm = copy.deepcopy(opt.state_dict())
    live = {k: e["exp_avg_sq"].clone() for k, e in warm["state"].items()}
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in live.values())  # not representable
    for _ in range(4):
        step()
    assert opt.compressing and opt.state[params[0]]["exp_avg_sq"].dtype == torch.bfloat16
    opt.load_state_dict(warm)
    assert not opt.compressing
    for k, p in enumerate(params):  # the warm-up's float32 variance, not rounded
        v = opt.state[p]["exp_avg_sq"]
        assert v.dtype == torch.float32 and torch.equal(v, live[k])
    step()
    step()  # the freeze again: rounded there
    assert opt.compressing and opt.state[params[0]]["exp_avg_sq"].dtype == torch.bfloat16


def test_the_state_is_two_bytes_per_parameter_lighter_counted_from_outside():
    torch.manual_seed(0)
    sizes = {}
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES + BIG]
        n = sum(p.numel() for p in params)
        opt = _make("adam", params, dtype)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape)
            opt.step()
        sizes[dtype] = bytes_per_parameter(opt) * n
    assert sizes[torch.float32] - sizes[torch.bfloat16] == pytest.approx(2 * n, abs=1e-6)


# ---- the C passes: a bfloat16 v read as its widened float32, at every ISA level ----------------

def _variances(n: int, gen: torch.Generator) -> torch.Tensor:
    """sqrt(v) uniform in [0, 1) with edge values planted: zeros, float32 and bfloat16 subnormals,
    the largest finite bfloat16, infinity (n is odd: the passes' tails)."""
    v = torch.rand(n, generator=gen) ** 2
    v[:7] = torch.tensor([0.0, 1e-40, 2.0**-133, 3.3895313892515355e38, float("inf"), 1e-30, 1.0])
    return v.to(torch.bfloat16)


def _isas() -> list[int]:
    best = cpu_simd.library().onebit_best_isa()
    return list(range(best + 1))


@pytest.mark.skipif("not cpu_simd.available()", reason="no C library here")
def test_the_c_per_tensor_passes_read_a_bfloat16_variance_as_its_widened_float32(monkeypatch):
    gen = torch.Generator().manual_seed(7)
    n = cpu_fused.MIN_NUMEL + 13
    v16 = _variances(n, gen)
    v32 = v16.float()
    dsc = (0.05, 1.25, 1e-8)
    for isa in _isas():
        monkeypatch.setattr(cpu_simd, "_isa", lambda _, isa=isa: isa)
        a, b = cpu_fused.stale_denominator(v16, dsc), cpu_fused.stale_denominator(v32, dsc)
        assert a is not None and torch.equal(a, b), isa
        u = torch.randn(n, generator=gen)
        g = torch.randn(n, generator=gen)
        u1, u2 = u.clone(), u.clone()
        assert cpu_fused.fold_preconditioned_(u1, g, v16, dsc, 0.9)
        assert cpu_fused.fold_preconditioned_(u2, g, v32, dsc, 0.9)
        assert torch.equal(u1, u2), isa
        p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        outs = []
        for v in (v16, v32):
            pp, mm = p.clone(), m.clone()
            assert cpu_fused.stale_step_(pp, mm, v, dsc, lr=1e-2, weight_decay=0.1, clip=1.0)
            p2, m2 = p.clone(), m.clone()
            assert cpu_fused.local_step_(p2, m2, g, v, dsc, beta1=0.9, lr=1e-2, weight_decay=0.0, clip=None)
            m3 = torch.empty(n)
            assert cpu_fused.zoa_momentum_(m3, u, v, dsc, 0.7)
            outs.append((pp, mm, p2, m2, m3))
        for x, y in zip(*outs, strict=True):
            assert torch.equal(x, y), isa
