"""Stochastic rounding of error buffers into bfloat16 (onebit.kernels.rounding): the same bits in every
backend and ISA, specials kept, unbiased, the docstring's example."""

from __future__ import annotations

import struct

import pytest
import torch

from onebit.kernels import cpu_simd, rounding
from onebit.kernels.backends import use_backend

ISAS = [("native:avx512", 2), ("native:avx2", 1), ("native:c", 0)]


def _hostile(n: int, seed: int) -> torch.Tensor:
    """Random float32 of several magnitudes with zeros, -0.0, subnormals, infinities, NaNs (signed, with
    payloads) and values at the top of bfloat16's range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    bits = x.view(torch.int32)
    specials = torch.tensor([0.0, -0.0, 1e-45, -1e-40, float("inf"), -float("inf"), float("nan"),
                             3.4e38, -3.39e38, 1.0, 1 + 2**-9]).view(torch.int32)
    where = torch.randint(0, n, (min(n, 40),), generator=g)
    bits[where] = specials[torch.randint(0, len(specials), where.shape, generator=g)]
    bits[where[:3]] = torch.tensor([0x7FFFFFFF, -1, 0x7F800001], dtype=torch.int32)[: len(where[:3])]
    return x


def _scales(count: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.rand(count, generator=g) + 0.01


@pytest.mark.parametrize("n, unit", [(1, 1), (7, 7), (16, 16), (1000, 1000), (4099, 64), (70001, 8),
                                     (70001, 70001)])
@pytest.mark.parametrize("role", [rounding.WORKER, rounding.SERVER])
def test_native_matches_plain_bitwise(n, unit, role):
    if not cpu_simd.available():
        pytest.skip("native library not built here")
    src = _hostile(n, n + unit)
    scales = _scales(-(-n // unit), n)
    want = rounding.narrow_plain(src, scales, unit, role)
    for name, level in ISAS:
        if level > cpu_simd.best_isa():
            continue
        got = torch.empty(n, dtype=torch.bfloat16)
        with use_backend(name):
            rounding.narrow_(got, src, scales, unit, role)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name


def test_triton_matches_plain_bitwise():
    pytest.importorskip("triton")
    n, unit = 5000, 96
    src = _hostile(n, 3)
    scales = _scales(-(-n // unit), 3)
    got = torch.empty(n, dtype=torch.bfloat16)
    with use_backend("triton"):
        rounding.narrow_(got, src, scales, unit, rounding.SERVER)
    want = rounding.narrow_plain(src, scales, unit, rounding.SERVER)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_specials_and_representable_values():
    vals = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1.0, -2.5, 1e-40, 3.3895e38])
    bf = vals.to(torch.bfloat16).float()  # already in bfloat16: stored unchanged whatever the bits
    for seed in range(20):
        out = rounding.narrow_plain(bf, torch.tensor([float(seed)]), 1 << 30, rounding.WORKER)
        assert torch.equal(out.view(torch.int16), bf.to(torch.bfloat16).view(torch.int16))
    nans = torch.tensor([0x7FC00000, 0x7FFFFFFF, -1, 0x7F800001, -0x7FFFFF], dtype=torch.int32)
    out = rounding.narrow_plain(nans.view(torch.float32), torch.ones(1), 1 << 30, rounding.WORKER)
    out = out.view(torch.int16).to(torch.int64)
    assert torch.isnan(out.to(torch.int16).view(torch.bfloat16).float()).all()
    assert ((out & 0x7FC0) == 0x7FC0).all()  # quiet NaNs; the sign kept
    assert torch.equal(out < 0, torch.tensor([False, False, True, False, True]))


def test_unbiased_and_within_one_ulp():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g)
    up, down = x.to(torch.bfloat16).float(), x.to(torch.bfloat16).float()
    # the two bfloat16 neighbours of each value
    lo = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    hi = ((x.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)
    del up, down
    total = torch.zeros_like(x, dtype=torch.float64)
    draws = 64
    for k in range(draws):
        out = rounding.narrow_plain(x, torch.tensor([1.0 + k]), x.numel(), rounding.WORKER).float()
        assert ((out == lo) | (out == hi)).all()
        total += out.double()
    frac = ((x.double() - lo.double()) / (hi.double() - lo.double()))  # P(up) for a positive value
    assert torch.all((frac >= 0) | (x < 0))
    mean = total / draws
    # relative bias over all elements: zero-mean rounding errors average out (RN would keep 2^-9 scale bias)
    rel = ((mean - x.double()) / (hi.double() - lo.double()).abs())
    assert rel.mean().abs() < 3e-3, rel.mean()
    rn = x.to(torch.bfloat16).double()
    corr_sr = ((mean - x.double()) * (x.double() - rn)).mean()
    assert corr_sr.abs() < 0.05 * ((x.double() - rn) ** 2).mean()  # not round-to-nearest's error


def test_docstring_example():
    e = torch.full((16,), 1 + 2**-9)
    out = rounding.narrow_plain(e, torch.ones(1), 16, rounding.WORKER).view(torch.int16)
    assert out[0].item() == 0x3F80 and out[2].item() == 0x3F81 and out[1].item() == 0x3F80
    (bits,) = struct.unpack("<I", struct.pack("<f", 1.0))
    assert bits == 0x3F800000


def test_float32_destination_is_a_copy():
    src = torch.randn(100)
    dst = torch.zeros(100)
    rounding.narrow_(dst, src, torch.ones(1), 100, rounding.WORKER)
    assert torch.equal(dst, src)
    assert rounding.narrow_(src, src, torch.ones(1), 100, rounding.WORKER) is src


def test_check_error_dtype():
    assert rounding.check_error_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match="error_dtype: expected torch.float32 or torch.bfloat16"):
        rounding.check_error_dtype(torch.float16)
    with pytest.raises(TypeError, match="error_dtype"):
        rounding.check_error_dtype("bfloat16")


# ---- bfloat16 error buffers through the codec and the collective ------------------------------------

from onebit.collectives import error_buffers  # noqa: E402
from onebit.collectives.local import local_compressed_allreduce  # noqa: E402
from onebit.kernels import decompress, message_scales, server_reduce, worker_compress  # noqa: E402
from onebit.kernels.layout import Layout, padded_numel  # noqa: E402

BACKENDS = ["torch", "native", "triton"]


def _backend_ok(backend: str) -> None:
    if backend == "native" and not cpu_simd.available():
        pytest.skip("native library not built here")
    if backend == "triton":
        pytest.importorskip("triton")


def _bf16_values(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(torch.bfloat16)


def _neighbours(bf: torch.Tensor, f32: torch.Tensor) -> bool:
    """Whether each bfloat16 value is one of the two bfloat16 values around the float32 one."""
    lo = (f32.view(torch.int32) & ~0xFFFF).view(torch.float32)
    hi = ((f32.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)
    b = bf.float()
    return bool(((b == lo) | (b == hi)).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block", [None, 16])
def test_codec_stores_the_rounding_of_the_float32_update(backend, block):
    _backend_ok(backend)
    W, n = 3, 1000
    N = padded_numel(n, W, block)
    layout = Layout(N, W, block)
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    e16 = _bf16_values(N, 2, 0.3)
    e32 = e16.float()
    msg16 = worker_compress(x, e16, W, backend=backend, block=block)
    msg32 = worker_compress(x, e32, W, backend=backend, block=block)
    assert torch.equal(msg16, msg32)  # the same float32 values compressed
    want = rounding.narrow_plain(e32, message_scales(msg32, layout), layout.block_len, rounding.WORKER)
    assert torch.equal(e16.view(torch.int16), want.view(torch.int16))
    # the server of chunk 0, from the three ranks' messages (here: three copies of one)
    recv = msg32.view(W, -1)[0].repeat(W)
    s16 = _bf16_values(N // W, 3, 0.1)
    s32 = s16.float()
    seg16 = server_reduce(recv, s16, W, backend=backend, block=block)
    seg32 = server_reduce(recv, s32, W, backend=backend, block=block)
    assert torch.equal(seg16, seg32)
    want = rounding.narrow_plain(s32, message_scales(seg32, layout), layout.block_len, rounding.SERVER)
    assert torch.equal(s16.view(torch.int16), want.view(torch.int16))
    # decompress with the deferred worker error
    e16 = _bf16_values(N, 4, 0.3)
    e32 = e16.float()
    msg = worker_compress(x, e32, W, update_error=False, backend=backend, block=block)
    gathered = torch.cat([seg32] * W)
    out16, out32 = x.clone(), x.clone()
    decompress(gathered, out16, W, worker_error=e16, worker_message=msg, backend=backend, block=block)
    decompress(gathered, out32, W, worker_error=e32, worker_message=msg, backend=backend, block=block)
    assert torch.equal(out16, out32)
    want = rounding.narrow_plain(e32, message_scales(msg, layout), layout.block_len, rounding.WORKER)
    assert torch.equal(e16.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("W, n, block", [(2, 1000, None), (3, 777, None), (5, 333, 8), (4, 4096, 64)])
def test_collective_with_bfloat16_errors(backend, W, n, block):
    _backend_ok(backend)
    g = torch.Generator().manual_seed(W * n)
    N = padded_numel(n, W, block)
    errs16 = [(_bf16_values(N, 10 + r, 0.2), _bf16_values(N // W, 20 + r, 0.1)) for r in range(W)]
    for step in range(3):
        xs = [torch.randn(n, generator=g) for _ in range(W)]
        errs32 = [(we.float(), se.float()) for we, se in errs16]
        out16 = local_compressed_allreduce([x.clone() for x in xs], [we for we, _ in errs16],
                                           [se for _, se in errs16], backend=backend, block=block)
        out32 = local_compressed_allreduce([x.clone() for x in xs], [we for we, _ in errs32],
                                           [se for _, se in errs32], backend=backend, block=block)
        for r in range(W):
            assert torch.equal(out16[r], out32[r]), (step, r)  # the same float32 errors were folded in
            assert errs16[r][0].dtype == errs16[r][1].dtype == torch.bfloat16
            assert _neighbours(errs16[r][0], errs32[r][0]) and _neighbours(errs16[r][1], errs32[r][1])
        assert not all(torch.equal(a[0].float(), b[0]) for a, b in zip(errs16, errs32, strict=True))


def test_nonfinite_input_leaves_bfloat16_errors_unchanged():
    W, n = 3, 100
    N = padded_numel(n, W)
    errs = [(_bf16_values(N, r), _bf16_values(N // W, 10 + r)) for r in range(W)]
    before = [(we.clone(), se.clone()) for we, se in errs]
    xs = [torch.randn(n) for _ in range(W)]
    xs[1][5] = float("nan")
    out = local_compressed_allreduce(xs, [we for we, _ in errs], [se for _, se in errs])
    assert all(torch.isnan(o).all() for o in out)
    for (we, se), (we0, se0) in zip(errs, before, strict=True):
        assert torch.equal(we.view(torch.int16), we0.view(torch.int16))
        assert torch.equal(se.view(torch.int16), se0.view(torch.int16))


def test_error_buffers_dtype_and_bad_buffers():
    we, se = error_buffers(10, None, dtype=torch.bfloat16)
    assert we.dtype == se.dtype == torch.bfloat16 and we.numel() == 16
    with pytest.raises(ValueError, match="error_dtype"):
        error_buffers(10, None, dtype=torch.float16)
    x = torch.randn(10)
    with pytest.raises(TypeError, match="worker_error: expected dtype float32, bfloat16, got float16"):
        worker_compress(x, torch.zeros(16, dtype=torch.float16), 1)


@pytest.mark.parametrize("W, C", [(2, 8), (3, 4104), (5, 70000)])
def test_native_server_stores_bfloat16_bitwise_as_the_widened_call(W, C):
    # the native server reads and stores a bfloat16 error run by run (one scale per chunk): the same
    # segment and the same stored bits as widening it, the float32 pass, then the rounding
    if not cpu_simd.available():
        pytest.skip("native library not built here")
    g = torch.Generator().manual_seed(C)
    layout = Layout(C * W, W)
    msgs = [worker_compress(torch.randn(C * W, generator=g), torch.zeros(C * W), W, backend="native")
            for _ in range(W)]
    recv = torch.cat([m.view(W, -1)[0] for m in msgs])
    for name, level in ISAS:
        if level > cpu_simd.best_isa():
            continue
        e16 = _bf16_values(C, 7, 0.2)
        e32 = e16.float()
        with use_backend(name):
            seg16 = server_reduce(recv, e16, W)
            seg32 = server_reduce(recv, e32, W)
        assert torch.equal(seg16, seg32), name
        want = rounding.narrow_plain(e32, message_scales(seg32, layout), layout.block_len, rounding.SERVER)
        assert torch.equal(e16.view(torch.int16), want.view(torch.int16)), name


@pytest.mark.cuda
def test_cuda_rounding_and_collective_with_bfloat16_errors():
    # the Triton rounding on CUDA tensors: the same bits as the torch version; a local collective of 3
    # ranks with bfloat16 errors: the same output as with their float32 values, errors their rounding
    n, unit = 100_003, 96
    src = _hostile(n, 5).cuda()
    scales = _scales(-(-n // unit), 5).cuda()
    got = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    rounding.narrow_(got, src, scales, unit, rounding.WORKER)
    want = rounding.narrow_plain(src.cpu(), scales.cpu(), unit, rounding.WORKER)
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))
    W, m = 3, 5000
    N = padded_numel(m, W)
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(m, generator=g).cuda() for _ in range(W)]
    errs16 = [(_bf16_values(N, r).cuda(), _bf16_values(N // W, 10 + r).cuda()) for r in range(W)]
    errs32 = [(we.float(), se.float()) for we, se in errs16]
    out16, out32 = (local_compressed_allreduce([x.clone() for x in xs], [a for a, _ in errs],
                                               [b for _, b in errs]) for errs in (errs16, errs32))
    for r in range(W):
        assert torch.equal(out16[r], out32[r])
        assert _neighbours(errs16[r][0].cpu(), errs32[r][0].cpu())
        assert _neighbours(errs16[r][1].cpu(), errs32[r][1].cpu())
