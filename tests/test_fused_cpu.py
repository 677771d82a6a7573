"""OnebitAdam's compression stage with the fold and the update inside the CPU codec's C passes
(onebit.optimizers._fused_cpu) against the unfused step (a compiled or plain pass per parameter
around the collective): two parameter groups with their own lr, betas and weight decay, a
parameter without a gradient in one step, several buckets whose tensors straddle the chunks,
sizes not a multiple of 8; locally (W = 1's whole compute) and on 3 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from onebit.kernels import cpu_simd  # noqa: F401  (read by the skip condition)
from onebit.optimizers import OnebitAdam, _fused

pytestmark = pytest.mark.skipif("not cpu_simd.available()", reason="no C passes on this CPU")

SHAPES = [(37, 5), (9000,), (3,), (64, 17), (70001,), (301, 300)]  # the last two: cpu_fused's own passes too


def _train(fused: bool, rank: int, local: bool = False, backend: str | None = None, steps: int = 6):
    from onebit.collectives import local_compressed_allreduce

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    groups = [{"params": params[:2], "weight_decay": 0.1},
              {"params": params[2:], "lr": 3e-3, "betas": (0.8, 0.99)}]
    opt = OnebitAdam(groups, lr=1e-2, freeze_step=2, bucket_cap_mb=0.2, bias_correction=True)
    if local:
        def forced(tensor, we, se, group=None):
            return local_compressed_allreduce([tensor], [we], [se], backend=backend)[0]

        forced.local_compute = True
        opt.reducer().allreduce = forced
    _fused.ENABLED = fused
    used = []
    try:
        g = torch.Generator().manual_seed(1000 + rank)
        for step in range(steps):
            for i, p in enumerate(params):
                p.grad = None if (step == 3 and i == 2) else torch.randn(p.shape, generator=g)
            used.append(_fused.applies(opt, opt.reducer(), opt.compressed_params()))
            opt.step()
    finally:
        _fused.ENABLED = True
    red = opt.reducer()
    return ([p.detach().clone() for p in params], [b.flat.clone() for b in red.buckets],
            [e.clone() for pair in red.errors() for e in pair], used)


def _compare(fused, plain, bitwise: bool) -> None:
    (p1, u1, e1, used1), (p0, u0, e0, used0) = fused, plain
    assert used1[2:] == [True] * (len(used1) - 2) and not any(used0)  # the steps after the warm-up
    for a, b in zip(u1 + e1, u0 + e0, strict=True):
        if bitwise:  # the same C codec and the same fold, operation for operation
            assert torch.equal(a, b)
        else:  # the plain codec's scales come from float64 sums in another order: a last bit
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)
    for k, (a, b) in enumerate(zip(p1, p0, strict=True)):
        assert a.isfinite().all()
        if bitwise and a.numel() >= 65536:  # the unfused step's compiled update: the same two roundings
            assert torch.equal(a, b), k
        else:  # below cpu_fused.MIN_NUMEL its plain ops round p + (-lr) * step once
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_matches_unfused_with_the_same_codec_bitwise():
    fused = _train(True, 0, local=True, backend="compiled")
    _compare(fused, _train(False, 0, local=True, backend="compiled"), bitwise=True)


def test_fused_matches_unfused_with_the_plain_codec():
    _compare(_train(True, 0, local=True, backend="torch"), _train(False, 0, local=True, backend="torch"),
             bitwise=False)


def _ranks_body():
    import torch.distributed as dist

    rank = dist.get_rank()
    return _train(True, rank), _train(False, rank)


def test_fused_matches_unfused_on_three_ranks(ranks):
    results = ranks(3).run(_ranks_body)
    for fused, plain in results:
        _compare(fused, plain, bitwise=False)
    for other in results[1:]:  # every rank holds the same parameters and momenta, bitwise
        for a, b in zip(other[0][0] + other[0][1], results[0][0][0] + results[0][0][1], strict=True):
            assert torch.equal(a, b)


def test_a_non_finite_result_leaves_the_worker_error():
    # an infinite gradient with nonfinite=None (no check): the scales go non-finite, the worker
    # error stays as it was, as in the unfused step
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4096))
    opt = OnebitAdam([p], lr=1e-2, freeze_step=1, nonfinite=None)
    p.grad = torch.randn(4096)
    opt.step()
    red = opt.reducer()
    red.allreduce = _local
    before = [e.clone() for pair in red.errors() for e in pair]
    p.grad = torch.randn(4096)
    p.grad[7] = float("inf")
    assert _fused.applies(opt, red, opt.compressed_params())
    opt.step()
    after = [e.clone() for pair in red.errors() for e in pair]
    assert torch.equal(after[0], before[0])


def _local(tensor, we, se, group=None):
    from onebit.collectives import local_compressed_allreduce

    return local_compressed_allreduce([tensor], [we], [se])[0]


_local.local_compute = True
