"""OnebitLamb's count sketch with a hashed index (onebit.kernels.sketch; docs/ALGORITHMS.md 6.3): the
index is the formula, computed where read, the same in the native C and in torch; the sketch is an
unbiased estimate of the squared norm, also for tensors whose rows repeat; nothing per coordinate is
kept; a checkpoint from before the hash resumes with the index it drew."""

from __future__ import annotations

import pytest
import torch
from helpers import resume_point

from onebit.kernels import cpu_simd  # noqa: F401  (read by the skip condition)
from onebit.kernels.backends import use_backend
from onebit.kernels.sketch import SketchHash, sketch

M = 0xFFFFFFFF


def _fmix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M
    return h ^ (h >> 16)


def test_the_index_is_the_formula():
    for seed in (0, 0x1B17, 0x1B17 + 2, 2**31 + 5):
        h = SketchHash(10**6, 256, seed)
        assert h.key == _fmix((seed ^ 0x536B6574) & M)
        picks = [0, 1, 2, 255, 256, 1023, 1024, 65535, 65536, 999_999]
        got = h.index(0, h.numel)[picks].tolist()
        assert got == [_fmix((h.key + i * 0x9E3779B9) & M) % 512 for i in picks]
        assert torch.equal(h.index(65530, 65540), h.index()[65530:65540])  # any range
    assert any(SketchHash(1, 256, s).key >= 2**31 for s in range(8))  # keys with the top bit, above


@pytest.mark.skipif("not cpu_simd.available()", reason="no C library here")
@pytest.mark.parametrize("n", [257, 1000, 1025, 65537, 300_001])
def test_the_native_sketch_is_bitwise_the_plain_one_and_near_the_float64_sums(n):
    g = torch.Generator().manual_seed(n)
    for seed in range(0x1B17, 0x1B17 + 4):  # keys above and below 2^31
        h = SketchHash(n, 256, seed)
        for x in (torch.randint(-100, 100, (n,), generator=g).float(), torch.randn(n, generator=g) * 1e3):
            native = sketch(x, h)
            with use_backend("plain"):
                plain = sketch(x, h)
            assert torch.equal(native, plain)  # the same index, the same order of the sums
            sums = torch.zeros(512, dtype=torch.float64).index_add_(0, h.index(), x.double())
            exact = sums[:256] - sums[256:]
            tol = 1e-6 * float(x.double().abs().sum())
            torch.testing.assert_close(native.double(), exact, rtol=0, atol=tol)


@pytest.mark.parametrize("kind", ["gaussian", "repeated rows", "constant", "one hot rows"])
def test_the_sketch_is_an_unbiased_estimate_of_the_squared_norm(kind):
    # E ||S x||^2 = ||x||^2 with relative spread about sqrt(2 / k) = 0.09 (k = 256), over 300 seeds;
    # the rows of a matrix repeating (or every element equal) must not fall into buckets together
    g = torch.Generator().manual_seed(5)
    if kind == "gaussian":
        x = torch.randn(96, 300, generator=g)
    elif kind == "repeated rows":
        x = torch.randn(1, 300, generator=g).expand(96, 300).contiguous()
    elif kind == "constant":
        x = torch.ones(96, 300)
    else:
        x = torch.zeros(96, 300)
        x[:, 7] = 1.0
    ratios = torch.tensor([float(sketch(x, SketchHash(x.numel(), 256, s)).double().norm() ** 2)
                           for s in range(300)]) / float(x.double().norm() ** 2)
    assert abs(float(ratios.mean()) - 1) < 0.03, float(ratios.mean())  # 5 standard errors
    assert 0.05 < float(ratios.std()) < 0.15, float(ratios.std())


def test_bad_arguments_name_what_was_expected():
    with pytest.raises(ValueError, match="size: expected a power of two"):
        SketchHash(1000, 200, 0)
    with pytest.raises(ValueError, match="x: expected 1000 elements"):
        sketch(torch.zeros(999), SketchHash(1000, 256, 0))


# -- OnebitLamb: nothing stored per coordinate; a checkpoint from before the hash ------------------------
def _lamb_run(legacy_from_start: bool, steps: int = 9, save_at=None, load=None, drop_counter=False):
    import torch.distributed as dist

    from onebit import OnebitLamb

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(40, 17), (301,), (5,)]]
    opt = OnebitLamb(params, lr=1e-2, freeze_step=3, weight_decay=0.01)
    if legacy_from_start:
        opt.sketch_hash = 0  # the release before the hash drew its index
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    saved = None
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        if step == save_at:
            saved = resume_point(opt, params, load)
            if drop_counter:  # as that release wrote it: no "sketch_hash" counter
                del saved["onebit"]["counters"]["sketch_hash"]
    index = opt._sketch_indices(opt.compressed_params())
    return [p.detach().clone() for p in params], opt.sketch_hash, [type(i).__name__ for i in index], saved


def _legacy_body():
    old = _lamb_run(True, save_at=5, drop_counter=True)  # compression stage (freeze at 3)
    resumed = _lamb_run(False, save_at=5, load=old[3])
    warm = _lamb_run(True, save_at=1, drop_counter=True)  # warm-up: no sketch yet
    from_warm = _lamb_run(False, save_at=1, load=warm[3])
    new = _lamb_run(False)
    return old, resumed, from_warm, new


def test_a_checkpoint_from_before_the_hash_resumes_bitwise_with_its_drawn_index(ranks):
    for old, resumed, from_warm, new in ranks(2).run(_legacy_body):
        assert old[1] == 0 and resumed[1] == 0 and resumed[2] == ["Tensor", "Tensor", "NoneType"]
        for a, b in zip(old[0], resumed[0], strict=True):
            assert torch.equal(a, b)
        # a warm-up checkpoint has no sketch yet: the run hashes from its freeze on
        assert from_warm[1] == 1 and from_warm[2] == ["SketchHash", "SketchHash", "NoneType"]
        assert new[1] == 1 and new[3] is None
        assert all(torch.isfinite(p).all() for p in new[0] + from_warm[0])
