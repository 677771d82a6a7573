"""The non-finite agreement on the device (issue 57): OnebitAdam's steady compression step on a GPU
without a host synchronisation for it.

The host agreement (optimizers/_agreement.py) reads this rank's verdict on its gradients (``bool``),
all-reduces a count and reads it back (``int``) before any state changes: with NCCL, two or three
synchronisations per step, each making the host wait for backward before it can issue the step. Here
the verdict never leaves the device:

- this rank's gradients are checked as the host check does (a norm per tensor, summed), into a float32
  ``poison``: 0, or NaN where the sum is not finite;
- the fused worker pass adds it to every encoded value, so a poisoned rank's messages carry NaN scales;
  the collectives hand them to every rank: the server scales of every bucket are NaN on every rank
  (the server's error update already skips a non-finite received scale), so is every gathered message;
- the decompress pass already leaves the worker error as it was under a non-finite gathered scale; with
  the gate it leaves the parameters too; the momentum, kept as the last gathered message, stays the old
  message (a select on the device);
- the host learns of the skip at a later step, once the flag (copied to pinned memory after the step)
  has arrived, without waiting for it, or waits for it where the next update reads the update count (a
  bias correction), and at ``stats()``, ``state_dict()``, ``verify_ranks`` and a copy: the update count
  goes back by one, ``skipped_steps`` counts it, and group rank 0 warns, without naming the ranks (the
  messages do not say which rank poisoned them).

ZeroOneAdam's phase-1 compressed steps agree as OnebitAdam's do, in its fused Triton passes: the poison in
the worker pass, the decompress pass gated by the gathered scales (momenta, parameters and errors left as
they were) and setting the flag itself (:meth:`flag`: no message is kept, nothing to select); the host's
counters are kept before the step (``snapshot``) and put back when the skip is learnt. Its phase-1
variance steps (full precision, in Triton: ``optimizers/_fused.py`` ``VarianceStep``) agree as the
warm-up's below: the poison summed over the ranks, each bucket's moments and then the stale step of every
parameter one launch each, gated by it; the floors of the changed variance reach the fused tables on the
device (``floor_column``), never the host.

ZeroOneAdam's phase-2 steps but the first agree on the device too: the local step has no collective of its
own to carry a poison, so it is summed over the ranks on the device (``all_reduce``, nothing read back) and
the one Triton local step reads it as its gate; a synchronisation after it adds the summed poison to every
message in its fused worker pass, and its decompress pass, gated by the gathered scales, leaves the errors,
momenta, ``sync_params`` and parameters as they were. The host's counters are kept before the step
(``snapshot``) and put back when the skip is learnt, at the next step, which waits for the flag (the
counters choose its kind); a synchronisation that began at rest rests on its messages (NaN on a skip), and
the state at rest before it (``rest_before``) is put back with the counters.

The run is bitwise the host agreement's, skipped steps included (tests/test_device_agreement.py,
tests/test_device_agreement_zoa.py).
OnebitLamb's steady compression steps (its unfused step) agree with the poison added to ``g / d``: its
messages and its trust-ratio sketches are NaN on every rank, the collective leaves the errors, and the
kept message, the sketch, the parameters and the coefficients are selected on the device
(OnebitLamb._agreement_on_device); its warm-up steps as OnebitAdam's below, the moments, the parameters
and the trust-ratio EMA selected by the summed poison.

OnebitAdam's warm-up steps agree the same way as those local steps (the poison summed over the ranks, every
bucket's update one Triton launch gated by it: kernels/fused/warmup.py), all but the last (it enters
compression) and none under an automatic freeze (it reads the variance).

Where it applies: ``nonfinite="skip"`` outside a GradScaler, the fused Triton step with the momentum
kept as messages (from the second compressed step on), no ``non_freeze`` group, no cohort, no
``overlap``; OnebitAdam's warm-up steps but the last (a fixed ``freeze_step``); ZeroOneAdam's phase-1
compressed steps (a fixed ``var_freeze_step``) and its phase-2 steps but the first (the local step one
Triton launch, a synchronisation in the fused Triton passes, every group moved since the last) and its
phase-1 variance steps in Triton; OnebitLamb's preconditioned compression steps from the second on (no
mask, no clip) and its warm-up steps but the first and the last; everything else (the first compressed
step, ``nonfinite="raise"``) agrees on the host. Two differences, both on steps that the host would also
not take as they are: the ranks are not named, and a finite gradient whose norm overflows float32 (all entries
finite, their sum of squares not) skips the step
(the host check then tests every element and takes it, with non-finite values in its update).
"""

from __future__ import annotations

import torch

from . import _multi


class DeviceAgreement:
    """One step's agreement on the device (module docstring)."""

    def __init__(self, grads: list[torch.Tensor], device: torch.device) -> None:
        if grads:
            partials = torch._foreach_norm(grads) if _multi.applies(grads) else [g.sum() for g in grads]
            finite = torch.isfinite(torch.stack(partials).sum())
        else:
            finite = torch.ones((), dtype=torch.bool, device=device)
        self.poison = torch.where(finite, 0.0, float("nan")).to(device=device, dtype=torch.float32)
        self.skipped = torch.zeros((), dtype=torch.bool, device=device)
        self.snapshot: dict | None = None  # the host's counters before the step, put back on a skip
        self.rest_before = None  # ZeroOneAdam: the state at rest before a synchronisation that rested
        self._host: torch.Tensor | None = None
        self._event = None

    def keep(self, gathered: torch.Tensor, layout, old: torch.Tensor) -> torch.Tensor:
        """The message a bucket keeps as its momentum: ``gathered``, or ``old`` where a gathered scale is
        not finite (the step skipped); notes the skip."""
        from ..kernels.layout import message_scales

        fine = torch.isfinite(message_scales(gathered, layout)).all()
        self.skipped |= ~fine
        return torch.where(fine, gathered, old)

    def flag(self) -> torch.Tensor:
        """The skip flag as the gated passes set it (uint8 [1] view: 1 where a gathered scale is not
        finite), for a step that keeps no message (ZeroOneAdam's phase 1)."""
        return self.skipped.view(torch.uint8).view(1)

    def all_reduce(self, group) -> None:
        """The ranks' poisons summed on the device (no read: NCCL queues it), for a step whose update
        has no collective of its own to carry them (ZeroOneAdam's local steps): NaN where any rank's is;
        the update then reads the agreed poison as its gate, and this flag is set from it."""
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(self.poison, group=group)
        self.skipped |= torch.isnan(self.poison)

    def finish(self) -> None:
        """After the step: the flag on its way to the host (pinned memory, no wait)."""
        cuda = self.skipped.device.type == "cuda"
        self._host = torch.empty((), dtype=torch.bool, pin_memory=cuda)
        self._host.copy_(self.skipped, non_blocking=cuda)
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def arrived(self) -> bool:
        """Whether the flag is on the host (no wait)."""
        return self._event is None or self._event.query()

    def skipped_step(self) -> bool:
        """Whether the step was skipped (waits for the flag's copy, long done by the next step: no wait at
        all where it has arrived)."""
        if self._event is not None and not self._event.query():
            self._event.synchronize()
        return bool(self._host)
