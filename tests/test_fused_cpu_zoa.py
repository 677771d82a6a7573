"""ZeroOneAdam's phase-1 compressed steps with the fold and the stale step inside the CPU codec's
C passes (onebit.kernels.fused.zero_one, onebit.optimizers._fused) against the unfused steps: two
parameter groups with their own lr, betas and weight decay, a parameter without a gradient in one
step, several buckets whose tensors straddle the chunks, sizes not a multiple of 8, variance steps in
between; locally (W = 1's whole compute) and on 3 gloo ranks; a skipped step on one rank."""

from __future__ import annotations

import pytest
import torch
from helpers import addcmul_fuses, compiled_local, count_gradient_reads, fused_steps

from onebit.kernels import cpu_simd  # noqa: F401  (read by the skip condition)
from onebit.optimizers import ZeroOneAdam, _fused

pytestmark = pytest.mark.skipif("not cpu_simd.available()", reason="no C passes on this CPU")

SHAPES = [(37, 5), (9000,), (3,), (64, 17), (70001,), (301, 300)]
STEPS = 12  # variance steps at t = 1, 2, 4, 8 (var_update_scaler=1), compressed steps between




def _train(fused: bool, rank: int = 0, local: bool = True, bad=None):
    """STEPS steps; ``bad``: (step, rank) with an infinite gradient. Returns the parameters,
    momenta, error buffers, whether each step was fused, the states around the bad step and how
    often the agreement read the gradients."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    groups = [{"params": params[:2], "weight_decay": 0.1},
              {"params": params[2:], "lr": 3e-3, "betas": (0.8, 0.99)}]
    opt = ZeroOneAdam(groups, lr=1e-2, var_freeze_step=10**6, var_update_scaler=1, bucket_cap_mb=0.2)
    red = opt.reducer()
    if local:
        red.allreduce = compiled_local
    reads = count_gradient_reads(opt)
    used, around = [], []

    def state():
        return [t.detach().clone() for t in params + [opt.state[p]["exp_avg"] for p in params]
                + [b.flat for b in red.buckets] + [e for pair in red.errors() for e in pair]]

    with fused_steps(None if fused else "plain"):
        g = torch.Generator().manual_seed(1000 + rank)
        for step in range(STEPS):
            for i, p in enumerate(params):
                p.grad = None if (step == 5 and i == 2) else torch.randn(p.shape, generator=g)
            if bad is not None and step == bad[0] and rank == bad[1]:
                params[4].grad[77] = float("inf")
            pairs = opt.compressed_params()
            used.append(opt._compresses_gradients() and _fused.zoa_applies(opt, red, pairs))
            if bad is not None and step == bad[0]:
                around.append(state())
                with pytest.warns(RuntimeWarning, match="step skipped on every rank"):
                    opt.step()
            else:
                opt.step()
            if bad is not None and step == bad[0]:
                around.append(state())
    return state(), used, around, len(reads), opt.skipped_steps


def _compare(fused, plain) -> None:
    from onebit.kernels.cpu_fused import MIN_NUMEL

    (s1, used1, _, _, _), (s0, used0, _, _, _) = fused, plain
    assert used1 == [False, False, True, False, True, True, True, False, True, True, True, True]
    assert not any(used0)
    n = len(SHAPES)
    for k, (a, b) in enumerate(zip(s1, s0, strict=True)):
        assert a.isfinite().all(), k
        if k >= 2 * n or (k >= n and addcmul_fuses()) or (k < n and a.numel() >= MIN_NUMEL):
            # the accumulators (zero), the errors; the momenta where torch's addcmul_ is an FMA;
            # the parameters where the unfused step runs cpu_fused's compiled stale step
            assert torch.equal(a, b), k
        else:  # the plain ops' p.add_(update, alpha=-lr): another rounding
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_matches_unfused_locally():
    _compare(_train(True), _train(False))


def _ranks_body():
    import torch.distributed as dist

    rank = dist.get_rank()
    return _train(True, rank, local=False), _train(False, rank, local=False)


def test_fused_matches_unfused_on_three_ranks(ranks):
    results = ranks(3).run(_ranks_body)
    for fused, plain in results:
        _compare(fused, plain)
    for other in results[1:]:  # the replicas' parameters and momenta stay bitwise identical
        for a, b in zip(other[0][0][: 2 * len(SHAPES)], results[0][0][0][: 2 * len(SHAPES)], strict=True):
            assert torch.equal(a, b)


def test_a_skipped_compressed_step_changes_nothing():
    # step 5 is a compressed step: its worker pass runs before the agreement and the agreement
    # reads the messages' scales (no pass over the gradients); the skip leaves every parameter,
    # momentum, accumulator and error buffer bitwise as it was
    final, used, (before, after), reads, skipped = _train(True, bad=(5, 0))
    assert skipped == 1 and used[5]
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)
    final0, _, _, reads0, skipped0 = _train(False, bad=(5, 0))
    assert skipped0 == 1 and reads0 == STEPS and reads == STEPS - sum(used)
    for a, b in zip(final, final0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sync", [False, True], ids=["phase 1", "sync"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_the_passes_agree_at_every_isa_level(wd, sync):
    # zoa_encode_all and zoa_step_all in portable C (fmaf), AVX2 and AVX-512: the same bits, errors,
    # momenta and parameters, bitwise (the float64 sums: exact squares added in each ISA's order);
    # a tensor without a gradient; with and without the error update; a bfloat16 error read and stored
    # run by run in the passes: bitwise the float32 passes on the widened error, then rounded as
    # onebit.kernels.rounding stores it (what the collective did around the passes before)
    from onebit.kernels import _chunks
    from onebit.kernels.fused import zero_one
    from onebit.kernels.layout import Layout, empty_message, message_bits
    from onebit.kernels.rounding import WORKER, narrow_plain

    gen = torch.Generator().manual_seed(5)
    sizes, W = [30001, 7, 40000], 3
    n = sum(sizes)
    layout = Layout(-(-n // (8 * W)) * 8 * W, W, None)
    splits = [_chunks.split(layout, n, j) for j in range(W)]
    grads = [torch.randn(s, generator=gen) for s in sizes]
    variances = [torch.rand(s, generator=gen) ** 2 for s in sizes]  # the floor 0.3 binds under sqrt(v) < 0.3
    e0 = (torch.randn(layout.N, generator=gen) * 0.1).bfloat16().float()  # exact in bfloat16 too
    m0, p0 = [torch.randn(s, generator=gen) for s in sizes], [torch.randn(s, generator=gen) for s in sizes]
    sync0 = [x + 0.01 * torch.randn(x.shape, generator=gen) for x in p0]  # the last sync's parameters
    scales, wscales = torch.rand(W, generator=gen) + 0.1, torch.rand(W, generator=gen) + 0.1
    nl = -0.05
    out = {}
    for isa in range(cpu_simd.best_isa() + 1):
        for update in (True, False):
            for dtype in (torch.float32, torch.bfloat16):
                e, flat = e0.to(dtype, copy=True), torch.zeros(n)
                ms, ps = [x.clone() for x in m0], [x.clone() for x in p0]
                t = zero_one.table([0, sizes[0], sizes[0] + sizes[1]], sizes, "cpu")
                first = ([x.clone() for x in sync0] if sync else
                         [None if k == 1 else grads[k] for k in range(3)])
                t.fill({"grad": first, "var": variances, "param": ps, "momentum": ms},
                       [(0.9, 0.1, wd, -1e-2, nl, 0.3, 1.25, 1e-8)] * 3)
                bits = message_bits(empty_message(layout, W, torch.device("cpu")), layout)
                enc = [mid - lo for lo, mid, _ in splits]
                fold = [max(0, min(hi, n) - lo) for lo, _, hi in splits]
                sums = zero_one.zoa_encode_all(flat, e, bits, layout.C, enc, fold, t, isa=isa, sync=sync)
                coded = torch.cat([bits[j, : enc[j] // 8] for j in range(W)])
                ee, ws = (e, wscales) if update else (None, None)
                zero_one.zoa_step_all(bits, scales, ee, ws, layout.C, enc, t, 0.5, isa=isa, sync=sync)
                out[isa, update, dtype] = [torch.tensor(sums, dtype=torch.float64), coded, e, *ms, *ps,
                                           *(first if sync else [])]
    for (isa, update, dtype), got in out.items():
        want = out[0, update, torch.float32]
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0)
        if dtype == torch.bfloat16:  # the float32 error rounded as the collective stores it
            rounded = narrow_plain(want[2], wscales, layout.C, WORKER) if update else e0.bfloat16()
            got, want = got[:2] + got[3:], want[:2] + want[3:]
            stored = out[isa, update, dtype][2]
            covered = torch.cat([torch.arange(j * layout.C, j * layout.C + enc[j]) for j in range(W)])
            assert torch.equal(stored[covered].view(torch.int16), rounded[covered].view(torch.int16)), isa
        for a, b in zip(got[1:], want[1:], strict=True):
            assert torch.equal(a, b), (isa, update, dtype)


def _phase_two(fused: bool, rank: int = 0, local: bool = True):
    """Phase 1 for 4 updates, then local steps with syncs at t = 5, 6, 8, 10, 12, ... (the interval
    1, then 2): the state after 16 steps and how many syncs ran fused."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    groups = [{"params": params[:2], "weight_decay": 0.1},
              {"params": params[2:], "lr": 3e-3, "betas": (0.8, 0.99)}]
    opt = ZeroOneAdam(groups, lr=1e-2, var_freeze_step=4, var_update_scaler=1, local_step_scaler=2,
                      local_step_clipper=2, bucket_cap_mb=0.2)
    red = opt.reducer()
    if local:
        red.allreduce = compiled_local
    synced = []
    step = _fused.ZeroOneSync.step
    try:
        _fused.ZeroOneSync.step = lambda self, *a: synced.append(1) or step(self, *a)
        g = torch.Generator().manual_seed(1000 + rank)
        for _ in range(16):
            with fused_steps(None if fused or opt.phase == 1 else "plain"):  # phase 1 the same in both runs
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g)
                opt.step()
    finally:
        _fused.ZeroOneSync.step = step
    opt._wake()  # at rest after a sync: the momentum and sync_params made as the next step would
    state = [t.detach().clone() for t in params + [opt.state[p][k] for k in ("exp_avg", "sync_params")
                                                   for p in params]
             + [red.decoded(b) for b in red.buckets] + [e for pair in red.errors() for e in pair]]
    return state, len(synced), opt.phase


def test_phase_two_syncs_fused_match_unfused_bitwise():
    # the syncs' operations are the unfused step's (p - sync, the error, mean * d / -lrs, sync +
    # mean, p = sync): parameters, momenta, sync points, accumulators and errors bitwise
    (s1, n1, phase), (s0, n0, _) = _phase_two(True), _phase_two(False)
    assert phase == 2 and n1 >= 5 and n0 == 0
    for k, (a, b) in enumerate(zip(s1, s0, strict=True)):
        assert torch.equal(a, b), k


def _phase_two_body():
    import torch.distributed as dist

    return _phase_two(True, dist.get_rank(), local=False)


def test_phase_two_syncs_leave_the_replicas_identical(ranks):
    results = ranks(3).run(_phase_two_body)
    for _, synced, phase in results:
        assert phase == 2 and synced >= 5
    for other in results[1:]:  # after the last sync (step 16): parameters, momenta and sync points
        for a, b in zip(other[0][: 3 * len(SHAPES)], results[0][0][: 3 * len(SHAPES)], strict=True):
            assert torch.equal(a, b)
