"""OnebitAdam's fused Triton passes (kernels/fused/adam.py, optimizers/_fused.py) under the
Triton interpreter, against the plain path.

Pass A (fold + worker) must give the plain fold bitwise and the plain worker's packed bits
exactly, its scale to float32 rounding (both sum float64 partials, in different orders).
Pass B (decompress + update) must give the plain decompress's momentum and error bitwise, and
the parameters bitwise the unfused float32 formula ``p * (1 - lr wd) + (-lr) clamp(u / bc1)``
(each op rounded), within one rounding of the plain ops (whose ``p.add_(x, alpha)`` fuses its
multiply-add on CPU). Parameters of several sizes (one spanning programs, several in one
program, n not a multiple of 16), two param groups with their own scalars, a missing gradient,
and a non-finite scale. Then OnebitAdam end to end: one process (the benchmarks' local
collective) and 3 gloo ranks, fused against unfused on the same gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import denominator_scalars, frozen_variances, fused_steps, stale_denominators, torch_local

from onebit.kernels import Layout, decompress, message_bits, message_scales, padded_numel, worker_compress
from onebit.kernels.fused import adam
from onebit.kernels.fused.table import tiles
from onebit.optimizers import OnebitAdam, _fused
from onebit.optimizers import _functional as F

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
SIZES = [185, 1000, 3, 9000, 1088, 16, 5000]  # 9000 spans several 1024-element programs


def _bucket(W: int, seed: int, none_grad: int | None = 2):
    g = torch.Generator().manual_seed(seed)
    offsets = [sum(SIZES[:i]) for i in range(len(SIZES))]
    n = sum(SIZES)
    N = padded_numel(n, W)
    u = torch.randn(n, generator=g)
    e = torch.randn(N, generator=g) * 0.1
    grads = [torch.randn(s, generator=g) * 3 for s in SIZES]
    if none_grad is not None:
        grads[none_grad] = None
    variances = frozen_variances(SIZES, g)
    params = [torch.randn(s, generator=g) for s in SIZES]
    return offsets, n, N, u, e, grads, variances, params


def _rows(t: int = 3):
    # two groups: the first three parameters one, the rest another (different b1, lr, wd, bc1)
    out = []
    for i in range(len(SIZES)):
        b1, lr, wd, bc = (0.9, 1e-2, 0.1, True) if i < 3 else (0.8, 3e-3, 0.0, False)
        out.append((b1, 1.0 - b1, 1.0 - lr * wd if wd else 1.0, -lr, 1.0 - b1**t if bc else 1.0))
    return out


def _table(offsets, N, grads, variances, params, rows, device="cpu"):
    table = adam.table(offsets, SIZES, device)
    table.fill({"grad": grads, "var": variances, "param": params}, [r + denominator_scalars() for r in rows])
    return table


def _to(device, *tensors):
    return [None if t is None else t.to(device, copy=True) for t in tensors]


def test_tiles_cover_each_program_with_its_parameters():
    offsets = [0, 10, 10, 1500, 2300]  # an empty parameter at 10; programs of 1024 elements
    numels = [10, 0, 1490, 800, 1]
    t = tiles(adam.table(offsets, numels, "cpu"), 4096)
    assert t.lo.tolist() == [0, 2, 3, 5]
    assert t.hi.tolist() == [3, 4, 5, 5]  # program 3 (3072..4095) holds padding only


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("W", [1, 3])
def test_pass_a_is_the_plain_fold_and_worker(W, device):
    """On CUDA too, against the plain ops on CPU: bitwise the same float32 operations."""
    offsets, n, N, u, e, grads, variances, params = _bucket(W, seed=W)
    rows = _rows()
    layout = Layout(N, W)
    want_u = u.clone()
    denoms = stale_denominators(variances)
    for (b1, w, *_), off, size, gr, d in zip(rows, offsets, SIZES, grads, denoms, strict=True):
        F.fold_preconditioned_(want_u[off:off + size], gr, d, b1)
        assert w == 1.0 - b1
    want = worker_compress(want_u, e.clone(), W, update_error=False, backend="torch")
    got_u, got_e = _to(device, u, e)
    msg = torch.empty_like(want, device=device)
    grads, variances, params = _to(device, *grads), _to(device, *variances), _to(device, *params)
    adam.fold_worker(got_u, got_e, layout, msg, _table(offsets, N, grads, variances, params, rows, device))
    got_u, got_e, msg = got_u.cpu(), got_e.cpu(), msg.cpu()
    assert torch.equal(got_u, want_u)
    assert torch.equal(got_e, e)  # the worker error update is deferred to pass B
    assert torch.equal(message_bits(msg, layout), message_bits(want, layout))
    torch.testing.assert_close(message_scales(msg, layout), message_scales(want, layout), rtol=1.2e-7, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("W", [1, 3])
@pytest.mark.parametrize("clip", [1.0, math.inf])
def test_pass_b_is_the_plain_decompress_and_update(W, clip, device):
    offsets, n, N, u, e, grads, variances, params = _bucket(W, seed=10 + W)
    rows = _rows(t=7)
    layout = Layout(N, W)
    g = torch.Generator().manual_seed(99)
    msg = worker_compress(u, e.clone(), W, update_error=False, backend="torch")
    gathered = worker_compress(torch.randn(N, generator=g) * 0.5, torch.zeros(N), W, update_error=False,
                               backend="torch")
    want_u, want_e = u.clone(), e.clone()
    decompress(gathered, want_u, W, worker_error=want_e, worker_message=msg, backend="torch")
    got_u, got_e, got_p = *_to(device, u, e), _to(device, *params)
    table = _table(offsets, N, _to(device, *grads), _to(device, *variances), got_p, rows, device)
    adam.decompress_update(gathered.to(device), layout, got_u, got_e, msg.to(device), table, clip)
    got_u, got_e, got_p = got_u.cpu(), got_e.cpu(), [p.cpu() for p in got_p]
    assert torch.equal(got_u, want_u)
    assert torch.equal(got_e, want_e)
    c = torch.tensor(clip)
    for (_, _, decay, neg_lr, bc1), off, size, p, gp in zip(rows, offsets, SIZES, params, got_p, strict=True):
        m = want_u[off:off + size]
        f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731 - the scalars as the kernel reads them
        formula = p * f32(decay) + f32(neg_lr) * torch.clamp(m / f32(bc1), -c, c)
        assert torch.equal(gp, formula)
        plain = p.clone()
        step = F.stale_direction(plain, m, None, 0.0, None if clip == math.inf else clip, bc1)
        if decay != 1.0:
            plain.mul_(decay)
        plain.add_(step, alpha=neg_lr)
        scale = (p.abs() + abs(neg_lr) * step.abs()) * 2**-23
        assert bool(((gp - plain).abs() <= scale).all())
        assert not torch.equal(gp, p)


def test_pass_b_with_a_non_finite_scale_keeps_the_error():
    W = 3
    offsets, n, N, u, e, grads, variances, params = _bucket(W, seed=5)
    layout = Layout(N, W)
    msg = worker_compress(u, e.clone(), W, update_error=False, backend="torch")
    gathered = msg.clone()
    gathered.view(torch.float32)[(layout.scale_offset + layout.segment_bytes) // 4] = float("nan")  # chunk 1
    got_u, got_e, got_p = u.clone(), e.clone(), [p.clone() for p in params]
    table = _table(offsets, N, grads, variances, got_p, _rows())
    adam.decompress_update(gathered, layout, got_u, got_e, msg, table, 1.0)
    assert torch.equal(got_e, e)
    chunk = layout.C
    assert bool(got_u[chunk:2 * chunk].isnan().all()) and bool(got_u[:chunk].isfinite().all())


# -- OnebitAdam end to end ---------------------------------------------------------------------
SHAPES = [(37, 5), (9000,), (3,), (64, 17), (5000,)]


def _train(fused: bool, rank: int, world: int, steps: int = 6, local: bool = False, device: str = "cpu"):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).to(device)) for s in SHAPES]
    groups = [{"params": params[:2], "weight_decay": 0.1},
              {"params": params[2:], "lr": 3e-3, "betas": (0.8, 0.99)}]
    opt = OnebitAdam(groups, lr=1e-2, freeze_step=2, bucket_cap_mb=0.03, bias_correction=True)
    if local:
        opt.reducer().allreduce = torch_local
    used = []
    with fused_steps("triton" if fused else "plain"):
        g = torch.Generator().manual_seed(1000 + rank)
        for step in range(steps):
            for i, p in enumerate(params):
                p.grad = None if (step == 3 and i == 2) else torch.randn(p.shape, generator=g).to(device)
            used.append(_fused.applies(opt, opt.reducer(), opt.compressed_params()))
            opt.step()
    red = opt.reducer()
    return ([p.detach().cpu() for p in params], [red.decoded(b).cpu() for b in red.buckets],
            [e.cpu() for pair in red.errors() for e in pair], used)


def _compare(fused, plain) -> None:
    (p1, u1, e1, used1), (p0, u0, e0, used0) = fused, plain
    assert used1[2:] == [True] * (len(used1) - 2) and not any(used0)  # steps after the warm-up
    for a, b in zip(u1 + e1, u0 + e0, strict=True):
        # the scales' float64 sums are summed in other orders: the last bit of a scale may differ
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)
    for a, b in zip(p1, p0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.equal(a, torch.randn(0)) and a.isfinite().all()


@pytest.mark.parametrize("device", DEVICES)
def test_onebit_adam_fused_matches_unfused_locally(device):
    """On CUDA the unfused path's ops are torch's CUDA kernels (their own roundings)."""
    _compare(_train(True, 0, 1, local=True, device=device), _train(False, 0, 1, local=True, device=device))


def _ranks_body(world: int):
    import torch.distributed as dist

    rank = dist.get_rank()
    return _train(True, rank, world), _train(False, rank, world)


def test_onebit_adam_fused_matches_unfused_on_three_ranks(ranks):
    results = ranks(3).run(_ranks_body, 3)
    for fused, plain in results:
        _compare(fused, plain)
    for other in results[1:]:  # every rank holds the same parameters and momenta, bitwise
        for a, b in zip(other[0][0] + other[0][1], results[0][0][0] + results[0][0][1], strict=True):
            assert torch.equal(a, b)


def test_a_bucket_of_2_31_elements_or_more_takes_the_unfused_path():
    """The fused passes index elements in int32: a bucket whose padded length reaches 2^31 (a
    parameter that large gets a bucket of its own) must not be given to them. A stride-0 view of
    2^31 elements stands in for the 8 GiB error buffer."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = OnebitAdam(params, lr=1e-2, freeze_step=1, bucket_cap_mb=0.03)
    opt.reducer().allreduce = torch_local
    with fused_steps("triton"):
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape)
            opt.step()
        red, pairs = opt.reducer(), opt.compressed_params()
        assert _fused.applies(opt, red, pairs)
        bucket = red.buckets[-1]
        kept, bucket.worker_error = bucket.worker_error, torch.zeros(1).expand(2**31)
        try:
            assert not _fused.applies(opt, red, pairs)
            bucket.worker_error = torch.zeros(1).expand(2**31 - 8)
            assert _fused.applies(opt, red, pairs)
        finally:
            bucket.worker_error = kept
