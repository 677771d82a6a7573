"""The native CPU codec reads and stores bfloat16 error buffers itself (kernels/native/rounding.c: the
worker's encode and decompress, the server's passes with block scales; each run widened on the stack,
stored rounded as onebit.kernels.rounding stores a whole buffer): bitwise what the same codec gives on
the buffers widened to float32 for the call and rounded after. W ranks in one process (odd W, sizes not
a multiple of 16, a block that does not divide the runs of 4096, one larger than them: widened as
before), heavy-tailed and sparse inputs, a non-finite one (every error left as it was)."""

from __future__ import annotations

import pytest
import torch

from onebit.collectives import local_compressed_allreduce
from onebit.kernels import cpu_simd
from onebit.kernels.backends import use_routes
from onebit.kernels.layout import padded_numel
from onebit.kernels.native import codec

needs_c = pytest.mark.skipif("not cpu_simd.available()", reason="no C library here")


def _inputs(W: int, n: int, block, seed: int, special: str | None):
    g = torch.Generator().manual_seed(seed)
    N = padded_numel(n, W, block)
    xs = []
    for r in range(W):
        x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4) * 10  # heavy-tailed
        x[torch.rand(n, generator=g) < 0.3] = 0.0  # sparse
        if special == "nan" and r == W - 1:
            x[n // 2] = float("nan")
        xs.append(x)
    we = [(torch.randn(N, generator=g) * 0.1).bfloat16() for _ in range(W)]
    se = [(torch.randn(N // W, generator=g) * 0.1).bfloat16() for _ in range(W)]
    return xs, we, se


def _call(W, n, block, seed, special, own: bool, monkeypatch):
    xs, we, se = _inputs(W, n, block, seed, special)
    with use_routes(errors_in_pass=own):  # off: the same codec on widened buffers, rounded after the call
        out = local_compressed_allreduce(xs, we, se, backend="native", block=block)
    return out, we, se


@needs_c
@pytest.mark.parametrize("W,n,block", [(3, 70001, None), (3, 70001, 64), (2, 9000, 24), (5, 4104, 8),
                                       (3, 30000, 4096), (2, 20000, 8192), (3, 13, None)])
@pytest.mark.parametrize("special", [None, "nan"])
def test_the_c_passes_on_bfloat16_errors_are_bitwise_the_widened_call(W, n, block, special, monkeypatch):
    got = _call(W, n, block, W * n, special, True, monkeypatch)
    want = _call(W, n, block, W * n, special, False, monkeypatch)
    start = _inputs(W, n, block, W * n, special)
    for r in range(W):
        assert torch.equal(got[0][r].nan_to_num(), want[0][r].nan_to_num())
        assert torch.equal(got[0][r].isnan(), want[0][r].isnan())
        for a, b, c in ((got[1][r], want[1][r], start[1][r]), (got[2][r], want[2][r], start[2][r])):
            assert a.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16))
            assert torch.equal(a, c) == (special == "nan")  # moved, or left as it was on a NaN


@needs_c
def test_the_codec_says_which_blocks_it_takes_as_they_are():
    from onebit.kernels.layout import Layout

    assert codec.bfloat16_errors(Layout(8192, 2))
    assert codec.bfloat16_errors(Layout(8192, 2, 64)) and codec.bfloat16_errors(Layout(8192, 2, 4096))
    assert not codec.bfloat16_errors(Layout(16384, 2, 8192))
    x, e = torch.zeros(8192), torch.zeros(8192, dtype=torch.bfloat16)
    bits = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bfloat16 e, block at most"):
        cpu_simd.encode_blocks(x, e, bits, 8192)


def _triton_bitwise_the_widened_call(W, n, block, special, monkeypatch, device="cpu"):
    # the Triton codec reads a bfloat16 error widened and stores it rounded in its own kernels
    # (rounding.store_typed_error): bitwise the call on widened buffers
    pytest.importorskip("triton")

    def call(own: bool):
        xs, we, se = (list(t.to(device) for t in ts) for ts in _inputs(W, n, block, W * n + 1, special))
        with use_routes(errors_in_pass=own):
            out = local_compressed_allreduce(xs, we, se, backend="triton", block=block)
        return out, we, se

    got, want = call(True), call(False)
    start = _inputs(W, n, block, W * n + 1, special)
    got, want = ([[t.cpu() for t in ts] for ts in res] for res in (got, want))
    for r in range(W):
        assert torch.equal(got[0][r].nan_to_num(), want[0][r].nan_to_num())
        for a, b, c in ((got[1][r], want[1][r], start[1][r]), (got[2][r], want[2][r], start[2][r])):
            assert a.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16))
            assert torch.equal(a, c) == (special == "nan")


TRITON_CASES = [(3, 7001, None), (3, 7001, 64), (2, 3000, 32), (5, 1304, 8)]


@pytest.mark.parametrize("W,n,block", TRITON_CASES)
@pytest.mark.parametrize("special", [None, "nan"])
def test_the_triton_kernels_on_bfloat16_errors_are_bitwise_the_widened_call(W, n, block, special,
                                                                           monkeypatch):
    _triton_bitwise_the_widened_call(W, n, block, special, monkeypatch)  # (the interpreter, this CPU)


@pytest.mark.cuda
@pytest.mark.parametrize("W,n,block", TRITON_CASES + [(4, 1 << 20, 64), (4, (1 << 20) + 3, None)])
def test_on_cuda_the_triton_kernels_on_bfloat16_errors_are_bitwise_the_widened_call(W, n, block,
                                                                                   monkeypatch):
    _triton_bitwise_the_widened_call(W, n, block, None, monkeypatch, "cuda")
