"""ZeroOneAdam's phase-2 steps agree on the device (issue 57; optimizers/zero_one_adam.py
``_agreement_on_device``): each rank's verdict a float32 poison summed over the ranks on the device, the one
Triton local step gated by it, a synchronisation's fused passes carrying it in every message and gated by the
gathered scales, nothing read back; the host's counters (and the state at rest before a synchronisation) put
back when the skip is learnt at the next step. The run is bitwise the host agreement's, skipped local steps
and synchronisations included, on 2 and 3 gloo ranks (under the interpreter); phase 2's first step agrees on
the host. Phase 1's compressed steps agree on the device too (the poison in the fused passes' messages, their
decompress pass gated), per bucket and in the stage, and so do its variance steps (the poison summed over the
ranks, the moments' and the stale step's launches gated by it; a skip at loop index 7 is one)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from onebit.kernels.backends import use_backend, use_routes
from onebit.optimizers import ZeroOneAdam

SHAPES = [(40, 30), (17,), (5, 7, 3), (300,)]
STEPS = 18


def _stage(staged: bool):
    """ZeroOneAdam's fused steps in the stage or per bucket (the ``stage`` route)."""
    return use_routes(stage=staged)


def _body(device_side: bool, bad_step: int | None, freeze: int = 4, staged: bool = True, steps: int = STEPS):
    r = dist.get_rank()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "lr": 3e-3}]
    opt = ZeroOneAdam(groups, lr=1e-2, var_freeze_step=freeze, var_update_scaler=1, local_step_scaler=3,
                      local_step_clipper=4, bucket_cap_mb=0.002)
    opt._device_agreement = device_side
    g = torch.Generator().manual_seed(100 + r)
    on_device, kinds, rested = [], [], []
    with use_backend("triton"), _stage(staged), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(steps):
            for p, s in zip(params, SHAPES, strict=True):
                p.grad = torch.randn(s, generator=g)
            if t == bad_step and r == 1:
                params[2].grad.view(-1)[4] = float("nan")
            opt.step()
            on_device.append(bool(opt._pending_agreements))
            phase_two = opt.frozen_at is not None and opt.updates > opt.frozen_at
            kinds.append("sync" if phase_two and opt.last_sync == opt.updates else "")
            rested.append(opt._kept is not None)
        state = opt.state_dict()  # (learns of a skip at the last step first)
    said = [str(w.message) for w in caught if "step skipped" in str(w.message)]
    return {"params": [p.detach().clone() for p in params],
            "exp_avg": [state["state"][k]["exp_avg"].clone() for k in range(len(SHAPES))],
            "errors": [e.clone() for pair in opt.reducer().errors() for e in pair],
            "counters": {name: getattr(opt, name) for name in (
                "updates", "local_step_interval", "var_interval", "var_counter", "var_updates",
                "local_step_counter", "lrs", "last_sync")},
            "skipped": opt.skipped_steps, "on_device": on_device, "said": said, "kinds": kinds,
            "rested": rested}


# each skip case once, the world sizes alternated (odd and even both at device- and host-agreed skips)
@pytest.mark.parametrize("W, bad_step", [(2, None), (3, 5), (2, 8), (3, 9), (2, 4), (3, STEPS - 1)])
def test_zero_one_adams_phase_two_agrees_on_the_device_bitwise_as_on_the_host(ranks, W, bad_step):
    # var_freeze_step 4: phase 2 from loop index 4 (its first step, a synchronisation: host); synchronisations
    # at 4-7 (5-7 begin at rest), 9, 11, 15 (after local steps); the others local steps alone. Skips: 5 (a
    # sync from rest), 8 (a local step), 9 (a sync after a local step), 4 (the host's), the last step (learnt
    # at state_dict())
    pool = ranks(W)
    device, host = pool.run(_body, True, bad_step), pool.run(_body, False, bad_step)
    _bitwise_alike(device, host, bad_step)
    for a, b in zip(device, host, strict=True):
        # (read right after each step: a skip agreed on the device is learnt a step later)
        seen = [t for t in range(STEPS) if t != bad_step]
        assert [a["kinds"][t] for t in seen] == [b["kinds"][t] for t in seen], (a["kinds"], b["kinds"])
        syncs = [t for t, k in enumerate(a["kinds"]) if k]
        assert len(syncs) >= 6, a["kinds"]
        # phase 1 (its variance steps, loop indices 0, 1, 3, and its compressed step 2) and every phase-2 step
        # but the first on the device; at rest as the host's: a sync that began at rest rests, one after local
        # steps stays held until the next step
        device_steps = [t for t, d in enumerate(a["on_device"]) if d]
        first = 6 if bad_step == 4 else 5  # (the host's skip at 4: loop index 5 is phase 2's first step)
        assert device_steps == [0, 1, 2, 3, *range(first, STEPS)], (device_steps, a["kinds"], a["rested"])
        if bad_step is None:
            assert syncs == [4, 5, 6, 7, 9, 11, 15], a["kinds"]
            assert [t for t in syncs if b["rested"][t]] == syncs, b["rested"]
            assert [t for t in syncs if a["rested"][t]] == [4, 5, 6, 7], a["rested"]
        else:
            assert a["skipped"] == 1


def test_a_synchronisation_skipped_at_rest_is_learnt_by_state_dict(ranks):
    # the run's last step (loop index 6) a synchronisation that began at rest and is skipped: state_dict()
    # learns of it, puts back the state at rest before it and wakes that, bitwise the host's
    pool = ranks(3)
    device, host = pool.run(_body, True, 6, 4, True, 7), pool.run(_body, False, 6, 4, True, 7)
    _bitwise_alike(device, host, 6)
    assert all(a["on_device"][6] and a["rested"][5] for a in device), device[0]


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


# var_freeze_step=12, var_update_scaler=1: phase 1 (variance steps 1, 2, 4, 8, compressed steps 3, 5-7, 9-12:
# loop indices 0-11) agrees on the device; phase 2 from step 13 (host), then the device
PHASE_ONE_DEVICE = [*range(12), 13, 14, 15, 16, 17]


@pytest.mark.parametrize("W, staged, bad_step, agreed_there",
                         [(2, True, None, None), (3, False, 5, True), (2, True, 7, True),
                          (3, True, 11, True), (2, False, 11, True)])
def test_zero_one_adams_phase_one_agrees_on_the_device_bitwise_as_on_the_host(ranks, W, staged, bad_step,
                                                                              agreed_there):
    # a skip at loop index 11, the last step of phase 1: the next step learns of it before it chooses its kind
    pool = ranks(W)
    device = pool.run(_body, True, bad_step, 12, staged)
    host = pool.run(_body, False, bad_step, 12, staged)
    _assert_alike(device, host, bad_step, agreed_there, PHASE_ONE_DEVICE)
