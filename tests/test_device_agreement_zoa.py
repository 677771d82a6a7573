"""ZeroOneAdam's phase-2 local steps agree on the device (issue 57; optimizers/zero_one_adam.py
``_agreement_on_device``): each rank's verdict a float32 poison summed over the ranks on the device, the one
Triton local step gated by it, nothing read back; the host's counters put back when the skip is learnt at the
next step. The run is bitwise the host agreement's, skipped local steps included, on 2 and 3 gloo ranks (under
the interpreter); synchronisations agree on the host. Phase 1's compressed steps agree on the device too (the
poison in the fused passes' messages, their decompress pass gated), per bucket and in the stage; its variance
steps on the host."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from onebit.kernels.backends import use_backend
from onebit.optimizers import ZeroOneAdam, _fused

SHAPES = [(40, 30), (17,), (5, 7, 3), (300,)]
STEPS = 18


def _body(device_side: bool, bad_step: int | None, freeze: int = 4, staged: bool = True):
    r = dist.get_rank()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "lr": 3e-3}]
    opt = ZeroOneAdam(groups, lr=1e-2, var_freeze_step=freeze, var_update_scaler=1, local_step_scaler=3,
                      local_step_clipper=4, bucket_cap_mb=0.002)
    opt._device_agreement = device_side
    _fused.ZeroOneStep.STAGE = staged  # (the class attribute, in this rank's process)
    g = torch.Generator().manual_seed(100 + r)
    on_device = []
    with use_backend("triton"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(STEPS):
            for p, s in zip(params, SHAPES, strict=True):
                p.grad = torch.randn(s, generator=g)
            if t == bad_step and r == 1:
                params[2].grad.view(-1)[4] = float("nan")
            opt.step()
            on_device.append(bool(opt._pending_agreements))
        state = opt.state_dict()  # (learns of a skip at the last step first)
    said = [str(w.message) for w in caught if "step skipped" in str(w.message)]
    return {"params": [p.detach().clone() for p in params],
            "exp_avg": [state["state"][k]["exp_avg"].clone() for k in range(len(SHAPES))],
            "errors": [e.clone() for pair in opt.reducer().errors() for e in pair],
            "counters": {name: getattr(opt, name) for name in (
                "updates", "local_step_interval", "var_interval", "var_counter", "var_updates",
                "local_step_counter", "lrs", "last_sync")},
            "skipped": opt.skipped_steps, "on_device": on_device, "said": said}


# each skip case once, the world sizes alternated (odd and even both at device- and host-agreed skips)
@pytest.mark.parametrize("W, bad_step, agreed_there",
                         [(2, None, None), (3, 10, True), (2, 15, False), (3, 15, False),
                          (2, STEPS - 1, True)])
def test_zero_one_adams_local_steps_agree_on_the_device_bitwise_as_on_the_host(ranks, W, bad_step,
                                                                               agreed_there):
    # steps 8, 10, 12-14, 16, 17 are local steps alone (device); 9, 11, 15 synchronise (host)
    pool = ranks(W)
    device, host = pool.run(_body, True, bad_step), pool.run(_body, False, bad_step)
    _bitwise_alike(device, host, bad_step)
    for a in device:
        assert sum(a["on_device"]) >= 6, a["on_device"]
        if bad_step is not None:
            assert a["on_device"][bad_step] == agreed_there


def _bitwise_alike(device, host, bad_step):
    """Every rank's state and counters bitwise the host agreement's run, the skip counted and said once;
    nothing agreed on the device in the host's run."""
    for r, (a, b) in enumerate(zip(device, host, strict=True)):
        for key in ("params", "exp_avg", "errors"):
            for x, y in zip(a[key], b[key], strict=True):
                assert torch.equal(x, y), (r, key)
        assert a["counters"] == b["counters"], (a["counters"], b["counters"])
        assert a["skipped"] == b["skipped"] == (bad_step is not None)
        assert not any(b["on_device"]), b["on_device"]
        assert len(a["said"]) == (bad_step is not None and r == 0), a["said"]


def _assert_alike(device, host, bad_step, agreed_there, device_steps):
    _bitwise_alike(device, host, bad_step)
    for a in device:
        if bad_step is None:
            assert [t for t, d in enumerate(a["on_device"]) if d] == device_steps, a["on_device"]
        else:  # (a skipped step shifts the schedules by one)
            assert a["on_device"][bad_step] == agreed_there and sum(a["on_device"]) >= len(device_steps) - 1


# var_freeze_step=12, var_update_scaler=1: variance steps 1, 2, 4, 8 (host); phase 1's compressed steps 3,
# 5-7, 9-12 agree on the device (loop indices 2, 4-6, 8-11); phase 2 from step 13: its local step 17 too
PHASE_ONE_DEVICE = [2, 4, 5, 6, 8, 9, 10, 11, 16]


@pytest.mark.parametrize("W, staged, bad_step, agreed_there",
                         [(2, True, None, None), (3, False, 5, True), (2, True, 7, False),
                          (3, True, 11, True), (2, False, 11, True)])
def test_zero_one_adams_phase_one_agrees_on_the_device_bitwise_as_on_the_host(ranks, W, staged, bad_step,
                                                                              agreed_there):
    # a skip at loop index 11, the last step of phase 1: the next step learns of it before it chooses its kind
    pool = ranks(W)
    device = pool.run(_body, True, bad_step, 12, staged)
    host = pool.run(_body, False, bad_step, 12, staged)
    _assert_alike(device, host, bad_step, agreed_there, PHASE_ONE_DEVICE)
