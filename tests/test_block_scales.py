"""Block scales: ``compressed_allreduce(..., block=B)``, one scale per B elements on both stages
(docs/ALGORITHMS.md section 7). The torch path (the path on every device for now) against the
float64 oracle at W = 1..5 and hostile sizes, the hand-worked example, exact bytes, the real
collective bitwise against the local compute, non-finite inputs and bad arguments."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from helpers import assert_block_reference, block_inputs
from hypothesis import given
from hypothesis import strategies as st

from onebit.collectives import compressed_allreduce, local_compressed_allreduce, traffic
from onebit.collectives.wire import compressed_bytes
from onebit.kernels import Layout, message_bits, message_scales, padded_numel, worker_compress
from onebit.kernels.reference import reference_allreduce


def test_block_example():
    x = torch.tensor([4, -4, 2, -2, 2, 0, -0.0, 2, -2, 2, -2, 2, 0, 0, -0.0, 0])
    e = torch.zeros(16)
    msg = worker_compress(x, e, 1, block=8)
    layout = Layout(16, 1, 8)
    assert message_bits(msg, layout).reshape(-1).tolist() == [0xAF, 0x5F]
    scales = message_scales(msg, layout).reshape(-1)
    assert scales.tolist() == [math.sqrt(6.0), math.sqrt(2.0)] or torch.allclose(
        scales, torch.tensor([math.sqrt(6.0), math.sqrt(2.0)]), rtol=0, atol=0)
    s = torch.tensor([math.sqrt(6.0)] * 8 + [math.sqrt(2.0)] * 8)
    sgn = torch.where(x < 0, -1.0, 1.0)
    torch.testing.assert_close(e, x - s * sgn, rtol=0, atol=1e-6)


@pytest.mark.parametrize("W", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("block", [8, 24, 64])
@pytest.mark.parametrize("n,kind", [(1, "gauss"), (7, "gauss"), (9, "sparse"), (1000, "gauss"),
                                    (1237, "sparse"), (4096, "heavy")])
def test_local_matches_float64_reference(W, block, n, kind):
    N = padded_numel(n, W, block)
    assert N % (block * W) == 0 and N >= n
    xs, we, se = block_inputs(W, n, N, seed=W * 100 + block + n, kind=kind)
    want = reference_allreduce(xs, we, se, compress_single_rank=True, block=block)
    we32, se32 = [e.clone() for e in we], [e.clone() for e in se]
    got = local_compressed_allreduce([x.clone() for x in xs], we32, se32, block=block)
    assert_block_reference(got, we32, se32, want, block)


@given(st.integers(1, 5), st.sampled_from([8, 16, 40]), st.integers(0, 600), st.integers(0, 2**31 - 1))
def test_error_identity_every_block(W, block, n, seed):
    """What a rank sends plus its new error is what it had to send, block by block."""
    N = padded_numel(n, W, block)
    g = torch.Generator().manual_seed(seed)
    x, e = torch.randn(n, generator=g), torch.randn(N, generator=g)
    z = e.clone()
    z[:n] += x
    msg = worker_compress(x, e, W, block=block)
    layout = Layout(N, W, block)
    scales = message_scales(msg, layout).reshape(-1).repeat_interleave(block)
    signs = torch.where(z < 0, -1.0, 1.0)
    big = float(z.abs().max()) if N else 0.0
    torch.testing.assert_close(scales * signs + e, z, rtol=0, atol=1e-5 * (1 + big))


def test_exact_bytes():
    for W, block, N in [(2, 8, 64), (3, 64, 3 * 64 * 5), (4, 24, 4 * 24 * 3), (5, 16, 5 * 16)]:
        C = N // W
        segment = -(-(C // 8) // 4) * 4 + 4 * (C // block)
        assert Layout(N, W, block).segment_bytes == segment
        assert compressed_bytes(N, W, block) == 2 * (W - 1) * segment
    # bits per element at B = 64, W = 4, large N: 1 + 32 / 64
    N = 4 * 64 * 1024
    assert compressed_bytes(N, 4, 64) * 8 / (2 * 3 / 4 * N) == pytest.approx(1.5)


def _body_collective(n, block, calls):
    r, W = dist.get_rank(), dist.get_world_size()
    N = padded_numel(n, W, block)
    we, se = torch.zeros(N), torch.zeros(N // W)
    outs = []
    traffic.reset()
    for c in range(calls):
        x = torch.randn(n, generator=torch.Generator().manual_seed(1000 * c + r)) * (1 + 10 * (r == 1))
        outs.append(compressed_allreduce(x.clone(), we, se, block=block).clone())
    return outs, we, se, traffic.compressed


@pytest.mark.parametrize("W", [2, 3])
def test_collective_equals_local_compute_bitwise(ranks, W):
    n, block, calls = 1001, 24, 3
    got = ranks(W).run(_body_collective, n, block, calls)
    N = padded_numel(n, W, block)
    we, se = [torch.zeros(N) for _ in range(W)], [torch.zeros(N // W) for _ in range(W)]
    for c in range(calls):
        xs = [torch.randn(n, generator=torch.Generator().manual_seed(1000 * c + r)) * (1 + 10 * (r == 1))
              for r in range(W)]
        want = local_compressed_allreduce(xs, we, se, block=block)
        for r in range(W):
            assert torch.equal(got[r][0][c], want[r]), (c, r)
    for r in range(W):
        assert torch.equal(got[r][1], we[r]) and torch.equal(got[r][2], se[r])
        assert got[r][3] == calls * compressed_bytes(N, W, block)


def _body_nonfinite(block):
    r, W = dist.get_rank(), dist.get_world_size()
    n = 200
    N = padded_numel(n, W, block)
    g = torch.Generator().manual_seed(r)
    we, se = torch.randn(N, generator=g), torch.randn(N // W, generator=g)
    before = we.clone(), se.clone()
    x = torch.randn(n, generator=g)
    if r == 1:
        x[17] = float("nan")
    out = compressed_allreduce(x, we, se, block=block)
    return out, torch.equal(we, before[0]) and torch.equal(se, before[1])


def test_nonfinite_on_one_rank_leaves_every_error_unchanged(ranks):
    got = ranks(3).run(_body_nonfinite, 16)
    for out, unchanged in got:
        assert unchanged
        assert not bool(torch.isfinite(out).all())
        assert torch.equal(out.isnan(), got[0][0].isnan())


@pytest.mark.parametrize("block", [0, 4, 12, -8, 8.0, True])
def test_bad_block(block):
    with pytest.raises(ValueError, match="^block: expected an int >= 8"):
        compressed_allreduce(torch.zeros(8), torch.zeros(8), torch.zeros(8), block=block)


def test_buffer_not_a_multiple_of_block():
    we, se = torch.zeros(24), torch.zeros(24)
    before = we.clone()
    with pytest.raises(ValueError, match=r"^worker_error: expected .*block \* world_size\) == 0 \(16\)"):
        compressed_allreduce(torch.ones(20), we, se, block=16)
    assert torch.equal(we, before)
