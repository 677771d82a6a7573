"""OnebitAdam's fused Triton compression step over every bucket at once (kernels/fused/stage.py, issue 57):
one launch per pass whatever the bucket count, bitwise the per-bucket launches (the ``stage`` route off),
here under the interpreter on 2 and 3 gloo ranks: float32 and bfloat16 errors, tensors of odd sizes
across bucket boundaries, weight decay, bias correction, an update clip, a skipped step agreed on the
device and on the host."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from onebit.kernels.backends import use_backend, use_routes
from onebit.kernels.triton_kernels import Launch
from onebit.optimizers import OnebitAdam, ZeroOneAdam

SHAPES = [(40, 30), (17,), (5, 7, 3), (300,), (3,), (257,)]
STEPS = 8


def _run(stage: bool, error_dtype, device_side: bool, bad_step, cap_mb: float, count_from: int = 99):
    r = dist.get_rank()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = OnebitAdam(params, lr=1e-2, weight_decay=0.01, freeze_step=2, bias_correction=True,
                     update_clip=0.5, bucket_cap_mb=cap_mb, error_dtype=error_dtype)
    opt._device_agreement = device_side
    g = torch.Generator().manual_seed(100 + r)
    launches: list[list[str]] = []
    calls = Launch.__call__

    def counted(self):
        launches[-1].append(self.name)
        calls(self)

    try:
        with use_backend("triton"), use_routes(stage=stage):
            for t in range(STEPS):
                for p, s in zip(params, SHAPES, strict=True):
                    p.grad = torch.randn(s, generator=g)
                if t == bad_step and r == W_BAD:
                    params[2].grad.view(-1)[4] = float("nan")
                launches.append([])
                Launch.__call__ = counted if t >= count_from else calls
                opt.step()
                Launch.__call__ = calls
            state = opt.state_dict()
    finally:
        Launch.__call__ = calls
    plan = opt._fused_plan(opt.reducer())
    return {"params": [p.detach().clone() for p in params],
            "errors": [e.clone() for pair in opt.reducer().errors() for e in pair],
            "exp_avg": [state["state"][k]["exp_avg"].clone() for k in range(len(SHAPES))],
            "skipped": opt.skipped_steps, "buckets": len(opt.reducer().buckets),
            "launches": launches, "scratch": plan.scratch is not None}


W_BAD = 1


# each case on one world size, odd and even alternated (each dtype and each agreement on both)
@pytest.mark.parametrize("W, error_dtype, device_side, bad_step", [
    (3, torch.bfloat16, False, None), (2, torch.float32, False, 5), (3, torch.bfloat16, True, 5),
    (2, torch.float32, True, None), (3, torch.float32, True, 5)])
def test_the_stage_is_bitwise_the_per_bucket_passes(ranks, W, error_dtype, device_side, bad_step):
    pool = ranks(W)
    staged = pool.run(_run, True, error_dtype, device_side, bad_step, 0.0015)
    alone = pool.run(_run, False, error_dtype, device_side, bad_step, 0.0015)
    assert staged[0]["buckets"] >= 3
    for r, (a, b) in enumerate(zip(staged, alone, strict=True)):
        for key in ("params", "errors", "exp_avg"):
            for x, y in zip(a[key], b[key], strict=True):
                assert torch.equal(x, y), (r, key)
        assert a["skipped"] == b["skipped"] == (bad_step is not None)
        assert not a["scratch"]  # the kept messages are decoded inside the passes: no float32 scratch
    # the run moved: the parameters are not where they started
    torch.manual_seed(0)
    start = [torch.randn(s) for s in SHAPES]
    assert all(not torch.equal(p, s) for p, s in zip(staged[0]["params"], start, strict=True))


@pytest.mark.parametrize("device_side", [False, True])
def test_launches_per_step_do_not_grow_with_the_buckets(ranks, device_side):
    pool = ranks(2)
    counts = {}
    for cap in (1.0, 0.0015, 0.0005):  # one bucket, then more and more
        out = pool.run(_run, True, torch.bfloat16, device_side, None, cap, 4)[0]
        steady = out["launches"][4:]
        assert all(s == steady[0] for s in steady), steady
        counts[out["buckets"]] = steady[0]
    assert min(counts) == 1 and max(counts) >= 5, counts
    expected = [f"stage_fold_worker[POISON={device_side},EBF16=True]",
                "stage_server[UPDATE=False,EBF16=True]", "stage_server[UPDATE=True,EBF16=True]",
                f"stage_decompress_update[GATE={device_side},EBF16=True]",
                f"stage_keep[GATE={device_side}]"]  # the kept messages' buffers (tests/test_graph_replay.py)
    assert all(c == expected for c in counts.values()), counts


def _zoa(stage: bool, error_dtype, cap_mb: float, count_from: int = 99):
    r = dist.get_rank()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    groups = [{"params": params[:3], "weight_decay": 0.1},
              {"params": params[3:], "lr": 3e-3, "betas": (0.8, 0.99)}]
    # phase 1 to step 8 (variance steps at 1, 2, 4, 8: the others compressed), then phase 2: local steps
    # and synchronisations
    opt = ZeroOneAdam(groups, lr=1e-2, var_freeze_step=8, var_update_scaler=1, local_step_scaler=2,
                      local_step_clipper=4, bucket_cap_mb=cap_mb, error_dtype=error_dtype)
    g = torch.Generator().manual_seed(300 + r)
    launches: list[list[str]] = []
    calls = Launch.__call__

    def counted(self):
        launches[-1].append(self.name)
        calls(self)

    try:
        with use_backend("triton"), use_routes(stage=stage):
            for t in range(16):
                for i, p in enumerate(params):
                    p.grad = None if (t == 7 and i == 1) else torch.randn(p.shape, generator=g)
                launches.append([])
                Launch.__call__ = counted if t >= count_from else calls
                opt.step()
                Launch.__call__ = calls
            opt._wake()
    finally:
        Launch.__call__ = calls
    return {"params": [p.detach().clone() for p in params],
            "exp_avg": [opt.state[p]["exp_avg"].clone() for p in params],
            "errors": [e.clone() for pair in opt.reducer().errors() for e in pair],
            "buckets": len(opt.reducer().buckets), "launches": launches}


@pytest.mark.parametrize("W, error_dtype", [(2, torch.float32), (3, torch.bfloat16)])
def test_zero_one_adams_stage_is_bitwise_its_per_bucket_passes(ranks, W, error_dtype):
    # phase 1's compressed steps and phase 2's synchronisations (ZeroOneSync) over every bucket at once
    pool = ranks(W)
    staged, alone = pool.run(_zoa, True, error_dtype, 0.0015), pool.run(_zoa, False, error_dtype, 0.0015)
    assert staged[0]["buckets"] >= 3
    for r, (a, b) in enumerate(zip(staged, alone, strict=True)):
        for key in ("params", "exp_avg", "errors"):
            for x, y in zip(a[key], b[key], strict=True):
                assert torch.equal(x, y), (r, key)


def test_zero_one_adams_launches_do_not_grow_with_the_buckets(ranks):
    pool = ranks(2)
    counts = {}
    for cap in (1.0, 0.0005):
        out = pool.run(_zoa, True, torch.bfloat16, cap, 0)[0]
        counts[out["buckets"]] = out["launches"]
    assert min(counts) == 1 and max(counts) >= 5, counts
    one, many = counts[min(counts)], counts[max(counts)]
    assert one == many, counts  # step by step the same launches
    server = ["stage_server[UPDATE=False,EBF16=True]", "stage_server[UPDATE=True,EBF16=True]"]
    phase1 = ["stage_zoa_worker[SYNC=False,EBF16=True,POISON=False]", *server,
              "stage_zoa_step[SYNC=False,FMA=True,EBF16=True,GATE=False]"]
    sync = ["stage_zoa_worker[SYNC=True,EBF16=True,POISON=False]", *server,
            "stage_zoa_step[SYNC=True,FMA=True,EBF16=True,GATE=False]"]  # after the step's local step
    # the step after a synchronisation first wakes the state it left at rest (ZeroOneAdam._wake)
    local = "zoa_local[GATE=False]"
    assert one.count(phase1) >= 3 and one.count([local, *sync]) >= 2, one
    assert one.count(["stage_zoa_wake", local]) >= 2, one
    woken = ["stage_zoa_wake", local]
    variance = ["zoa_moments[GATE=False]", local]  # phase 1's variance steps: two launches, buckets or none
    assert one.count(variance) == 4, one
    kinds = (variance, phase1, sync, [local], [local, *sync], woken, [*woken, *sync])
    assert all(step in kinds for step in one), one
