"""The DDP hook's ``freeze_step`` passes inside the CPU codec's C passes (kernels/fused/hook.py)
against the unfused ones (the pre-pass, compressed_allreduce, the post-pass): bucket, bits and
error buffers bitwise, the local gradient norm to float64 rounding. Locally (W = 1's whole compute
with the collectives as copies: every ISA level this CPU runs, block sizes that do and do not
divide the runs, tails, gaps between parameters, zero and non-finite gradients) and through a real
DDP on 3 gloo ranks (odd W, sizes not a multiple of 8)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import hook_denominators

from onebit.collectives import _hook_fused
from onebit.collectives._frozen_adam import Denominators, FrozenAdam, frozen_pre_
from onebit.collectives.allreduce import LocalCopies, _compressed_allreduce, compressed_allreduce_passes
from onebit.kernels import cpu_simd
from onebit.kernels.backends import use_backend
from onebit.kernels.fused import hook
from onebit.kernels.layout import padded_numel

pytestmark = pytest.mark.skipif("not cpu_simd.available()", reason="no C passes on this CPU")


def _bucket(n: int, spans: list[tuple[int, int]], seed: int, special: str | None = None):
    g = torch.Generator().manual_seed(seed)
    buffer = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4) * 10  # heavy-tailed
    d = torch.ones(n)
    parts = []
    for k, (lo, hi) in enumerate(spans):
        d[lo:hi] = torch.rand(hi - lo, generator=g) * 3 + 1e-3
        m = torch.randn(hi - lo, generator=g)
        if k == 0:
            m[: (hi - lo) // 3] = 0.0  # dead units: no momentum
        parts.append((lo, hi, m, 9.0 / (k + 1)))
    if special == "zero":
        buffer[: n // 2] = 0.0
    elif special == "nan":
        buffer[n // 3] = float("nan")
    elif special == "inf":
        buffer[-1] = float("-inf")
    return buffer, d, parts


def _around(buffer, d, parts, fa, we, se, block, route: str):
    """The compressed call with the hook's passes: inside the codec's (``codec``), beside it in one C
    pass each way (``range``: what a mesh or a covered bucket takes), or the plain ops (``plain``)."""
    if route == "codec":
        passes = _hook_fused.passes(d, parts, fa, block)
        compressed_allreduce_passes(buffer, we, se, None, passes, local=True, block=block)
        return
    with use_backend("plain", steps=["hook"]) if route == "plain" else contextlib.nullcontext():
        assert _hook_fused.backend(buffer, d, parts) == (None if route == "plain" else "native")
        post = frozen_pre_(buffer, d, parts, fa)
    _compressed_allreduce(buffer, we, se, None, 1, block, LocalCopies())
    post(buffer)


def _run(n, spans, block, seed, special, route: str):
    buffer, d, parts = _bucket(n, spans, seed, special)
    N = padded_numel(n, 1, block)
    we = torch.randn(N, generator=torch.Generator().manual_seed(seed + 1)) * 0.1
    se = torch.randn(N, generator=torch.Generator().manual_seed(seed + 2)) * 0.1
    fa = FrozenAdam(1, 0.1)
    _around(buffer, d, parts, fa, we, se, block, route)
    return buffer, we, se, float(fa.local_sq)


CASES = [  # n, parameter spans (gaps between and after), block
    (1000, [(0, 640), (700, 990)], 64),
    (70001, [(5, 40000), (40000, 69000)], 64),
    (70001, [(0, 70001)], None),
    (9000, [(8, 4100), (4200, 8999)], 24),  # a block that does not divide the runs of 4096
    (4104, [(0, 4104)], 8),
    (13, [(1, 12)], None),  # one tail only
    (300000, [(0, 100000), (100003, 299999)], 96),
]


@pytest.mark.parametrize("isa", [1, 2])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_in_codec_is_bitwise_the_unfused_passes(case, isa, monkeypatch):
    if cpu_simd.best_isa() < isa:
        pytest.skip("this CPU lacks the ISA level")
    real = cpu_simd.best_isa()
    monkeypatch.setattr(cpu_simd, "best_isa", lambda: min(real, isa))
    n, spans, block = CASES[case]
    for seed, special in ((case, None), (case + 50, "zero")):
        want = _run(n, spans, block, seed, special, "plain")
        for route in ("codec", "range"):
            got = _run(n, spans, block, seed, special, route)
            for a, b in zip(got[:3], want[:3], strict=True):
                assert torch.equal(a, b), route
            assert got[3] == pytest.approx(want[3], rel=1e-12) and got[3] > 0


def _run_variance(n, spans, block, seed, kind, edtype, route: str):
    buffer, _, parts = _bucket(n, spans, seed, None)
    fa, den = hook_denominators(n, spans, seed, kind)
    N = padded_numel(n, 1, block)
    we = (torch.randn(N, generator=torch.Generator().manual_seed(seed + 1)) * 0.1).to(edtype)
    se = (torch.randn(N, generator=torch.Generator().manual_seed(seed + 2)) * 0.1).to(edtype)
    if route == "codec":
        assert _hook_fused.passes(den, parts, fa, block).BFLOAT16_ERRORS == (block is None
                                                                            or block <= hook.HOOK_RUN)
    _around(buffer, den.flat() if route == "plain" else den, parts, fa, we, se, block, route)
    return buffer, we, se, float(fa.local_sq)


VARIANCE_CASES = [  # n, spans, block, the variances, the error dtype
    (70001, [(5, 40000), (40000, 69000)], 64, "v32", torch.bfloat16),
    (70001, [(5, 40000), (40000, 69000)], 64, "v16", torch.float32),
    (9000, [(8, 4100), (4200, 6000), (6000, 8999)], 24, "mixed", torch.bfloat16),
    (300000, [(0, 100000), (100003, 299999)], None, "v32", torch.bfloat16),
    (20000, [(0, 20000)], 8192, "v32", torch.bfloat16),  # a block over the runs: errors widened for the call
    (13, [(1, 12)], None, "mixed", torch.bfloat16),  # one tail only
]


@pytest.mark.parametrize("isa", [1, 2])
@pytest.mark.parametrize("case", range(len(VARIANCE_CASES)))
def test_denominators_made_from_the_variance_and_bfloat16_errors_are_bitwise_the_unfused(case, isa,
                                                                                         monkeypatch):
    # the C passes make d from each parameter's frozen variance run by run (no bucket of d) and read
    # and store a bfloat16 worker error themselves: bitwise the flat d and the widened error's route
    if cpu_simd.best_isa() < isa:
        pytest.skip("this CPU lacks the ISA level")
    real = cpu_simd.best_isa()
    monkeypatch.setattr(cpu_simd, "best_isa", lambda: min(real, isa))
    n, spans, block, kind, edtype = VARIANCE_CASES[case]
    want = _run_variance(n, spans, block, case, kind, edtype, "plain")
    for route in ("codec", "range"):
        got = _run_variance(n, spans, block, case, kind, edtype, route)
        for a, b in zip(got[:3], want[:3], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), route
        assert got[3] == pytest.approx(want[3], rel=1e-12) and got[3] > 0
    N = padded_numel(n, 1, block)
    start = (torch.randn(N, generator=torch.Generator().manual_seed(case + 1)) * 0.1).to(edtype)
    assert not torch.equal(got[1], start)  # the worker error did move


def test_the_passes_decline_a_variance_they_cannot_read():
    n, spans = 1000, [(0, 640), (700, 990)]
    buffer, _, parts = _bucket(n, spans, 3, None)
    fa, den = hook_denominators(n, spans, 3, "v32")
    assert _hook_fused.backend(buffer, den, parts) == "native"
    lo, hi, (_, v, scal, name) = den.spans[0]
    for bad in (v.double(), torch.zeros(2 * (hi - lo))[::2]):  # float64, strided: not what the C reads
        spans = [(lo, hi, ("v", bad, scal, name)), *den.spans[1:]]
        assert _hook_fused.backend(buffer, Denominators(fa, n, "cpu", spans), parts) is None


@pytest.mark.parametrize("special", ["nan", "inf"])
def test_a_non_finite_gradient_gives_nan_and_leaves_the_errors(special):
    n, spans, block = CASES[1]
    want = _run(n, spans, block, 7, special, "plain")
    assert want[0].isnan().all()
    for route in ("codec", "range"):
        got = _run(n, spans, block, 7, special, route)
        assert got[0].isnan().all()
        for a, b in zip(got[1:3], want[1:3], strict=True):
            assert torch.equal(a, b)
        N = padded_numel(n, 1, block)  # the worker error as it came: not updated
        assert torch.equal(got[1], torch.randn(N, generator=torch.Generator().manual_seed(8)) * 0.1)


def _ddp_body(steps: int, in_codec: bool, block, kind: str = "adamw"):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from onebit.collectives import OnebitCompressHookState, onebit_compress_hook

    r = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(333, 211), torch.nn.Tanh(), torch.nn.Linear(211, 5),
                              torch.nn.Linear(5, 3, bias=False))
    net[3].weight.requires_grad_(False)  # a frozen layer: no gradient, no state
    model = DDP(net)
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
        state = OnebitCompressHookState(optimizer=opt, freeze_step=2, block=block)
    else:  # SGD's momentum compressed (no freeze_step): the same passes with d = 1
        opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9, dampening=0.1)
        state = OnebitCompressHookState(optimizer=opt, block=block)
    model.register_comm_hook(state, onebit_compress_hook)
    calls = [0]
    saved = hook.NativePasses.worker

    def counted(self, *a):
        calls[0] += 1
        return saved(self, *a)

    hook.NativePasses.worker = counted
    norms = []
    try:  # (not in_codec: the plain ops)
        with contextlib.nullcontext() if in_codec else use_backend("plain", steps=["hook"]):
            for t in range(steps):
                g = torch.Generator().manual_seed(100 * t + r)
                x = torch.randn(16, 333, generator=g)
                x[:, :9] = 0.0  # always-zero features
                torch.nn.functional.cross_entropy(model(x)[:, :3], x[:, 9:12].argmax(1)).backward()
                norms.append(float(state.clip_grad_norm_(1.0)))
                opt.step()
                opt.zero_grad()
    finally:
        hook.NativePasses.worker = saved
    return [p.detach().clone() for p in model.parameters()], calls[0], norms, state.stats()["buckets"]


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("block", [64, None])
def test_ddp_hook_on_three_ranks_is_bitwise_the_unfused_hook(ranks, block, kind):
    # AdamW with freeze_step, and SGD's momentum (no freeze_step: c alone, d = 1) in the same passes
    fused = ranks(3).run(_ddp_body, 6, True, block, kind)
    plain = ranks(3).run(_ddp_body, 6, False, block, kind)
    buckets = fused[0][3]
    assert buckets >= 1  # (DDP's first bucket takes 1 MB: all of this model)
    for r in range(3):
        assert fused[r][1] == 4 * buckets and plain[r][1] == 0  # every compressed bucket, every step
        for a, b in zip(fused[r][0], plain[r][0], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(fused[r][0], fused[0][0], strict=True):
            assert torch.equal(a, b)  # replicas agree
        assert fused[r][2] == pytest.approx(plain[r][2], rel=1e-9)  # the agreed clip norms
