"""The native CPU codec (onebit.kernels.native.codec, the C passes) against the plain-torch path,
its reference: packed bits and server sums bitwise; scales to their last float32 bit (float64
sums in another order); errors bitwise wherever the scale is, else to two ulps of it. Odd
world sizes, n not a multiple of 16, bfloat16, block sizes that are odd multiples of 8, and
the non-finite cases; every ISA level this CPU has (use_backend("native:<isa>"))."""

from __future__ import annotations

import pytest
import torch

from onebit.collectives import local_compressed_allreduce
from onebit.kernels import (
    cpu_simd,
    decompress,
    message_bits,
    message_scales,
    server_reduce,
    worker_compress,
)
from onebit.kernels.layout import Layout, padded_numel

# evaluated when a test runs (the C library's build), not at collection
compiles = pytest.mark.skipif("not cpu_simd.available()",
                              reason="no C library here (no C compiler): the plain path runs")

CASES = [  # (W, block, n, dtype)
    (1, None, 203, torch.float32),
    (3, None, 1000, torch.float32),
    (3, 24, 1001, torch.float32),
    (4, 8, 4096, torch.bfloat16),
    (5, 64, 7 * 640 + 13, torch.float32),
    (4, None, 1 << 14, torch.float32),
    (3, None, 1003, torch.bfloat16),
    (3, 64, 3 * 64 * 5 + 7, torch.float32),
    (2, 96, 2 * 96 * 4, torch.bfloat16),
]


@pytest.fixture(params=["avx512", "avx2", "c"])
def encode(request, monkeypatch):
    """The ISA level the C passes run at (ONEBIT_BACKEND=native:<isa>), where this CPU has it."""
    levels = {"avx512": 2, "avx2": 1, "c": 0}
    if not cpu_simd.available() or levels[request.param] > cpu_simd.best_isa():
        pytest.skip(f"no {request.param} here")
    monkeypatch.setenv("ONEBIT_BACKEND", f"native:{request.param}")
    return request.param


def _eps_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in float32 ulps (of the larger magnitude) per element; 0 where bitwise equal."""
    ulp = torch.finfo(torch.float32).eps * torch.maximum(a.abs(), b.abs())
    diff = (a - b).abs()
    return torch.where(diff == 0, torch.zeros_like(diff), diff / ulp)


def _check_scales(ref: torch.Tensor, got: torch.Tensor) -> None:
    assert torch.equal(ref.isnan(), got.isnan())
    finite = ~ref.isnan()
    assert float(_eps_ulps(ref[finite], got[finite]).amax()) <= 1.0 if bool(finite.any()) else True


def _check_errors(ref_e, got_e, ref_s, got_s, layout: Layout, chunk_len: int) -> None:
    """Errors bitwise where the element's scale is bitwise equal; else within 2 ulps of it."""
    B = layout.block or chunk_len
    per = lambda s: s.reshape(-1).repeat_interleave(B)[: ref_e.numel()]  # noqa: E731
    rs, gs = per(ref_s), per(got_s)
    same = rs == gs
    assert torch.equal(ref_e[same], got_e[same])
    tol = 2 * torch.finfo(torch.float32).eps * rs[~same].abs()
    assert bool(((ref_e[~same] - got_e[~same]).abs() <= tol).all())


def _inputs(W, block, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    N = padded_numel(n, W, block)
    x = (torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4) * 3).to(dtype)  # heavy-tailed
    x[: n // 7] = 0.0  # a run of zeros (unused rows), and a negative zero
    if n > 20:
        x[20] = -0.0
    e = torch.randn(N, generator=g) * 0.2
    return x, e, Layout(N, W, block)


@compiles
@pytest.mark.parametrize("W, block, n, dtype", CASES)
@pytest.mark.parametrize("update_error", [True, False])
def test_worker_matches_plain(W, block, n, dtype, update_error, poison, encode):
    x, e, layout = _inputs(W, block, n, dtype, seed=W + n)
    e_ref, e_got = e.clone(), e.clone()
    ref = worker_compress(x, e_ref, W, block=block, update_error=update_error, backend="torch")
    got = worker_compress(x, e_got, W, block=block, update_error=update_error, backend="native")
    assert torch.equal(message_bits(ref, layout), message_bits(got, layout))
    _check_scales(message_scales(ref, layout), message_scales(got, layout))
    if update_error:
        rs, gs = message_scales(ref, layout), message_scales(got, layout)
        _check_errors(e_ref, e_got, rs, gs, layout, layout.N)
    else:
        assert torch.equal(e_got, e)


@compiles
@pytest.mark.parametrize("W, block, n, dtype", CASES)
def test_server_matches_plain(W, block, n, dtype, encode):
    x, e, layout = _inputs(W, block, n, dtype, seed=7 * W + n)
    g = torch.Generator().manual_seed(n)
    received = torch.randint(0, 256, (layout.message_bytes,), dtype=torch.uint8, generator=g)
    scales = message_scales(received, layout)
    scales.copy_(torch.rand(scales.shape, generator=g) * 2)
    scales[(0,) * scales.dim()] = 0.0  # a zero scale (an all-zero chunk on some rank)
    se = torch.randn(layout.C, generator=g)
    se_ref, se_got = se.clone(), se.clone()
    ref = server_reduce(received, se_ref, W, block=block, backend="torch")
    got = server_reduce(received, se_got, W, block=block, backend="native")
    one = Layout(layout.C, 1, block)
    assert torch.equal(message_bits(ref, one), message_bits(got, one))
    rs, gs = message_scales(ref, one), message_scales(got, one)
    _check_scales(rs, gs)
    _check_errors(se_ref, se_got, rs, gs, one, layout.C)


@compiles
@pytest.mark.parametrize("W, block, n, dtype", CASES)
@pytest.mark.parametrize("with_update", [True, False])
def test_decompress_matches_plain(W, block, n, dtype, with_update, encode):
    x, e, layout = _inputs(W, block, n, dtype, seed=11 * W + n)
    msg = worker_compress(x, e.clone(), W, block=block, update_error=False, backend="torch")
    gathered = msg.clone()
    g = torch.Generator().manual_seed(n + 1)
    sc = message_scales(gathered, layout)
    sc.copy_(torch.rand(sc.shape, generator=g) + 0.1)
    outs = {}
    for backend in ("torch", "native"):
        out, err = x.clone(), e.clone()
        kw = {"worker_error": err, "worker_message": msg} if with_update else {}
        decompress(gathered, out, W, block=block, backend=backend, **kw)
        outs[backend] = out, err
    assert torch.equal(outs["torch"][0], outs["native"][0])
    assert torch.equal(outs["torch"][1], outs["native"][1])  # same scales in: bitwise


@compiles
@pytest.mark.parametrize("block", [None, 16, 32])
def test_nonfinite_as_plain(block, encode):
    """NaN in x, an infinite received scale, a NaN gathered scale: the same verdicts and the same
    untouched buffers as the plain path."""
    W, n = 3, 3 * 16 * 20
    x, e, layout = _inputs(W, block, n, torch.float32, seed=5)
    x[17] = float("nan")
    for backend in ("torch", "native"):
        ee = e.clone()
        msg = worker_compress(x, ee, W, block=block, backend=backend)
        assert torch.equal(ee, e) and bool(message_scales(msg, layout).isnan().all())
    received = worker_compress(x.nan_to_num(), e.clone(), W, block=block, backend="torch")
    message_scales(received, layout)[1 if block is None else (1, 0)] = float("inf")
    for backend in ("torch", "native"):
        se = torch.randn(layout.C)
        keep = se.clone()
        seg = server_reduce(received, se, W, block=block, backend=backend)
        assert torch.equal(se, keep) and bool(message_scales(seg, Layout(layout.C, 1, block)).isnan().all())
    gathered = received.clone()
    message_scales(gathered, layout)[0 if block is None else (0, 1)] = float("nan")
    for backend in ("torch", "native"):
        out, ee = x.nan_to_num(), e.clone()
        decompress(gathered, out, W, block=block, backend=backend, worker_error=ee, worker_message=received)
        assert torch.equal(ee, e)


@compiles
@pytest.mark.parametrize("block", [None, 32])
def test_allreduce_matches_plain(block, encode):
    """local_compressed_allreduce (every rank's compute of one call), W = 3, three steps:
    outputs and errors of both paths agree to the scale's last bit, and ranks agree bitwise."""
    W, n = 3, 5000
    g = torch.Generator().manual_seed(3)
    N = padded_numel(n, W, block)
    xs = [torch.randn(n, generator=g) for _ in range(W)]
    runs = {}
    for backend in ("torch", "native"):
        flats = [x.clone() for x in xs]
        we = [torch.zeros(N) for _ in range(W)]
        se = [torch.zeros(N // W) for _ in range(W)]
        for _ in range(3):
            flats = [x.clone() for x in xs]
            local_compressed_allreduce(flats, we, se, block=block, backend=backend)
        runs[backend] = flats, we, se
    for r in range(1, W):
        assert torch.equal(runs["native"][0][r], runs["native"][0][0])
    ref, got = runs["torch"][0][0], runs["native"][0][0]
    assert float(_eps_ulps(ref, got).max()) <= 2.0
    errors = [runs[k][1] + runs[k][2] for k in ("torch", "native")]
    for a, b in zip(*errors, strict=True):
        assert float((a - b).abs().max()) <= 4 * torch.finfo(torch.float32).eps * float(ref.abs().max())


@compiles
def test_default_choice(monkeypatch):
    """CPU calls take the native codec at every size (it is faster from 1,024 elements on: the plain
    path's small-call rule of the torch.compile tier is gone); use_backend and ONEBIT_BACKEND force
    one; the former switch ONEBIT_CPU_CODEC=torch still keeps CPU tensors plain, with a
    FutureWarning; 'compiled' (native's former name) warns."""
    from onebit.kernels import api, backends
    from onebit.kernels.native import codec as native

    big, small = Layout(1 << 20, 4), Layout(8 * 4 * 100, 4)
    cpu = torch.device("cpu")
    assert api._backend(cpu, None, None, big) is native
    assert api._backend(cpu, None, None, small) is native
    with backends.use_backend("native"):
        assert api._backend(cpu, None, None, small) is native
    with backends.use_backend("plain"):
        assert api._backend(cpu, None, None, big).__name__.endswith("torch_kernels")
        assert api._backend(cpu, "native", None, small) is native  # the call's own choice wins
    monkeypatch.setenv("ONEBIT_BACKEND", "plain")
    assert api._backend(cpu, None, None, big).__name__.endswith("torch_kernels")
    monkeypatch.setenv("ONEBIT_BACKEND", "fast")
    with pytest.raises(ValueError, match="ONEBIT_BACKEND: expected one of plain, native, triton.*'fast'"):
        api._backend(cpu, None, None, big)
    monkeypatch.delenv("ONEBIT_BACKEND")
    with pytest.warns(FutureWarning, match="backend='compiled' is now backend='native'"):
        assert api._backend(cpu, "compiled", None, small) is native
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.setenv("ONEBIT_CPU_CODEC", "torch")
    with pytest.warns(FutureWarning, match="ONEBIT_CPU_CODEC=torch is deprecated: set ONEBIT_BACKEND=plain"):
        assert api._backend(cpu, None, None, big).__name__.endswith("torch_kernels")
    with pytest.raises(ValueError, match="backend"):
        api._backend(cpu, "fast", None, big)


def test_without_a_c_compiler_the_plain_path_runs_with_one_warning(monkeypatch, tmp_path):
    """A library that cannot be built (no C compiler): one RuntimeWarning naming the cause, then
    every call takes the plain path with its results."""
    monkeypatch.setattr(cpu_simd, "_state", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no cached library to fall back on
    x, e, layout = _inputs(3, None, 1000, torch.float32, seed=1)
    with pytest.warns(RuntimeWarning, match="could not be built.*no-such-compiler"):
        got = worker_compress(x, e.clone(), 3, backend="native")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = worker_compress(x, e.clone(), 3, backend="native")
    ref = worker_compress(x, e.clone(), 3, backend="torch")
    assert torch.equal(got, ref) and torch.equal(again, ref)
