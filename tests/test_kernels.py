"""Kernel properties: bit order, error identity, scales, Triton (interpreted) vs torch path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_rel, simulate_allreduce
from hypothesis import given
from hypothesis import strategies as st

from onebit.kernels import (
    Layout,
    decompress,
    message_bits,
    message_scales,
    padded_numel,
    worker_compress,
)
from onebit.kernels.reference import reference_allreduce, reference_compress

BACKENDS = ["torch", "triton"]
EXAMPLE_X = [4.0, -4.0, 2.0, -2.0, 2.0, 0.0, -0.0, 2.0, -2.0, 2.0, -2.0, 2.0, 0.0, 0.0, -0.0, 0.0]
EXAMPLE_ERR = [2.0, -2.0, 0.0, 0.0, 0.0, -2.0, -2.0, 0.0, 0.0, 0.0, 0.0, 0.0, -2.0, -2.0, -2.0, -2.0]


def _vector(n: int, seed: int, zeros: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn((), generator=g) * 3)
    if zeros:  # exact zeros of both signs
        x[torch.rand(n, generator=g) < 0.3] = 0.0
        x[torch.rand(n, generator=g) < 0.1] = -0.0
    return x


def _signs(z: torch.Tensor) -> torch.Tensor:
    return torch.where(z < 0, -1.0, 1.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [1, 2])
def test_pack_example(backend, world_size, poison):
    """The docstring's hand-worked 16-element example, exactly."""
    x = torch.tensor(EXAMPLE_X)
    e = torch.zeros(16)
    msg = worker_compress(x, e, world_size, backend=backend)
    layout = Layout(16, world_size)
    bits = message_bits(msg, layout).reshape(-1).tolist()
    assert bits == [0xAF, 0x5F]
    assert message_scales(msg, layout).tolist() == [2.0] * world_size
    assert e.tolist() == EXAMPLE_ERR


@pytest.mark.parametrize("backend", BACKENDS)
@given(n=st.integers(1, 300), seed=st.integers(0, 2**31), zeros=st.booleans())
def test_packing_matches_numpy_packbits(backend, n, seed, zeros):
    x = _vector(n, seed, zeros)
    N = padded_numel(n, 1)
    e = _vector(N, seed + 1) * 0.5
    z = e.clone()
    z[:n] += x
    msg = worker_compress(x, e.clone(), 1, backend=backend)
    expected = np.packbits(np.logical_not(z.numpy() < 0), bitorder="big")
    assert np.array_equal(message_bits(msg, Layout(N, 1)).reshape(-1).numpy(), expected)


@pytest.mark.parametrize("backend", BACKENDS)
@given(n=st.integers(1, 300), seed=st.integers(0, 2**31), W=st.integers(1, 5), zeros=st.booleans())
def test_compress_error_identity_and_scale(backend, n, seed, W, zeros):
    x = _vector(n, seed, zeros)
    N = padded_numel(n, W) + 8 * W * (seed % 2)  # also a longer-than-needed padding
    e = torch.zeros(N) if zeros else _vector(N, seed + 1) * 0.3
    z = e.clone()
    z[:n] += x
    new_e = e.clone()
    msg = worker_compress(x, new_e, W, backend=backend)
    layout = Layout(N, W)
    scales = message_scales(msg, layout)
    s = scales[0]
    assert torch.equal(scales, s.expand(W))
    # the update is exactly z - s*sgn(z) in float32, so s*sgn(z) + e_new == z to one rounding
    assert torch.equal(new_e, z - s * _signs(z))
    ulp = torch.finfo(torch.float32).eps * torch.maximum(z.abs(), s)
    assert bool(((s * _signs(z) + new_e - z).abs() <= ulp).all())
    ref_bits, ref_scale, _ = reference_compress(z)
    assert torch.equal(message_bits(msg, layout).reshape(-1), ref_bits)
    torch.testing.assert_close(s.double(), ref_scale, rtol=1e-6, atol=0.0)
    assert s >= 0 and (s == 0) == bool((z == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_zero_iff_input_zero(backend):
    for n in (1, 8, 100):
        e = torch.zeros(padded_numel(n, 2))
        x = torch.zeros(n)
        x[n // 2] = -0.0
        msg = worker_compress(x, e, 2, backend=backend)
        assert message_scales(msg, Layout(e.numel(), 2)).tolist() == [0.0, 0.0]
        assert bool((message_bits(msg, Layout(e.numel(), 2)) == 0xFF).all())  # sgn(0) = +1
        x[0] = 1e-30
        msg = worker_compress(x, e, 2, backend=backend)
        assert bool((message_scales(msg, Layout(e.numel(), 2)) > 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
@given(n=st.integers(1, 200), seed=st.integers(0, 2**31))
def test_unpack_of_pack_is_identity(backend, n, seed):
    """decompress(compress(z)) at W = 1 gives exactly s*sgn(z): unpack(pack(s)) == s."""
    x = _vector(n, seed, zeros=True)
    x[0] = 1.0  # a non-zero scale
    e = torch.zeros(padded_numel(n, 1))
    msg = worker_compress(x, e, 1, backend=backend)
    s = message_scales(msg, Layout(e.numel(), 1))[0]
    out = torch.empty(n)
    decompress(msg, out, 1, backend=backend)
    assert torch.equal(out / s, _signs(x))


@given(n=st.integers(1, 400), seed=st.integers(0, 2**31), W=st.integers(1, 5))
def test_triton_and_torch_paths_agree(n, seed, W):
    """Bitwise-equal bits; scales and errors assert_close (they are bitwise in practice)."""
    N = padded_numel(n, W)
    results = {}
    for backend in BACKENDS:
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randn(n, generator=g) for _ in range(W)]
        we = [torch.randn(N, generator=g) * 0.1 for _ in range(W)]
        se = [torch.randn(N // W, generator=g) * 0.1 for _ in range(W)]
        msgs = [worker_compress(x, e.clone(), W, backend=backend) for x, e in zip(xs, we, strict=True)]
        outs = simulate_allreduce(xs, we, se, backend=backend)
        results[backend] = (msgs, outs, we, se)
    (m_a, o_a, we_a, se_a), (m_b, o_b, we_b, se_b) = results["torch"], results["triton"]
    layout = Layout(N, W)
    for a, b in zip(m_a, m_b, strict=True):
        assert torch.equal(message_bits(a, layout), message_bits(b, layout))
        torch.testing.assert_close(message_scales(a, layout), message_scales(b, layout))
    for a, b in zip(o_a + we_a + se_a, o_b + we_b + se_b, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deferred_error_update_equals_direct_update(backend):
    """The collective defers the worker error update into decompress: same bits as direct."""
    n, W = 1000, 3
    N = padded_numel(n, W)
    x, e = _vector(n, 1), _vector(N, 2) * 0.2
    direct = e.clone()
    msg = worker_compress(x, direct, W, backend=backend)
    deferred = e.clone()
    msg2 = worker_compress(x, deferred, W, update_error=False, backend=backend)
    assert torch.equal(deferred, e) and torch.equal(msg, msg2)
    gathered = msg.clone()  # any finite scales open the gate
    out = x.clone()
    decompress(gathered, out, W, worker_error=deferred, worker_message=msg2, backend=backend)
    assert torch.equal(deferred, direct)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("W", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 61, 1000])
def test_simulated_allreduce_matches_reference(backend, W, n, poison):
    """Local compute of W simulated ranks, chained calls, against the float64 oracle (W = 1 is
    the forced single-rank compression the benchmarks use). 10 calls on the torch path; 4 on the
    Triton interpreter (about 20 ms a launch): from the second call on the error buffers are
    non-zero, and test_triton_and_torch_paths_agree holds Triton to the torch path bit for bit
    on any error buffers."""
    N = padded_numel(n, W)
    g = torch.Generator().manual_seed(1000 * W + n)
    we = [torch.zeros(N) for _ in range(W)]
    se = [torch.zeros(N // W) for _ in range(W)]
    rwe, rse = [e.double() for e in we], [e.double() for e in se]
    for _ in range(10 if backend == "torch" else 4):
        xs = [torch.randn(n, generator=g) for _ in range(W)]
        xs[0][0] = 0.0
        xs[-1][-1] = -0.0
        outs = simulate_allreduce(xs, we, se, backend=backend)
        ref = reference_allreduce(xs, rwe, rse, compress_single_rank=True)
        rwe, rse = ref.worker_errors, ref.server_errors
        for out in outs:
            assert torch.equal(out, outs[0])
        assert_rel(outs[0], ref.output, 1e-6, "output")
    for a, b, s in zip(we, rwe, ref.worker_scales.tolist(), strict=True):
        assert_rel(a, b, 1e-6, "worker_error", norm=s * N**0.5)
    for a, b, s in zip(se, rse, ref.server_scales.tolist(), strict=True):
        assert_rel(a, b, 1e-6, "server_error", norm=s * (N // W) ** 0.5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_leaves_errors_and_gives_nan_everywhere(backend):
    n, W = 100, 3
    N = padded_numel(n, W)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, generator=g) for _ in range(W)]
    for bad in (float("nan"), float("inf"), -float("inf")):
        xs[1][7] = bad
        we = [torch.randn(N, generator=g) for _ in range(W)]
        se = [torch.randn(N // W, generator=g) for _ in range(W)]
        we0, se0 = [e.clone() for e in we], [e.clone() for e in se]
        outs = simulate_allreduce(xs, we, se, backend=backend)
        for out in outs:
            assert bool(torch.isnan(out).all())
        for a, b in zip(we + se, we0 + se0, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_inputs(backend):
    dtypes = [torch.float16] + ([torch.bfloat16] if backend == "torch" else [])
    for dtype in dtypes:
        n, W = 300, 2
        N = padded_numel(n, W)
        g = torch.Generator().manual_seed(3)
        xs = [torch.randn(n, generator=g).to(dtype) for _ in range(W)]
        we = [torch.zeros(N) for _ in range(W)]
        se = [torch.zeros(N // W) for _ in range(W)]
        outs = simulate_allreduce(xs, we, se, backend=backend)
        ref = reference_allreduce(xs, [torch.zeros(N)] * W, [torch.zeros(N // W)] * W)
        assert outs[0].dtype == dtype
        torch.testing.assert_close(outs[0], ref.output.to(dtype), rtol=0, atol=0)
        assert_rel(we[0], ref.worker_errors[0], 1e-6, "worker_error")


@pytest.mark.parametrize("block", [8, 64, 1000 * 8])
@pytest.mark.parametrize("W", [1, 3, 5])
def test_torch_path_blocking_is_invisible(monkeypatch, block, W):
    """The CPU path works in blocks: tiny blocks (many, crossing nothing) give the same result."""
    from onebit.kernels import torch_kernels

    n = 4099
    N = padded_numel(n, W)
    runs = []
    for size in (torch_kernels._BLOCK, block):
        monkeypatch.setattr(torch_kernels, "_BLOCK", size)
        g = torch.Generator().manual_seed(W)
        xs = [torch.randn(n, generator=g) for _ in range(W)]
        we = [torch.randn(N, generator=g) * 0.1 for _ in range(W)]
        se = [torch.randn(N // W, generator=g) * 0.1 for _ in range(W)]
        direct = [e.clone() for e in we]
        msgs = [worker_compress(x, e, W, backend="torch") for x, e in zip(xs, direct, strict=True)]
        outs = simulate_allreduce(xs, we, se, backend="torch")
        runs.append((msgs, direct, outs, we, se))
    layout = Layout(N, W)
    for a, b in zip(runs[0][0], runs[1][0], strict=True):
        assert torch.equal(message_bits(a, layout), message_bits(b, layout))
        torch.testing.assert_close(message_scales(a, layout), message_scales(b, layout), rtol=1e-7, atol=0)
    for part in range(1, 5):
        for a, b in zip(runs[0][part], runs[1][part], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n,W", [(3 * 4096, 1), (3 * 4096 - 5, 3), (2 * 4096 + 13, 4), (4096 + 1, 5)])
def test_triton_full_blocks_and_last_block(n, W, poison):
    """Several 4,096-element programs: full blocks take the unmasked path, the last one the
    masked path (n off any multiple of 16 too), and the scale is finalised by whichever program
    arrives last. Bitwise the torch path over three chained calls (the arrival counter must be
    back at zero after each launch), and a NaN inside a full block still leaves every error
    buffer untouched and gives NaN everywhere."""
    N = padded_numel(n, W)
    g = torch.Generator().manual_seed(n)
    xs = [[torch.randn(n, generator=g) * (k + 1) for _ in range(W)] for k in range(3)]
    we = [torch.randn(N, generator=g) * 0.1 for _ in range(W)]
    se = [torch.randn(N // W, generator=g) * 0.1 for _ in range(W)]
    got = {}
    for backend in BACKENDS:
        w, s = [e.clone() for e in we], [e.clone() for e in se]
        direct = [e.clone() for e in we]
        msgs = [worker_compress(x, e, W, backend=backend) for x, e in zip(xs[0], direct, strict=True)]
        outs = [simulate_allreduce(step, w, s, backend=backend) for step in xs]
        got[backend] = (msgs, direct, outs, w, s)
    (m_a, d_a, o_a, w_a, s_a), (m_b, d_b, o_b, w_b, s_b) = got["torch"], got["triton"]
    for a, b in zip(m_a, m_b, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(d_a + w_a + s_a + sum(o_a, []), d_b + w_b + s_b + sum(o_b, []), strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(out, o_b[-1][0]) for out in o_b[-1])
    bad = [x.clone() for x in xs[0]]
    bad[-1][4096 // 2] = float("nan")  # inside the first (full) block
    w0, s0 = [e.clone() for e in w_b], [e.clone() for e in s_b]
    outs = simulate_allreduce(bad, w_b, s_b, backend="triton")
    assert all(bool(torch.isnan(out).all()) for out in outs)
    for a, b in zip(w_b + s_b, w0 + s0, strict=True):
        assert torch.equal(a, b)
