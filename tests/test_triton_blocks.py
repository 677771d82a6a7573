"""The Triton kernels for block scales (kernels/triton_blocks.py) under the Triton interpreter:
against the float64 oracle, against the torch path (packed bits exactly), the non-finite rule
(a message's scales all finite or all NaN; errors untouched), full and masked tiles, and the
block sizes they take. On a GPU the same tests run on CUDA tensors (tests/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_block_reference, block_inputs

from onebit.collectives import local_compressed_allreduce
from onebit.kernels import (
    Layout,
    decompress,
    message_bits,
    message_scales,
    padded_numel,
    server_reduce,
    worker_compress,
)
from onebit.kernels.reference import reference_allreduce


# n = 9000 at W = 2: full tiles of 4096 elements and a masked last one; 13 and 1237: masked only
@pytest.mark.parametrize("W", [1, 2, 3, 5])
@pytest.mark.parametrize("block", [8, 64, 4096])
@pytest.mark.parametrize("n,kind", [(13, "gauss"), (1237, "sparse"), (9000, "heavy")])
def test_triton_blocks_match_float64_reference(W, block, n, kind):
    N = padded_numel(n, W, block)
    xs, we, se = block_inputs(W, n, N, seed=W * 100 + block + n, kind=kind)
    want = reference_allreduce(xs, we, se, compress_single_rank=True, block=block)
    we32, se32 = [e.clone() for e in we], [e.clone() for e in se]
    got = local_compressed_allreduce([x.clone() for x in xs], we32, se32, block=block, backend="triton")
    assert_block_reference(got, we32, se32, want, block)


@pytest.mark.parametrize("W,n,block", [(1, 100, 8), (3, 1001, 16), (2, 9000, 64), (4, 9000, 128),
                                       (3, 300, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_and_torch_block_paths_agree(W, n, block, dtype):
    """Packed bits equal exactly; scales to float32 rounding (both take float64 block sums, in
    different orders); errors and outputs to float32 rounding."""
    N = padded_numel(n, W, block)
    layout = Layout(N, W, block)
    g = torch.Generator().manual_seed(n + W)
    x = (torch.randn(n, generator=g) * 3).to(dtype)
    e, se0 = torch.randn(N, generator=g) * 0.1, torch.randn(N // W, generator=g) * 0.1
    got = {}
    for backend in ("torch", "triton"):
        direct, deferred, se = e.clone(), e.clone(), se0.clone()
        msg = worker_compress(x, direct, W, backend=backend, block=block)
        seg = server_reduce(msg, se, W, backend=backend, block=block)
        out = x.clone()
        msg2 = worker_compress(x, deferred, W, update_error=False, backend=backend, block=block)
        decompress(torch.cat([seg] * W), out, W, worker_error=deferred, worker_message=msg2, backend=backend,
                   block=block)
        got[backend] = msg, direct, seg, se, out, deferred
    (m0, d0, s0, se_0, o0, f0), (m1, d1, s1, se_1, o1, f1) = got["torch"], got["triton"]
    assert torch.equal(message_bits(m0, layout), message_bits(m1, layout))
    assert torch.equal(message_bits(s0, layout)[0], message_bits(s1, layout)[0])
    torch.testing.assert_close(message_scales(m0, layout), message_scales(m1, layout), rtol=2e-7, atol=0)
    torch.testing.assert_close(message_scales(s0, layout), message_scales(s1, layout), rtol=2e-7, atol=0)
    for a, b in ((d0, d1), (se_0, se_1), (f0, f1), (o0.float(), o1.float())):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(f1, d1, rtol=1e-6, atol=1e-6)  # deferred update == direct update


def test_triton_blocks_nonfinite_rule():
    W, n, block = 3, 5000, 16
    N = padded_numel(n, W, block)
    layout = Layout(N, W, block)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=g)
    x[4100] = float("nan")  # in the second tile: another program than the first scales'
    e = torch.randn(N, generator=g)
    before = e.clone()
    msg = worker_compress(x, e, W, backend="triton", block=block)
    assert bool(message_scales(msg, layout).isnan().all()) and torch.equal(e, before)
    # a server whose sum is not finite in one block (its error holds an inf) in its second tile:
    # every scale of its segment NaN, its error unchanged
    n2 = 15000
    N2 = padded_numel(n2, W, block)
    layout2 = Layout(N2, W, block)
    good2 = worker_compress(torch.randn(n2, generator=g), torch.zeros(N2), W, backend="triton", block=block)
    se = torch.zeros(N2 // W)
    se[4500] = float("inf")
    kept = se.clone()
    bad = server_reduce(good2, se, W, backend="triton", block=block)
    assert bool(message_scales(bad, layout2).isnan().all()) and torch.equal(se, kept)
    good = worker_compress(torch.randn(n, generator=g), torch.zeros(N), W, backend="triton", block=block)
    se = torch.zeros(N // W)
    se[3] = float("inf")
    seg = server_reduce(good, se, W, backend="triton", block=block)
    assert bool(message_scales(seg, layout).isnan().all())
    # a gathered message with one NaN segment: the deferred worker error update is skipped
    fine = server_reduce(good, torch.zeros(N // W), W, backend="triton", block=block)
    gathered = torch.cat([fine, seg, fine])
    out, we = torch.randn(n, generator=g), torch.randn(N, generator=g)
    we_before = we.clone()
    msg2 = worker_compress(out, we, W, update_error=False, backend="triton", block=block)
    decompress(gathered, out, W, worker_error=we, worker_message=msg2, backend="triton", block=block)
    assert torch.equal(we, we_before)
    # and the flag was reset: the next call on finite input gives finite scales
    again = worker_compress(torch.randn(n, generator=g), torch.zeros(N), W, backend="triton", block=block)
    assert bool(torch.isfinite(message_scales(again, layout)).all())


@pytest.mark.parametrize("block", [24, 8192])
def test_triton_takes_powers_of_two_up_to_4096(block):
    with pytest.raises(ValueError, match=r"^backend: the Triton kernels take block sizes that are powers"):
        worker_compress(torch.zeros(8), torch.zeros(block), 1, backend="triton", block=block)
    # without backend=, CPU tensors take the torch path whatever the block
    worker_compress(torch.zeros(8), torch.zeros(block), 1, block=block)
