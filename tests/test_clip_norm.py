"""The hooks' clip in ``freeze_step``'s compressed iterations clips by the norm of the ranks' mean gradient,
as plain DDP does, estimated from count sketches of each rank's own gradient (collectives/_frozen_adam.py
``clip_agreed``; docs/ALGORITHMS.md 8.2): the sketch's estimate has no bias and the spread its size says,
on heavy-tailed and sparse vectors; every backend gives the same index; the hook's norm is within the
estimate's spread of the exact mean gradient's norm on 2 and 3 ranks (where the former estimate, the root
mean square of the ranks' own norms, is far above it), the same on every rank, and a run that clips
resumes bitwise."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from onebit.collectives import OnebitCompressHookState, onebit_compress_hook
from onebit.collectives._clip_sketch import CLIP_SKETCH, CLIP_SKETCH_MIN, clip_sketch_size
from onebit.collectives.wire import ring_allreduce_bytes
from onebit.kernels.backends import use_backend
from onebit.kernels.sketch import SketchHash, sketch


def _heavy(n: int, seed: int) -> torch.Tensor:
    """Student-t (3 degrees of freedom) values, a third of them zero, a few coordinates 100x the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) / torch.sqrt(torch.distributions.Chi2(3.0).sample((n,)) / 3.0)
    x[torch.rand(n, generator=g) < 1 / 3] = 0.0
    x[:5] *= 100.0
    return x


def test_the_clip_sketch_estimates_a_squared_norm_without_bias_and_with_its_spread():
    n, size, draws = 1 << 16, 1024, 300
    x = _heavy(n, 0).double()
    exact = float(x.square().sum())
    # Var |Sx|^2 = 2 (|x|^4 - sum x^4) / size for a random hash (pairs of coordinates in one bucket)
    sd = math.sqrt(2.0 * (exact**2 - float(x.pow(4).sum())) / size) / exact
    ratios = torch.tensor([float(sketch(x.float(), SketchHash(n, size, seed), step="clip").double()
                                 .square().sum()) / exact for seed in range(draws)])
    assert abs(float(ratios.mean()) - 1.0) < 4 * sd / math.sqrt(draws), (float(ratios.mean()), sd)
    assert 0.7 * sd < float(ratios.std()) < 1.3 * sd, (float(ratios.std()), sd)


@pytest.mark.parametrize("n", [1, 1000, 4097, 70001])
def test_the_clip_sketch_is_the_same_in_every_backend(n):
    x = _heavy(n, n)
    h = SketchHash(n, 256, 0xDEADBEEF)  # (a key above 2^31)
    with use_backend("plain"):
        want = sketch(x, h, step="clip")
    for name in ("native", "triton"):  # (triton: under the interpreter, the atomic adds in order)
        with use_backend(name):
            assert torch.equal(sketch(x, h, step="clip"), want), name
    assert torch.equal(sketch(x, h), want)  # OnebitLamb's step: the same index


def test_the_clip_sketch_grows_with_the_model_within_its_bounds():
    sizes = [clip_sketch_size(n) for n in (1, 10_000, 263_296, 1 << 20, 124_000_000)]
    assert sizes == [CLIP_SKETCH_MIN, CLIP_SKETCH_MIN, 1024, 4096, CLIP_SKETCH], sizes
    assert all(s & (s - 1) == 0 for s in sizes)


def _model():
    torch.manual_seed(0)  # 263,296 elements: a sketch of 1,024 (the norm's spread about 2.2%)
    return torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 128))


def _batch(t: int, r: int):
    g = torch.Generator().manual_seed(1000 * t + r)
    x = torch.randn(4, 128, generator=g)
    x[:, :6] = 0.0  # always-zero features: their weights' gradients are zero
    return x, (x[:, 6:] * (1 + r)).argmax(1)


def _body(steps: int, freeze: int | None, clip_from: int, kind: str = "adamw"):
    """Each iteration: this rank's own gradient (DDP's no_sync), then the hooked one; from ``clip_from`` on
    the state's clip (max_norm huge: nothing scaled) and, in float64, the exact norms it estimates.
    ``kind``: AdamW (with ``freeze``), SGD with momentum (its momentum compressed from start_iter 2), or
    Muon on the matrices beside AdamW (Combined; Muon's gradients compressed from start_iter 2, AdamW's
    averaged exactly until ``freeze``)."""
    from onebit.optimizers import Combined

    r, W = dist.get_rank(), dist.get_world_size()
    model = DDP(_model())
    if kind == "muon":
        matrices = [p for p in model.parameters() if p.dim() == 2]
        rest = [p for p in model.parameters() if p.dim() != 2]
        opt = Combined([torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)])
    elif kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = OnebitCompressHookState(optimizer=opt, freeze_step=freeze, start_iter=2)
    model.register_comm_hook(state, onebit_compress_hook)
    rows = []
    for t in range(steps):
        x, y = _batch(t, r)
        with model.no_sync():
            torch.nn.functional.cross_entropy(model(x), y).backward()
        own = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if t >= clip_from:
            sent = state.stats()["bytes_control"]
            norm = state.clip_grad_norm_(1e30)
            sent = state.stats()["bytes_control"] - sent
            mean = own.clone()
            dist.all_reduce(mean)
            sq = own.square().sum()
            dist.all_reduce(sq)
            handed = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().norm()
            rows.append((t, float(norm), float(mean.norm() / W), float((sq / W).sqrt()), sent,
                         state._clip.size, float(handed)))
        opt.step()
        opt.zero_grad()
    return rows


@pytest.mark.parametrize("W", [2, 3])
def test_the_hooks_clip_by_the_mean_gradients_norm_after_the_freeze(ranks, W):
    n = sum(p.numel() for p in _model().parameters())
    size = clip_sketch_size(n)
    assert size == 1024 and n > 100 * size  # (the sketch's entries shared: an estimate, not the exact norm)
    got = ranks(W).run(_body, 12, 4, 0)
    for rows in got:
        assert [row[1] for row in rows] == [row[1] for row in got[0]]  # the same norm on every rank
        for t, norm, mean, rms, sent, sketched, _ in rows:
            assert sketched == size
            if t < 4:  # full precision: torch's clip of the averaged gradients, nothing sent by the clip
                assert norm == pytest.approx(mean, rel=1e-5) and sent == 0, (t, sent)
            else:  # compressed: the sketch's estimate, within 5 of its standard deviations
                assert abs(norm / mean - 1) < 5 * math.sqrt(2 / size) / 2, (t, norm, mean)
                assert rms > 1.1 * mean  # (what the root mean square of the ranks' own norms gives instead)
                assert sent == ring_allreduce_bytes(size, W, 4), sent  # its all-reduce counted


@pytest.mark.parametrize("W, kind", [(2, "sgd"), (3, "muon")])
def test_the_hook_without_freeze_step_clips_by_the_mean_gradients_norm(ranks, W, kind):
    # compressed from start_iter 2 (SGD's momentum; Muon's matrices beside AdamW's exact rest, the freeze far
    # away): the clip's norm is the estimate (the exact part counted exactly), where torch's clip of the
    # gradients handed over would read their 1-bit noise
    got = ranks(W).run(_body, 10, None if kind == "sgd" else 100, 0, kind)
    for rows in got:
        assert [row[1] for row in rows] == [row[1] for row in got[0]]
        for t, norm, mean, _, sent, size, handed in rows:
            if t < 2:
                assert norm == pytest.approx(mean, rel=1e-5) and sent == 0, (t, sent)
            else:  # compressed from start_iter 2 (the clip was asked for at t = 0: sketched since)
                assert abs(norm / mean - 1) < 5 * math.sqrt(2 / size) / 2, (t, norm, mean)
                assert sent == ring_allreduce_bytes(size, W, 4)
                assert t < 4 or handed > 1.1 * mean, (t, handed, mean)  # (the errors start at zero)


def test_a_first_clip_in_a_compressed_iteration_takes_the_ranks_root_mean_square(ranks):
    # the hook sketches once the clip has been asked for: a first call past the freeze has no sketch, and
    # clips by the ranks' root mean square (at least the mean's norm); the next iteration's is the estimate
    got = ranks(2).run(_body, 8, 3, 5)
    for t, norm, mean, rms, _, size, _ in got[0]:
        if t == 5:
            assert norm == pytest.approx(rms, rel=1e-9)
        else:
            assert abs(norm / mean - 1) < 5 * math.sqrt(2 / size) / 2, (t, norm, mean)


def _body_hsdp(freeze: int, steps: int):
    """The HSDP hooks (a 2 x 2 mesh): each compressed iteration's clip norm beside the exact norm of the
    replicas' mean gradient, from the blocks as the hook received them (their sum over the replicate
    group, squared, summed over the shard group)."""
    from test_hsdp import _loss, _mesh, _model

    from onebit.collectives import register_fsdp_hooks

    mesh = _mesh()
    rep, shard = mesh.get_group("replicate"), mesh.get_group("shard")
    model = _model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hooks = register_fsdp_hooks(model, optimizer=opt, freeze_step=freeze)
    fa, blocks = hooks._frozen_adam, []
    add = fa.add_local
    fa.add_local = lambda block, sq=None: (blocks.append(block.detach().clone()), add(block, sq))[1]
    rows = []
    for step in range(steps):
        opt.zero_grad()
        blocks.clear()
        _loss(model, step).backward()
        sent = hooks.stats()["bytes_control"]
        norm = float(hooks.clip_grad_norm_(1e30))
        sent = hooks.stats()["bytes_control"] - sent
        size = hooks._clip.size
        if step >= freeze:
            mine = torch.cat(blocks).double()
            both = mine.clone()
            dist.all_reduce(both, group=rep)
            sq, own = both.square().sum(), mine.square().sum()
            dist.all_reduce(sq, group=shard)
            dist.all_reduce(own)
            rows.append((step, norm, float(sq.sqrt() / 2), float((own / 2).sqrt()), size, sent))
        opt.step()
    return rows


def test_the_hsdp_hooks_clip_by_the_mean_gradients_norm_after_the_freeze(ranks):
    got = ranks(4).run(_body_hsdp, 3, 8)
    for rows in got:
        assert [row[1] for row in rows] == [row[1] for row in got[0]]  # the same norm on every rank
        assert len(rows) == 5
        for step, norm, mean, rms, size, sent in rows:
            assert size == CLIP_SKETCH_MIN  # (a small model: the smallest sketch)
            assert sent == ring_allreduce_bytes(size, 4, 4), sent  # over all 4 ranks, counted
            assert abs(norm / mean - 1) < 5 * math.sqrt(2 / size) / 2, (step, norm, mean)
            assert rms > 1.05 * mean, (step, rms, mean)
