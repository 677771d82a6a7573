"""OnebitAdam's warm-up update in one Triton launch per bucket (kernels/fused/warmup.py; issue 57), under
the interpreter: against a float64 reference of the same operations (each float32 rounding at most a few
ulps of the result away) and against the unfused torch ops, with zero variances and gradients (unused
rows), huge and tiny values, groups with and without weight decay and bias correction, tensors that cross
the programs' boundaries, n not a multiple of 8; the gate: a NaN poison stores nothing (bitwise), a zero one
is bitwise the ungated launch."""

from __future__ import annotations

import math

import pytest
import torch

from onebit.kernels.fused import warmup
from onebit.optimizers._functional import adam_update, moments_


def _case(seed: int, sizes: list[int], kind: str):
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    g = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    vs = [torch.rand(s, generator=gen) * 1e-2 for s in sizes]
    ps = [torch.randn(s, generator=gen) for s in sizes]
    if kind == "edges":  # an unused row (g = m = v = 0), tiny and huge values, a dead tensor
        g[:64] = 0.0
        m[:64] = 0.0
        vs[0][:64] = 0.0
        g[100:110] = 1e-30
        g[200:210] = 3e15
        vs[-1].zero_()
        g[n - sizes[-1]:] = 0.0
    return g, m, vs, ps


def _groups():
    return [dict(betas=(0.9, 0.999), lr=1e-3, weight_decay=0.0, eps=1e-8, bias_correction=False),
            dict(betas=(0.8, 0.99), lr=3e-2, weight_decay=0.1, eps=1e-6, bias_correction=True)]


def _reference(g, m, vs, ps, sizes, groups, t):
    """The module's operations in float64 (the scalars rounded to float32 as the kernel reads them), and
    for each result a bound on the float32 kernel's error: each rounding (half an ulp) of each term,
    carried through (the momentum's error into the parameter's step)."""
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    u = torch.finfo(torch.float32).eps / 2
    out, off = [], 0
    for k, s in enumerate(sizes):
        b1, w1, b2, w2, decay, step, c2, eps = (f32(x) for x in warmup.rows(groups[k % 2], t))
        gk, mk = g[off:off + s].double(), m[off:off + s].double()
        terms_m = (mk * b1).abs() + (w1 * gk).abs()
        mk = mk * b1 + w1 * gk
        v = vs[k].double() * b2 + (w2 * gk) * gk
        terms_v = (vs[k].double() * b2).abs() + (w2 * gk * gk).abs()
        d = v.sqrt() / c2 + eps
        q = mk / d
        p = ps[k].double() * decay + step * q
        err_m, err_v = 2 * u * terms_m, 3 * u * terms_v
        err_q = (err_m + q.abs() * d * 4 * u) / d + q.abs() * (err_v / v.clamp_min(1e-300)).clamp(max=1.0)
        err_p = 2 * u * ((ps[k].double() * decay).abs() + (step * q).abs()) + abs(step) * err_q
        out.append((mk, err_m, v, err_v, p, err_p))
        off += s
    return out


def _run(g, m, vs, ps, sizes, groups, t, agreed=None):
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    table = warmup.table(offsets, sizes, g.device)
    table.fill({"sq": vs, "param": ps}, [warmup.rows(groups[k % 2], t) for k in range(len(sizes))])
    warmup.update(g, m, table, agreed)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("sizes, kind", [([1000, 17, 3000, 5], "random"), ([1500, 2049, 7], "edges")])
def test_the_warm_up_update_is_the_float64_reference_within_its_roundings(device, seed, sizes, kind):
    t = 3 + seed
    g, m, vs, ps = _case(seed, sizes, kind)
    groups = _groups()
    ref = _reference(g, m, vs, ps, sizes, groups, t)
    if device == "cuda":  # (the CUDA twin, for scripts/gpu_check.sh)
        gc, mc, vc, pc = g.cuda(), m.cuda(), [v.cuda() for v in vs], [p.cuda() for p in ps]
        _run(gc, mc, vc, pc, sizes, groups, t)
        m, vs, ps = mc.cpu(), [v.cpu() for v in vc], [p.cpu() for p in pc]
    else:
        _run(g, m, vs, ps, sizes, groups, t)
    off = 0
    for k, (rm, em, rv, ev, rp, ep) in enumerate(ref):
        got_m = m[off:off + rm.numel()].double()
        off += rm.numel()
        assert bool(((got_m - rm).abs() <= em).all()), k
        assert bool(((vs[k].double() - rv).abs() <= ev).all()), k
        assert bool(((ps[k].double() - rp).abs() <= ep).all()), k
        assert torch.isfinite(ps[k]).all()


@pytest.mark.parametrize("sizes, kind", [([1000, 17, 3000, 5], "random"), ([1500, 2049, 7], "edges")])
def test_the_warm_up_update_matches_the_unfused_ops_to_rounding(sizes, kind):
    t = 4
    g, m, vs, ps = _case(7, sizes, kind)
    groups = _groups()
    m2, vs2, ps2 = m.clone(), [v.clone() for v in vs], [p.clone() for p in ps]
    off = 0
    for k, s in enumerate(sizes):  # the unfused step (onebit_adam's per-tensor path)
        grp = groups[k % 2]
        b1, b2 = grp["betas"]
        mk = m2[off:off + s]
        moments_(mk, vs2[k], g[off:off + s], grp["betas"])
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if grp["bias_correction"] else (1.0, 1.0)
        adam_update(ps2[k], mk, vs2[k], lr=grp["lr"], eps=grp["eps"], weight_decay=grp["weight_decay"],
                    bc1=bc1, bc2=bc2, eps_inside_sqrt=False)
        off += s
    originals = [p.clone() for p in ps]
    _run(g, m, vs, ps, sizes, groups, t)
    assert all(not torch.equal(p, p0) for p, p0 in zip(ps, originals, strict=True))  # every tensor moved
    scale = float(m2.abs().max())
    assert float((m - m2).abs().max()) <= 2 * torch.finfo(torch.float32).eps * scale
    for v, v2, p, p2 in zip(vs, vs2, ps, ps2, strict=True):
        eps = torch.finfo(torch.float32).eps
        assert float((v - v2).abs().max()) <= 3 * eps * max(float(v2.abs().max()), 1e-30)
        assert float((p - p2).abs().max()) <= 4 * torch.finfo(torch.float32).eps * float(p2.abs().max())


def test_the_gate_stores_nothing_on_a_nan_poison_and_is_bitwise_ungated_on_zero():
    sizes = [1000, 17, 3000, 5]
    groups = _groups()
    g, m, vs, ps = _case(3, sizes, "random")
    before = (m.clone(), [v.clone() for v in vs], [p.clone() for p in ps])
    _run(g, m, vs, ps, sizes, groups, 2, agreed=torch.tensor(math.nan))
    assert torch.equal(m, before[0])
    assert all(torch.equal(a, b) for a, b in zip(vs + ps, before[1] + before[2], strict=True))
    g2, m2, vs2, ps2 = _case(3, sizes, "random")
    _run(g, m, vs, ps, sizes, groups, 2, agreed=torch.tensor(0.0))
    _run(g2, m2, vs2, ps2, sizes, groups, 2)
    assert torch.equal(m, m2)
    assert all(torch.equal(a, b) for a, b in zip(vs + ps, vs2 + ps2, strict=True))
    assert not torch.equal(m, before[0])
