"""OnebitAdam's compression stage with the fold and the update inside the CPU codec's C passes
(onebit.kernels.fused.adam, onebit.optimizers._fused) against the unfused step (a compiled or
plain pass per parameter around the collective): two parameter groups with their own lr, betas and
weight decay, a parameter without a gradient in one step, several buckets whose tensors straddle the chunks,
sizes not a multiple of 8; locally (W = 1's whole compute) and on 3 gloo ranks."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from helpers import compiled_local, count_gradient_reads, fused_steps

from onebit.kernels import cpu_simd  # noqa: F401  (read by the skip condition)
from onebit.kernels.backends import use_routes
from onebit.kernels.fused import adam
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
    used = []
    with fused_steps(None if fused else "plain"):
        g = torch.Generator().manual_seed(1000 + rank)
        for step in range(steps):
            for i, p in enumerate(params):
                p.grad = None if (step == 3 and i == 2) else torch.randn(p.shape, generator=g)
            used.append(_fused.applies(opt, opt.reducer(), opt.compressed_params()))
            opt.step()
    red = opt.reducer()
    return ([p.detach().clone() for p in params], [red.decoded(b).clone() for b in red.buckets],
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
    fused = _train(True, 0, local=True, backend="native")
    _compare(fused, _train(False, 0, local=True, backend="native"), bitwise=True)


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


def _skipping(fused: bool, rank: int = 0, bad_rank: int = 0, policy: str = "skip", local: bool = True,
              message: bool = False, error_dtype=torch.float32):
    """Six steps, step 4 with an infinite gradient on ``bad_rank``: the states before and after
    it, the final state, and how often the gradients were read for the agreement. ``message``: the
    momentum kept as its last message between fused steps (the ``message`` route; False: the float32
    buffer)."""
    with use_routes(message=message):
        return _skipping_run(fused, rank, bad_rank, policy, local, error_dtype)


def _skipping_run(fused: bool, rank: int, bad_rank: int, policy: str, local: bool, error_dtype):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    # exact errors where compared with the unfused run to float32 rounding (bfloat16's rounding keys on
    # the scales' bits: a last-bit difference draws other bits; tests/test_error_dtype.py)
    opt = OnebitAdam(params, lr=1e-2, freeze_step=2, bucket_cap_mb=0.2, nonfinite=policy,
                     error_dtype=error_dtype)
    red = opt.reducer()
    if local:
        red.allreduce = compiled_local
    reads = count_gradient_reads(opt)
    states = []
    with fused_steps(None if fused else "plain"):
        g = torch.Generator().manual_seed(1000 + rank)
        for step in range(6):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            if step == 4 and rank == bad_rank:
                params[4].grad[123] = float("inf")
            state = [t.clone() for t in [p.detach() for p in params] + [red.decoded(b) for b in red.buckets]
                     + [e for pair in red.errors() for e in pair]]
            said = step == 4 and policy == "skip" and rank == 0  # the skip's warning: group rank 0's
            warned = pytest.warns(RuntimeWarning, match="step skipped on every") if said else nullcontext()
            try:
                with warned:
                    opt.step()
            except FloatingPointError:
                assert policy == "raise" and step == 4
            if step == 4:
                states.append(state)
                kept = [red.decoded(b) for b in red.buckets]
                states.append([t.clone() for t in [p.detach() for p in params] + kept
                               + [e for pair in red.errors() for e in pair]])
    final = [t.clone() for t in [p.detach() for p in params] + [red.decoded(b) for b in red.buckets]]
    return states, final, len(reads), opt.skipped_steps




@pytest.mark.parametrize("error_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_skipped_step_with_the_momentum_kept_as_a_message_changes_nothing(policy, error_dtype):
    # the momentum kept as its last message: prepare runs from the second fused step on (its worker
    # pass writes nothing but the message: the agreement reads the scales, not the gradients), the
    # skipped step writes nothing, and the run is bitwise the float32 buffer's
    (before, after), final, reads, skipped = _skipping(True, policy=policy, message=True,
                                                       error_dtype=error_dtype)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)
    (before1, _), final1, reads1, skipped1 = _skipping(True, policy=policy, message=False,
                                                       error_dtype=error_dtype)
    assert skipped == skipped1 == (1 if policy == "skip" else 0)
    assert reads == reads1 == 3  # the two warm-up steps and the first fused one
    for a, b in zip(before + final, before1 + final1, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_skipped_step_restores_the_prepared_momentum_bitwise(policy):
    # from the second fused step on, the fold and encode run before the agreement and the
    # agreement reads the messages' scales: no pass over the gradients; the skipped step leaves
    # every parameter, momentum and error buffer bitwise as it was, and the run goes on as the
    # unfused one does
    (before, after), final, reads, skipped = _skipping(True, policy=policy)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)
    (before0, after0), final0, reads0, skipped0 = _skipping(False, policy=policy)
    assert skipped == skipped0 == (1 if policy == "skip" else 0)
    assert reads0 == 6 and reads == 3  # the warm-up's two and the first fused step's read the gradients
    for a, b in zip(before + final, before0 + final0, strict=True):
        if a.numel() >= 65536:
            assert torch.equal(a, b)
        else:  # below cpu_fused.MIN_NUMEL the unfused update's plain ops round once (its multiply-add fused)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _skip_body():
    import torch.distributed as dist

    rank = dist.get_rank()
    return (_skipping(True, rank, bad_rank=2, local=False), _skipping(False, rank, 2, local=False),
            _skipping(True, rank, 2, local=False, message=True))


def test_a_skip_on_one_rank_restores_every_rank(ranks):
    results = ranks(3).run(_skip_body)
    for ((before, after), final, reads, skipped), (_, final0, reads0, skipped0), kept in results:
        assert skipped == skipped0 == 1 and reads == 3 and reads0 == 6
        (kept_before, kept_after), kept_final, _, _ = kept  # the momentum kept as its message: bitwise
        for a, b in zip(kept_before + [*kept_after, *kept_final], before + [*after, *final], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(before, after, strict=True):
            assert torch.equal(a, b)
        for a, b in zip(final, final0, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for other in results[1:]:  # the replicas stay bitwise identical
        for a, b in zip(other[0][1][:len(SHAPES)], results[0][0][1][:len(SHAPES)], strict=True):
            assert torch.equal(a, b)


def _one_tensor():
    """A 70001-element parameter's OnebitAdam, compressing from its first step, its collective
    local; and the list that counts the agreement's passes over the gradients."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(70001))
    opt = OnebitAdam([p], lr=1e-2, freeze_step=1, nonfinite="skip")
    opt.reducer().allreduce = compiled_local
    reads = count_gradient_reads(opt)
    return p, opt, reads


@pytest.fixture
def float32_momentum():
    """The momentum as a float32 buffer between fused steps (the ``message`` route off): prepare needs it."""
    with use_routes(message=False):
        yield


def test_a_loaded_momentum_is_not_restored_from_an_old_message(float32_momentum):
    # a checkpoint's load writes the momentum: the next step reads the gradients again (the
    # message it kept no longer decodes to the momentum)
    p, opt, reads = _one_tensor()
    for _ in range(3):
        p.grad = torch.randn(70001)
        opt.step()
    assert len(reads) == 2
    sd = copy.deepcopy(opt.state_dict())
    p.grad = torch.randn(70001)
    opt.step()  # the momentum moves on; then the older one comes back
    opt.load_state_dict(sd)
    p.grad = torch.randn(70001)
    p.grad[5] = float("nan")
    before = opt.reducer().decoded(opt.reducer().buckets[0]).clone()
    with pytest.warns(RuntimeWarning, match="step skipped on every rank"):
        opt.step()
    assert len(reads) == 3 and opt.skipped_steps == 1
    assert torch.equal(opt.reducer().decoded(opt.reducer().buckets[0]), before)
    assert torch.equal(before, sd["state"][0]["exp_avg"])


def test_an_unfused_step_in_between_is_not_undone_from_an_older_message(float32_momentum):
    # an unfused step writes the momentum: the fused step's message no longer decodes to it (the
    # optimizer forgets it, and the momentum's version moved), so the next skip restores nothing
    # from it and leaves the unfused step's momentum
    p, opt, _ = _one_tensor()
    flats = []
    for fused in (True, True, False, True, False):  # the last: an unfused step after a fused one
        with fused_steps(None if fused else "plain"):
            p.grad = torch.randn(70001)
            opt.step()
        flats.append(opt.reducer().decoded(opt.reducer().buckets[0]).clone())
    before, middle = flats[-2:]
    assert not torch.equal(middle, before)
    p.grad = torch.randn(70001)
    p.grad[9] = float("inf")
    with pytest.warns(RuntimeWarning, match="step skipped on every rank"):
        opt.step()
    assert opt.skipped_steps == 1 and torch.equal(opt.reducer().decoded(opt.reducer().buckets[0]), middle)


def test_a_prepare_that_raises_halfway_restores_the_momentum(float32_momentum, monkeypatch):
    # the second bucket's encode fails after the first bucket was folded: the step raises and the
    # momentum of every bucket is as it was
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = OnebitAdam(params, lr=1e-2, freeze_step=1, bucket_cap_mb=0.2, nonfinite="skip")
    red = opt.reducer()
    red.allreduce = compiled_local
    assert len(red.buckets) >= 2
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step()
    before = [red.decoded(b).clone() for b in red.buckets]
    assert opt._fused_cache.backend == "native"
    calls, encode = [], adam.NativePasses.encode_all

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("the second bucket")
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(adam.NativePasses, "encode_all", failing)
    for p in params:
        p.grad = torch.randn(p.shape)
    with pytest.raises(MemoryError):
        opt.step()
    assert len(calls) == 2
    for a, b in zip(red.buckets, before, strict=True):
        assert torch.equal(red.decoded(a), b)


@pytest.mark.parametrize("error_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("update", [True, False])
def test_the_passes_agree_at_every_isa_level_and_with_the_momentum_kept(error_dtype, update):
    # fold_encode_all and decompress_update_all in portable C, AVX2 and AVX-512 (the levels this CPU
    # has), over a float32 momentum buffer and over the same momentum kept as its message (the passes
    # decode it as they read it; the decompress pass folds the worker's u again): the same bits,
    # float64 sums, errors and parameters, bitwise; the padded rests' folded data as the buffer's; a
    # tensor without a gradient; tensors that straddle the chunks; with and without the error update
    from onebit.kernels import _chunks
    from onebit.kernels.layout import Layout, empty_message, message_bits, message_scales

    gen = torch.Generator().manual_seed(7)
    sizes, W = [30001, 7, 40000, 9], 3
    n = sum(sizes)
    layout = Layout(-(-n // (8 * W)) * 8 * W, W, None)
    splits = [_chunks.split(layout, n, j) for j in range(W)]
    enc = [mid - lo for lo, mid, _ in splits]
    fold = [max(0, min(hi, n) - lo) for lo, _, hi in splits]
    grads = [None if k == 1 else torch.randn(s, generator=gen) for k, s in enumerate(sizes)]
    variances = [torch.rand(s, generator=gen) ** 2 for s in sizes]  # the floor 0.3 binds under sqrt(v) < 0.3
    e0 = (torch.randn(layout.N, generator=gen) * 0.1).to(error_dtype)
    p0 = [torch.randn(s, generator=gen) for s in sizes]
    old = empty_message(layout, W, torch.device("cpu"))
    coin = torch.randint(0, 256, (W, layout.C // 8), generator=gen, dtype=torch.uint8)
    message_bits(old, layout).copy_(coin)
    message_scales(old, layout).copy_(torch.rand(W, generator=gen) + 0.1)
    old_pair = (message_bits(old, layout), message_scales(old, layout).contiguous())
    u0 = torch.zeros(layout.N)
    adam.NativePasses.decode(old, layout, u0[:n])  # the momentum the message holds, as a float32 buffer
    scales, wscales = torch.rand(W, generator=gen) + 0.1, torch.rand(W, generator=gen) + 0.1
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    out = {}
    for isa in range(cpu_simd.best_isa() + 1):
        for kept in (False, True):
            e, ps = e0.clone(), [x.clone() for x in p0]
            t = adam.table(starts, sizes, "cpu")
            t.fill({"grad": grads, "var": variances, "param": ps},
                   [(0.9, 0.1, 0.999, -1e-2, 0.5, 0.3, 1.25, 1e-8)] * len(sizes))
            bits = message_bits(empty_message(layout, W, torch.device("cpu")), layout)
            flat = None if kept else u0[:n].clone()
            tails = torch.full((8 * W,), float("nan")) if kept else None
            sums = adam.fold_encode_all(flat, e, bits, layout.C, enc, fold, t, isa=isa,
                                        old=old_pair if kept else None, tails=tails, n=n)
            coded = torch.cat([bits[j, : enc[j] // 8] for j in range(W)])
            rests = [(tails[8 * j : 8 * j + fold[j] - enc[j]] if kept else flat[lo + enc[j] : lo + fold[j]])
                     .clone() for j, (lo, _, _) in enumerate(splits)]
            if kept:
                adam.decompress_update_all(bits, scales, None, e, wscales, layout.C, enc, t, 0.5, isa=isa,
                                           old=old_pair, update=update)
            else:
                ee, ws = (e, wscales) if update else (None, None)
                adam.decompress_update_all(bits, scales, flat, ee, ws, layout.C, enc, t, 0.5, isa=isa)
            out[isa, kept] = [torch.tensor(sums, dtype=torch.float64), coded, e, *rests, *ps]
    assert not torch.equal(out[0, False][-1], p0[-1])  # the parameters moved
    for (isa, kept), got in out.items():
        torch.testing.assert_close(got[0], out[0, False][0], rtol=1e-12, atol=0)
        if isa == 0 or kept:  # the sums in one ISA's order: bitwise for the same level
            assert torch.equal(got[0], out[isa, False][0]), (isa, kept)
        for a, b in zip(got[1:], out[0, False][1:], strict=True):
            assert torch.equal(a, b), (isa, kept)
