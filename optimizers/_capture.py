"""OnebitAdam's capturable compression step (``capturable=True``, issue 57).

A CUDA graph replays the device work of the step it captured: the same launches with the same
arguments, the same collectives on the same buffers. Nothing the host computes during the step may
change between replays, and the host learns nothing of them. So, with ``capturable=True``, from the
first compression step on:

- the update count and the count of steps skipped on the device live on the device (:class:`Counts`),
  advanced by each step's own device work (a skip, agreed on the device, does not count as an update);
  the host reads them when it needs them (``stats()``, ``state_dict()``, a load, a copy: one read), not
  per step, and group rank 0 then says how many steps were skipped;
- the learning rate and the first-moment bias correction reach the fused passes through their scalar
  table, written on the device from the device step count and the group's ``lr`` (a tensor ``lr`` is
  read where it lives, so a scheduler that writes into it is followed; a float ``lr`` is the one of the
  capture, as in torch's capturable Adam): :class:`Scalars`;
- the step's messages are buffers of the step's plan, the same every step (a step's tables name them:
  the worker's, the received and the gathered, N/8 bytes each, the served segment N/(8W)): (3 + 1/W)/8,
  0.38-0.44 B per parameter at W >= 2, kept between steps (tests/test_graph_replay.py counts it);
- the momentum kept as its message is one buffer for good (kernels/fused/stage.py's keep pass);
- the telemetry's timers are off while a graph is captured (its byte counts are the captured step's).

What can be captured: the fused Triton stage's step (a GPU) from the second compression step on, with
the non-finite agreement on the device (``nonfinite="skip"``, a GPU's default) or none (``nonfinite=None``);
capturing any other step raises a ``RuntimeError`` before it changes anything.

The scalars are computed in float64 and rounded to float32 as the host computes them: bitwise the
host's on a CPU; on a GPU the device's ``pow`` may round ``b1^t`` differently in its last float64 bit.
Checked without a GPU by tests/test_graph_replay.py (the replay emulated on the CPU); with a real graph
by tests/test_cuda.py in ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import torch

from ..collectives._group import warn_collective


class Counts:
    """The update count and the steps skipped on the device, on the device (module docstring)."""

    def __init__(self, opt, device) -> None:
        self.updates = torch.tensor(opt.updates, dtype=torch.int64, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.told = 0  # skips the host has counted already

    def advance(self, agreement) -> None:
        """After a step's device work: one more update, none where the step was skipped on the device."""
        if agreement is None:
            self.updates.add_(1)
            return
        skipped = agreement.skipped.to(torch.int64)
        self.updates.add_(1).sub_(skipped)
        self.skipped.add_(skipped)

    def settle(self, opt) -> None:
        """The host's counters from the device's (one read): ``updates``, ``skipped_steps``."""
        updates, skipped = torch.stack([self.updates, self.skipped]).tolist()
        opt.updates = updates
        new, self.told = skipped - self.told, skipped
        if new:
            opt.skipped_steps += new
            warn_collective(f"onebit: {new} step(s) skipped on every rank: a non-finite gradient at a "
                            f"compression step, {updates} updates so far (agreed on the device in a "
                            "capturable step: the ranks and the steps are not named)", RuntimeWarning,
                            opt.control_group)


class Scalars:
    """The fused passes' ``decay = 1 - lr wd``, ``neg_lr = -lr`` and ``bc1`` columns (kernels/fused/adam.py
    ``SCALARS``) written on the device each step, for a table whose rows are the tensors of ``groups``
    (one group per row)."""

    COLUMNS = slice(2, 5)

    def __init__(self, groups: list[dict], device) -> None:
        self.groups = []
        for g in groups:
            if not any(g is h for h in self.groups):
                self.groups.append(g)
        index = [next(k for k, h in enumerate(self.groups) if h is g) for g in groups]
        self.index = torch.tensor(index, dtype=torch.int64, device=device)
        self.device = device

    def write(self, scal: torch.Tensor, t: torch.Tensor) -> None:
        """``scal``'s three columns for the step ``t`` (int64, on the device: this step's number)."""
        f64 = dict(dtype=torch.float64, device=self.device)
        rows = []
        for g in self.groups:
            lr = g["lr"]
            lr = lr.to(**f64) if isinstance(lr, torch.Tensor) else torch.full((), float(lr), **f64)
            wd, b1 = float(g["weight_decay"]), float(g["betas"][0])
            decay = 1.0 - lr * wd if wd else torch.ones((), **f64)
            bc1 = 1.0 - torch.pow(b1, t.to(torch.float64)) if g["bias_correction"] else torch.ones((), **f64)
            rows.append(torch.stack([decay, -lr, bc1]))
        scal[:, self.COLUMNS] = torch.stack(rows).to(torch.float32).index_select(0, self.index)


def constant_group(g: dict) -> dict:
    """``g`` with what :class:`Scalars` writes on the device set to constants (the host's table rows
    then change only where the denominators do)."""
    return {**g, "lr": 0.0, "bias_correction": False}


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
