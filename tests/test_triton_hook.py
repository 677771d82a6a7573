"""The DDP hook's GPU pre- and post-pass (kernels/fused/hook.py, collectives/_hook_fused.py) under
the Triton interpreter, against the plain passes of ``frozen_pre_`` as a GPU runs them (one bucket
of ``c``, ``add_``, ``div_``; ``mul_``, ``sub_``: on this CPU with its C and compiled passes
switched off): the bucket bitwise after each pass, the local gradient norm to float64 rounding.
Parameters with gaps between them and after, spanning programs and several in one program, sizes
not a multiple of 16, dead units, zero and non-finite gradients; then a real DDP on 3 gloo ranks
(odd W) with the hook's default block and without block scales: parameters bitwise the plain
hook's, replicas identical."""

from __future__ import annotations

import pytest
import torch
from helpers import hook_denominators

from onebit.collectives import _hook_fused
from onebit.collectives._frozen_adam import Denominators, FrozenAdam, frozen_pre_
from onebit.kernels.backends import use_backend

pytest.importorskip("triton")
from onebit.kernels.fused import hook as triton_hook  # noqa: E402  (decorated now, under the interpreter)


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
        buffer[n // 2] = -0.0
    elif special == "nan":
        buffer[n // 3] = float("nan")
    elif special == "inf":
        buffer[-1] = float("-inf")
    out = torch.randn(n, generator=g)  # what the collective hands back
    return buffer, d, parts, out


def _route(triton: bool):
    """The hook's passes on Triton, or frozen_pre_'s route as a GPU runs it without Triton: the
    plain ops (neither the native C passes nor the per-parameter ones)."""
    return use_backend("triton" if triton else "plain", steps=["hook", "tensor"])


def _passes(n, spans, seed, special, triton: bool, device: str = "cpu"):
    buffer, d, parts, out = _bucket(n, spans, seed, special)
    buffer, d, out = buffer.to(device), d.to(device), out.to(device)
    parts = [(lo, hi, m.to(device), f) for lo, hi, m, f in parts]
    with _route(triton):
        fa = FrozenAdam(1, 0.1)
        post = frozen_pre_(buffer, d, parts, fa)
        x = buffer.clone()
        buffer.copy_(out)
        post(buffer)
    return x.cpu(), buffer.cpu(), float(fa.local_sq)


CASES = [  # n, parameter spans (gaps between and after)
    (1000, [(0, 640), (700, 990)]),
    (5003, [(5, 2000), (2000, 2003), (2003, 2100), (3000, 5003)]),  # several in one program, spanning
    (13, [(1, 12)]),
    (4096, [(0, 4096)]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("special", [None, "zero", "nan", "inf"])
def test_the_triton_passes_are_bitwise_the_plain_passes(case, special):
    n, spans = CASES[case]
    got = _passes(n, spans, case, special, True)
    want = _passes(n, spans, case, special, False)
    for a, b in zip(got[:2], want[:2], strict=True):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.signbit(), b.signbit())
    if special in ("nan", "inf"):
        assert got[2] != got[2] or got[2] == float("inf")
        assert want[2] != want[2] or want[2] == float("inf")
    else:
        assert got[2] == pytest.approx(want[2], rel=1e-12) and got[2] > 0


@pytest.mark.parametrize("kind", ["v32", "v16", "mixed"])
@pytest.mark.parametrize("case", [0, 1])
def test_denominators_made_from_the_variance_are_bitwise_the_flat_ones(case, kind):
    # the Triton passes read each parameter's frozen variance (float32 or bfloat16; none: d = 1) and make
    # d as they read it: bitwise the plain passes over the bucket of d made from the same variances
    n, spans = CASES[case]
    results = []
    for triton in (True, False):
        buffer, _, parts, out = _bucket(n, spans, case, "zero")
        fa, den = hook_denominators(n, spans, case, kind)
        with _route(triton):
            assert (_hook_fused.backend(buffer, den, parts) == "triton") == triton
            post = frozen_pre_(buffer, den if triton else den.flat(), parts, fa)
            x = buffer.clone()
            buffer.copy_(out)
            post(buffer)
        results.append((x, buffer, float(fa.local_sq)))
    (x1, y1, q1), (x2, y2, q2) = results
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and torch.equal(x1.signbit(), x2.signbit())
    assert q1 == pytest.approx(q2, rel=1e-12) and q1 > 0


def test_the_triton_path_declines_a_variance_it_cannot_read():
    n, spans = CASES[0]
    buffer, _, parts, _ = _bucket(n, spans, 0)
    fa, den = hook_denominators(n, spans, 0, "v32")
    with _route(True):
        assert _hook_fused.backend(buffer, den, parts) == "triton"
        lo, hi, (_, v, scal, name) = den.spans[1]
        strided = [den.spans[0], (lo, hi, ("v", torch.zeros(2 * (hi - lo))[::2], scal, name))]
        assert _hook_fused.backend(buffer, Denominators(fa, n, "cpu", strided), parts) is None


def test_the_triton_path_is_taken_and_declines_what_it_cannot_take(monkeypatch):
    buffer, d, parts, _ = _bucket(1000, [(0, 640), (700, 990)], 0)
    with _route(True):
        assert _hook_fused.backend(buffer, d, parts) == "triton"
        assert _hook_fused.backend(buffer.double(), d, parts) is None  # not float32
        assert _hook_fused.backend(buffer, d, [(0, 640, parts[0][2][::2].clone(), 1.0)]) is None  # wrong size
        assert _hook_fused.backend(buffer, d, [(0, 320, torch.zeros(640)[::2], 1.0)]) is None  # strided
    assert _hook_fused.backend(buffer, d, parts) != "triton"  # a CPU bucket by default: the C or torch ones
    calls = []
    real = triton_hook.pre
    monkeypatch.setattr(triton_hook, "pre", lambda *a: calls.append(1) or real(*a))
    with _route(True):
        fa, tables = FrozenAdam(1, 0.1), {}
        frozen_pre_(buffer, d, parts, fa, tables)(buffer)
        frozen_pre_(buffer, d, parts, fa, tables)(buffer)
    assert calls == [1, 1] and len(tables) == 1  # the table built once


class _Bucket:
    """What ``frozen_terms`` reads of a DDP bucket."""

    def __init__(self, params) -> None:
        self.params = params
        self._buffer = torch.cat([p.grad.reshape(-1) for p in params])

    def parameters(self):
        return self.params

    def gradients(self):
        return [p.grad for p in self.params]

    def buffer(self):
        return self._buffer


def _ops_of_a_compressed_bucket(count: int) -> int:
    """The torch ops but views (each a kernel launch on a GPU; under the interpreter a launch's own
    copies too) of one bucket's terms and Triton passes, a bucket of ``count`` AdamW parameters after
    the freeze (the table already made: a steady step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from onebit.collectives._frozen_adam import frozen_terms

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += not func.is_view  # (a view, detach: no kernel)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(count)
    params = [torch.nn.Parameter(torch.randn(37 + k, generator=g)) for k in range(count)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    names = [(0, k) for k in range(count)]
    fa = FrozenAdam(1, 0.1)
    fa.freeze(opt, {id(p): n for p, n in zip(params, names, strict=True)})
    bucket = _Bucket(params)
    with _route(True):
        for _ in range(2):
            Count.ops = 0
            with Count():
                d, parts = frozen_terms(opt, fa, bucket, names)
                frozen_pre_(bucket.buffer(), d, parts, fa)(bucket.buffer())
    return Count.ops


def test_the_hooks_terms_and_triton_passes_make_no_op_per_parameter():
    # issue 57: a GPU step's launches do not grow with the parameters (before: 5 per parameter, the
    # bucket of d made from each variance)
    few, many = _ops_of_a_compressed_bucket(3), _ops_of_a_compressed_bucket(12)
    assert few == many, (few, many)


def _ddp_body(steps: int, triton: bool, block):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from onebit.collectives import OnebitCompressHookState, onebit_compress_hook

    r = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(61, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5),
                              torch.nn.Linear(5, 3, bias=False))
    net[3].weight.requires_grad_(False)  # a frozen layer: no gradient, no state
    model = DDP(net)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    state = OnebitCompressHookState(optimizer=opt, freeze_step=2, block=block)
    model.register_comm_hook(state, onebit_compress_hook)
    real = triton_hook.post
    calls = [0]

    def counted(*a):
        calls[0] += 1
        return real(*a)

    triton_hook.post = counted
    norms = []
    scope = _route(triton)
    try:
        scope.__enter__()
        for t in range(steps):
            g = torch.Generator().manual_seed(100 * t + r)
            x = torch.randn(16, 61, generator=g)
            x[:, :9] = 0.0  # always-zero features
            torch.nn.functional.cross_entropy(model(x)[:, :3], x[:, 9:12].argmax(1)).backward()
            norms.append(float(state.clip_grad_norm_(1.0)))
            opt.step()
            opt.zero_grad()
    finally:
        scope.__exit__(None, None, None)
        triton_hook.post = real
    return [p.detach().clone() for p in model.parameters()], calls[0], norms


@pytest.mark.parametrize("block", [64, None])
def test_ddp_hook_on_three_ranks_is_bitwise_the_plain_hook(ranks, block):
    fast = ranks(3).run(_ddp_body, 5, True, block)
    plain = ranks(3).run(_ddp_body, 5, False, block)
    for r in range(3):
        assert fast[r][1] == 3 and plain[r][1] == 0  # the compressed iterations (3, 4, 5): one bucket each
        for a, b in zip(fast[r][0], plain[r][0], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(fast[r][0], fast[0][0], strict=True):
            assert torch.equal(a, b)  # replicas agree
        assert fast[r][2] == pytest.approx(plain[r][2], rel=1e-9)  # the agreed clip norms


@pytest.mark.cuda
@pytest.mark.parametrize("case", range(len(CASES)))
def test_on_cuda_the_triton_passes_are_bitwise_the_plain_gpu_passes(case):
    n, spans = CASES[case]
    (x1, o1, s1), (x0, o0, s0) = [_passes(n, spans, case, "zero", triton, "cuda") for triton in (True, False)]
    assert torch.equal(x1, x0) and torch.equal(x1.signbit(), x0.signbit()) and torch.equal(o1, o0)
    assert s1 == pytest.approx(s0, rel=1e-12)
