"""The non-finite agreement on the device (issue 57; optimizers/_device_agreement.py): OnebitAdam's
steady compression step on the fused Triton path (here under the interpreter, on 2 and 3 gloo ranks)
agrees without reading anything back: a NaN gradient on one rank poisons its messages' scales, every
rank's decompress pass leaves the error and the parameters, and the momentum keeps its old message.
The run is bitwise the host agreement's, skipped steps included, with and without bias correction; the
host learns of the skip at the next step (or at ``stats()``). The warm-up's steps (but its last) agree on the
device too: the ranks' poisons summed on the device, each bucket's update one Triton launch gated by them."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from helpers import draw_grads

from onebit.kernels.backends import use_backend
from onebit.optimizers import OnebitAdam

SHAPES = [(40, 30), (17,), (5, 7, 3), (300,)]
STEPS = 9


def _body(device_side: bool, bad_step: int | None, bias_correction: bool, stats_after_bad: bool,
          freeze: int = 2):
    r = dist.get_rank()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = OnebitAdam(params, lr=1e-2, weight_decay=0.01, freeze_step=freeze, bias_correction=bias_correction,
                     bucket_cap_mb=0.004)  # several buckets
    opt._device_agreement = device_side
    g = torch.Generator().manual_seed(100 + r)
    on_device, said, skipped_seen = [], [], None
    with use_backend("triton"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(STEPS):
            draw_grads(params, g, nan=t == bad_step and r == 1)
            opt.step()
            on_device.append(bool(opt._pending_agreements))
            if t == bad_step and stats_after_bad:
                skipped_seen = opt.stats()["skipped_steps"]
        state = opt.state_dict()  # (learns of a skip at the last step first)
        said = [str(w.message) for w in caught if "step skipped" in str(w.message)]
    errors = [e.clone() for pair in opt.reducer().errors() for e in pair]
    return {"params": [p.detach().clone() for p in params], "errors": errors,
            "exp_avg": [state["state"][k]["exp_avg"].clone() for k in range(len(SHAPES))],
            "updates": opt.updates, "skipped": opt.skipped_steps, "on_device": on_device, "said": said,
            "skipped_seen": skipped_seen}


def _bitwise_alike(device, host, bad_step):
    """Every rank's state bitwise the host agreement's run, the same update and skip counts."""
    for r, (a, b) in enumerate(zip(device, host, strict=True)):
        for key in ("params", "errors", "exp_avg"):
            for x, y in zip(a[key], b[key], strict=True):
                assert torch.equal(x, y), (r, key)
        assert a["updates"] == b["updates"] == STEPS - (bad_step is not None)
        assert a["skipped"] == b["skipped"] == (bad_step is not None)


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("bad_step, bias_correction",
                         [(None, False), (5, False), (5, True), (STEPS - 1, True)])
def test_the_agreement_on_the_device_is_bitwise_the_hosts(ranks, W, bad_step, bias_correction):
    pool = ranks(W)
    stats_after = bad_step == 5 and not bias_correction
    device = pool.run(_body, True, bad_step, bias_correction, stats_after)
    host = pool.run(_body, False, bad_step, bias_correction, stats_after)
    _bitwise_alike(device, host, bad_step)
    for r, (a, b) in enumerate(zip(device, host, strict=True)):
        # on the device: the first warm-up step (not the last), then from the second compressed step on (kept
        # messages); never on the host's
        assert a["on_device"] == [True] + [False] * 2 + [True] * (STEPS - 3) and not any(b["on_device"])
        if stats_after:
            assert a["skipped_seen"] == b["skipped_seen"] == 1
        said = a["said"]
        assert len(said) == (bad_step is not None and r == 0), said
        if said:
            assert "agreed on the device" in said[0]


@pytest.mark.parametrize("W, bad_step, bias_correction, agreed_there",
                         [(2, None, True, None), (3, 2, False, True), (2, 3, True, True),
                          (3, 5, True, False)])
def test_the_warm_ups_agreement_on_the_device_is_bitwise_the_hosts(ranks, W, bad_step, bias_correction,
                                                                     agreed_there):
    # freeze_step=6: warm-up steps 1-5 on the device, 6 (it enters compression) on the host; a skip at
    # loop index 5 is then learnt on the host, one at index 3 at the start of step 5 (the update count
    # decides the freeze and the bias corrections: it waits for the flag)
    pool = ranks(W)
    device = pool.run(_body, True, bad_step, bias_correction, False, 6)
    host = pool.run(_body, False, bad_step, bias_correction, False, 6)
    _bitwise_alike(device, host, bad_step)
    for r, (a, b) in enumerate(zip(device, host, strict=True)):
        assert not any(b["on_device"])
        if bad_step is None:
            assert a["on_device"] == [True] * 5 + [False] * 2 + [True] * (STEPS - 7), a["on_device"]
        else:
            assert a["on_device"][bad_step] == agreed_there, a["on_device"]
        assert len(a["said"]) == (bad_step is not None and r == 0), a["said"]


def _body_load_after_skip():
    r = dist.get_rank()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = OnebitAdam(params, lr=1e-2, freeze_step=2, bucket_cap_mb=0.004)
    opt._device_agreement = True
    g = torch.Generator().manual_seed(100 + r)
    with use_backend("triton"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        saved = opt.state_dict()  # 5 updates
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        params[0].grad.view(-1)[0] = float("nan") if r == 1 else 0.0
        opt.step()  # skipped on the device: pending until a later call
        opt.load_state_dict(saved)
        stats = opt.stats()  # (learns of whatever is pending)
    return stats["updates"], stats["skipped_steps"]


def test_a_skip_pending_at_a_load_belongs_to_the_state_replaced(ranks):
    for updates, skipped in ranks(2).run(_body_load_after_skip):
        assert (updates, skipped) == (5, 0)
