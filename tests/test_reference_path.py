"""bench/reference_path.py (the reference implementation's op chain, the baseline of the CUDA
kernel benchmark) computes docs/ALGORITHMS.md section 2: checked against the float64 oracle, so
that the benchmark compares equal maths."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import ROOT, assert_rel

from onebit.kernels.reference import reference_allreduce

sys.path.insert(0, str(ROOT / "bench"))
from reference_path import packbits, reference_local, unpackbits  # noqa: E402


def test_pack_and_unpack_match_numpy():
    np = pytest.importorskip("numpy")
    bits = torch.randint(0, 2, (8 * 37,), generator=torch.Generator().manual_seed(3)).bool()
    packed = packbits(bits)
    assert packed.tolist() == np.packbits(bits.numpy(), bitorder="big").tolist()
    assert torch.equal(unpackbits(packed).bool(), bits)


@pytest.mark.parametrize("W, n", [(1, 1000), (4, 1024), (3, 240)])
def test_reference_chain_computes_the_spec(W, n):
    g = torch.Generator().manual_seed(W * 1000 + n)
    N = -(-n // (8 * W)) * 8 * W
    x = torch.randn(n, generator=g)
    we = torch.randn(N, generator=g) * 0.1
    se = torch.randn(N // W, generator=g) * 0.1
    # the chain feeds its server W copies of its own chunk 0: W identical simulated ranks
    want = reference_allreduce([x] * W, [we] * W, [se] * W, compress_single_rank=True)
    we32, se32 = we.clone(), se.clone()
    got = reference_local(x.clone(), we32, se32, W)
    C = N // W
    expect = want.output.reshape(-1)[:C].repeat(W)[:n] if W > 1 else want.output.reshape(-1)
    assert_rel(got, expect, 1e-6, "output")
    scale_w = float(want.worker_scales[0]) * N**0.5
    assert_rel(we32, want.worker_errors[0], 1e-6, "worker_error", norm=scale_w)
    assert_rel(se32, want.server_errors[0], 1e-6, "server_error", norm=float(want.server_scales[0]) * C**0.5)
