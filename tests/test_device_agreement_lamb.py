"""OnebitLamb's steady compression steps agree on the device (issue 57; optimizers/_device_agreement.py,
OnebitLamb._agreement_on_device): this rank's poison (0, or NaN for a non-finite gradient) added to
``g / d`` poisons its messages and its sketches on every rank; the collective leaves the error buffers,
and the kept message, the trust-ratio sketch, the parameters and the coefficients are selected on the
device. On 2 and 3 gloo ranks, with the Triton codec (a GPU's; here under the interpreter), the C and the
plain one: bitwise the host agreement's run, skipped steps included; with the Triton codec nothing read
back in a steady step (the CPU codecs read their scales on the host, where that is no synchronisation);
the host learns of a skip at a later step. The warm-up's steps (but the first and the last) agree on the
device as well: the ranks' poisons summed there, the moments, parameters and trust-ratio EMA selected."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from helpers import ValueReads, draw_grads

from onebit.kernels.backends import use_backend
from onebit.optimizers import OnebitLamb

SHAPES = [(40, 30), (17,), (5, 7, 3), (300,)]
STEPS = 9


def _body(device_side: bool, bad_step: int | None, backend: str, freeze: int = 2):
    r = dist.get_rank()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = OnebitLamb(params, lr=1e-2, weight_decay=0.01, freeze_step=freeze)
    opt._device_agreement = device_side
    g = torch.Generator().manual_seed(100 + r)
    on_device, reads = [], []
    with use_backend(backend), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(STEPS):
            draw_grads(params, g, nan=t == bad_step and r == 1)
            with ValueReads() as counted:
                opt.step()
            # (on a CPU the variance's denominator and the sketches' C passes read their scalars: no
            # synchronisation there; a GPU's routes read none, tests/test_cuda.py)
            reads.append([w for w in counted.where if not w.startswith(("preconditioning", "sketch"))])
            on_device.append(bool(opt._pending_agreements))
        coeffs = opt.get_lamb_coeffs()
        state = opt.state_dict()  # (learns of a skip at the last step first)
        said = [str(w.message) for w in caught if "step skipped" in str(w.message)]
    errors = [e.clone() for pair in opt.reducer().errors() for e in pair]
    return {"params": [p.detach().clone() for p in params], "errors": errors,
            "exp_avg": [state["state"][k]["exp_avg"].clone() for k in range(len(SHAPES))],
            "sketch": [state["state"][k]["lamb_sketch"].clone() for k in range(len(SHAPES))],
            "coeffs": coeffs, "updates": opt.updates, "skipped": opt.skipped_steps, "on_device": on_device,
            "said": said, "reads": reads}


def _expected(freeze: int, bad_step: int | None) -> list[bool]:
    """Which steps agree on the device: the warm-up's but the first and its last (a skipped step does not
    count: the warm-up lasts one step more), the compressed ones once a message is kept."""
    out, updates, kept = [], 0, False
    for t in range(STEPS):
        out.append(t > 0 and updates + 1 < freeze if updates < freeze else kept)
        if t != bad_step:
            kept |= updates >= freeze
            updates += 1
    return out


@pytest.mark.parametrize("backend", ["triton", "native", "plain"])
@pytest.mark.parametrize("W, bad_step, freeze", [(2, None, 2), (3, 5, 2), (2, 4, 2), (3, STEPS - 1, 2),
                                                 (3, 3, 6), (2, None, 6)])
def test_lambs_agreement_on_the_device_is_bitwise_the_hosts(ranks, W, bad_step, freeze, backend):
    pool = ranks(W)
    device = pool.run(_body, True, bad_step, backend, freeze)
    host = pool.run(_body, False, bad_step, backend, freeze)
    for r, (a, b) in enumerate(zip(device, host, strict=True)):
        for key in ("params", "errors", "exp_avg", "sketch"):
            for x, y in zip(a[key], b[key], strict=True):
                assert torch.equal(x, y), (r, key)
        assert a["coeffs"] == b["coeffs"]
        assert a["updates"] == b["updates"] == STEPS - (bad_step is not None)
        assert a["skipped"] == b["skipped"] == (bad_step is not None)
        # on the device: the warm-up's steps but its first and last, and the compressed ones from the
        # second on; never on the host's
        expected = _expected(freeze, bad_step)
        assert a["on_device"] == expected, a["on_device"]
        assert not any(b["on_device"])
        for t in (t for t in range(1, STEPS) if expected[t]):  # nothing read back but earlier steps' flags
            if backend == "triton":
                assert all(w.startswith("_device_agreement") for w in a["reads"][t]), (t, a["reads"][t])
        assert any(w.startswith("_agreement") for w in b["reads"][4])  # (the host's: read back)
        said = a["said"]
        assert len(said) == (bad_step is not None and r == 0), said
        if said:
            assert "agreed on the device" in said[0]
