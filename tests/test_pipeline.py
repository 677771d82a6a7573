"""compressed_allreduce with block scales on CPU, sliced so that compute overlaps the wire
(onebit.collectives._pipeline): bitwise the unsliced call (outputs and both error buffers,
call after call), on odd world sizes, block lengths that are not multiples of 32, sizes whose
last chunk is mostly padding, heavy-tailed and sparse inputs; non-finite input in a late slice
on one rank leaves every error buffer unchanged and gives NaN on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from onebit.collectives import _pipeline, compressed_allreduce, padded_numel, traffic
from onebit.kernels import Layout
from onebit.kernels.backends import use_backend


def _inputs(n: int, call: int, rank: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * call + rank)
    x = torch.randn(n, generator=g)
    if kind == "heavy":  # Student-t with 1 degree of freedom: a few huge values
        x = x / torch.randn(n, generator=g).abs().clamp_min(1e-3)
    elif kind == "sparse":  # mostly zeros, whole blocks of them
        x = x * (torch.rand(n, generator=g) < 0.02)
    return x


def _body_sliced(n, block, kind, calls, min_piece, native, dtype=torch.float32):
    saved = _pipeline.MIN_PIECE, _pipeline.MAX_SLICES
    r, W = dist.get_rank(), dist.get_world_size()
    N = padded_numel(n, W, block)
    bufs = {K: (torch.zeros(N, dtype=dtype), torch.zeros(N // W, dtype=dtype))
            for K in ("sliced", "whole")}
    outs, sent = {"sliced": [], "whole": []}, {}
    try:
        codec = use_backend("native" if native else "plain", steps=["codec"])
        codec.__enter__()
        for name, max_slices in (("whole", 1), ("sliced", 4)):
            _pipeline.MIN_PIECE, _pipeline.MAX_SLICES = min_piece, max_slices
            traffic.reset()
            for c in range(calls):
                t = _inputs(n, c, r, kind)
                outs[name].append(compressed_allreduce(t, *bufs[name], block=block).clone())
            sent[name] = traffic.compressed
        K = _pipeline.slices(Layout(N, W, block))
    finally:
        codec.__exit__(None, None, None)
        _pipeline.MIN_PIECE, _pipeline.MAX_SLICES = saved
    return K, outs, bufs, sent


@pytest.mark.parametrize(("W", "block", "n", "kind", "native", "dtype"), [
    (3, 64, 3 * 64 * 40 + 17, "normal", False, torch.float32),
    (5, 24, 5 * 96 * 13 - 1, "heavy", False, torch.float32),
    (2, 8, 2 * 32 * 31 + 5, "sparse", False, torch.float32),
    (3, 64, 200, "normal", False, torch.float32),  # 2 slices; the last chunk all padding, the one
    # before half
    (3, 64, 3 * 64 * 64 + 1, "heavy", True, torch.float32),  # the native codec on every piece
    # bfloat16 errors, stored rounded by the native codec slice by slice at their places in the buffers
    (3, 64, 3 * 64 * 64 + 1, "heavy", True, torch.bfloat16),
    (5, 24, 5 * 96 * 13 - 1, "sparse", True, torch.bfloat16),
])
def test_sliced_call_is_bitwise_the_unsliced_one(ranks, W, block, n, kind, native, dtype):
    got = ranks(W).run(_body_sliced, n, block, kind, 3, 64, native, dtype)
    assert all(K > 1 for K, *_ in got), "the call was not sliced"
    for _, outs, bufs, sent in got:
        for c in range(3):
            assert torch.equal(outs["sliced"][c], outs["whole"][c]), c
            assert torch.equal(outs["sliced"][c], got[0][1]["sliced"][c])  # every rank the same
            assert bool(torch.isfinite(outs["sliced"][c]).all())
        for a, b in zip(bufs["sliced"], bufs["whole"], strict=True):
            word = torch.int16 if dtype == torch.bfloat16 else torch.int32
            assert a.dtype == dtype and torch.equal(a.view(word), b.view(word))  # bitwise
        assert sent["sliced"] == sent["whole"]
    assert any(bufs["sliced"][1].abs().sum() > 0 for _, _, bufs, _ in got)  # the server errors moved


def _body_nonfinite(n, block, bad_rank, where):
    saved = _pipeline.MIN_PIECE
    r, W = dist.get_rank(), dist.get_world_size()
    N = padded_numel(n, W, block)
    g = torch.Generator().manual_seed(r)
    we, se = torch.randn(N, generator=g), torch.randn(N // W, generator=g)
    before = we.clone(), se.clone()
    x = torch.randn(n, generator=g)
    if r == bad_rank:
        x[where] = float("inf")
    try:
        _pipeline.MIN_PIECE = 64
        K = _pipeline.slices(Layout(N, W, block))
        out = compressed_allreduce(x, we, se, block=block)
        with pytest.raises(FloatingPointError):
            compressed_allreduce(x.clone(), we, se, block=block, raise_on_nonfinite=True)
    finally:
        _pipeline.MIN_PIECE = saved
    return K, out, torch.equal(we, before[0]) and torch.equal(se, before[1])


@pytest.mark.parametrize("where", [5, -3])  # the first slice of chunk 0; the last slice of the last chunk
def test_nonfinite_input_in_any_slice_leaves_every_error_unchanged(ranks, where):
    got = ranks(3).run(_body_nonfinite, 3 * 64 * 30, 64, 1, where)
    for K, out, unchanged in got:
        assert K > 1 and unchanged
        assert bool(out.isnan().all())


def test_slices_only_with_block_scales_and_long_chunks():
    big = 4 * _pipeline.MIN_PIECE * _pipeline.MAX_SLICES
    assert _pipeline.slices(Layout(big, 4, None)) == 1  # one scale per chunk: never sliced
    assert _pipeline.slices(Layout(big, 1, 64)) == 1
    assert _pipeline.slices(Layout(big, 4, 64)) == _pipeline.MAX_SLICES
    assert _pipeline.slices(Layout(4 * 2 * _pipeline.MIN_PIECE, 4, 64)) == 2
    assert _pipeline.slices(Layout(4 * (_pipeline.MIN_PIECE + 64), 4, 64)) == 1
    for C, block in ((1 << 20, 64), (3 * 7 * 1024 * 96, 24), (192 * 5462, 192)):
        layout = Layout(3 * C, 3, block)
        K = _pipeline.slices(layout)
        c = _pipeline.piece_length(layout, K)
        assert c % block == 0 and c % 32 == 0 and (K - 1) * c < C <= K * c
