"""When the variance freezes: after a fixed number of updates, or "auto" when it settles.

``freeze_step="auto"`` (or an :class:`AutoFreeze` with other settings) watches, every
``window`` warm-up updates, the SHAPE of each compressed tensor's ``sqrt(v)``: the vector
divided by its L1 norm, so that a common factor (bias correction, gradients that shrink
everywhere alike) does not count as change. A window is calm when, for every tensor, the L1
distance between this shape and the one of the previous check is at most ``tolerance``
(the distance lies in [0, 2]); after ``patience`` calm windows in a row, and no earlier than
``min_step`` updates, the variance freezes; at ``max_step`` it freezes regardless. Large
tensors are judged on a fixed set of at most ``SAMPLE`` evenly spaced coordinates, which
bounds the memory and the checkpoint size of the schedule.

Why the shape and not the norm: Adam's variance sets each coordinate's step size relative
to the others; its overall scale acts like the learning rate. While gradients keep
shrinking (a model that fits its training data), the norm of the bias-corrected variance
keeps falling like ``window / (2 t)`` per window: measured on the digits task, still 2.9%
per 25 steps at step 575 with the training loss at 0, while the shape had stopped moving
(< 0.1%) by step 200. Every rank sees the same averaged gradients and so the same variance; the
verdict is still agreed by a one-element all-reduce (MIN: freeze only when all agree), so a
rank whose arithmetic differs cannot split the group. The schedule's state (the step it
froze at, the calm count, the last statistics) is saved with the optimizer's counters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..collectives._failure import guard
from ..collectives._group import comm_device, group_size
from ..collectives.telemetry import CallTimer
from ..kernels._checks import check_int, check_number, check_order

__all__ = ["AutoFreeze", "FreezeSchedule"]

SAMPLE = 8192  # coordinates per tensor that the automatic schedule compares


@dataclass(frozen=True)
class AutoFreeze:
    """Settings of ``freeze_step="auto"`` (see the module docstring); these are the defaults."""

    window: int = 50
    tolerance: float = 0.1
    patience: int = 2
    min_step: int = 100
    max_step: int = 100_000

    def __post_init__(self) -> None:
        check_int("AutoFreeze.window", self.window, low=1)
        check_int("AutoFreeze.patience", self.patience, low=1)
        check_int("AutoFreeze.min_step", self.min_step, low=0)
        check_int("AutoFreeze.max_step", self.max_step, low=1)
        check_number("AutoFreeze.tolerance", self.tolerance, 0.0, 2.0, low_open=True)
        check_order("AutoFreeze.min_step", self.min_step, "max_step", self.max_step)


DEFAULT_FREEZE = 100000  # the reference's default freeze step: "never" for most runs


class FreezeSchedule:
    """A fixed freeze step (an int >= 1 or math.inf) or an automatic one (``"auto"``/AutoFreeze)."""

    def __init__(self, name: str, value: object) -> None:
        self.name = name
        self.auto: AutoFreeze | None = None
        self.fixed: float = math.inf
        if isinstance(value, AutoFreeze):
            self.auto = value
        elif isinstance(value, str) and value == "auto":
            self.auto = AutoFreeze()
        elif value == math.inf:
            self.fixed = math.inf
        elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"{name}: expected an int >= 1, math.inf, 'auto' or an AutoFreeze, got {value!r}"
            )
        elif value == 0:
            raise ValueError(
                f"{name}: 0 would freeze a variance that was never estimated (zero everywhere), so "
                "the first update would divide by eps; give at least 1 full-precision update (the "
                "convergence suite froze at 20% of the run) or 'auto'"
            )
        else:
            self.fixed = value
        self._frozen_at: int | None = None  # auto only
        self._calm = 0
        self._last: list[torch.Tensor] | None = None  # the shapes at the previous check (CPU)

    def __repr__(self) -> str:
        return f"{self.name}={self.auto!r}" if self.auto is not None else f"{self.name}={self.fixed!r}"

    def steps_left(self, updates: int) -> int | None:
        """Full-precision updates left before the freeze: 0 once frozen, None when unknown
        (``"auto"`` before it decided) or never (``math.inf``)."""
        if self.frozen_at(updates) is not None:
            return 0
        return None if self.auto is not None or self.fixed == math.inf else int(self.fixed) - updates

    def frozen_at(self, updates: int) -> int | None:
        """The number of full-precision updates before the freeze, once it happened."""
        if self.auto is None:
            return int(self.fixed) if updates >= self.fixed else None
        return self._frozen_at

    def observe(self, updates: int, variances: Sequence[torch.Tensor], group, counter=None) -> None:
        """After full-precision update number ``updates``, with the variance of every compressed
        tensor: decides the automatic freeze (a collective on window boundaries, counted by
        ``counter.count_sent``: the optimizer)."""
        auto = self.auto
        if auto is None or self._frozen_at is not None:
            return
        if updates >= auto.max_step:
            self._frozen_at = updates
            return
        if updates % auto.window:
            return
        shapes = [_shape(v) for v in variances]
        if self._last is not None:
            moved = [float((a - b).abs().sum()) for a, b in zip(shapes, self._last, strict=True)]
            self._calm = self._calm + 1 if max(moved, default=0.0) <= auto.tolerance else 0
        self._last = shapes
        verdict = updates >= auto.min_step and self._calm >= auto.patience
        if _agree(verdict, group, counter):
            self._frozen_at = updates

    # checkpointed with the optimizer's counters (an int or None, an int, CPU float64 tensors)
    def state(self) -> dict[str, Any]:
        return {"frozen_at": self._frozen_at, "calm": self._calm, "last": self._last}

    def load(self, state: dict[str, Any]) -> None:
        self._frozen_at, self._calm, self._last = state["frozen_at"], state["calm"], state["last"]


def _shape(v: torch.Tensor) -> torch.Tensor:
    """``sqrt(v)`` on at most SAMPLE evenly spaced coordinates, divided by its L1 norm
    (float64, CPU; all zeros stays all zeros)."""
    flat = v.detach().reshape(-1)
    step = max(1, -(-flat.numel() // SAMPLE))
    s = flat[::step].sqrt().to(device="cpu", dtype=torch.float64)
    total = float(s.sum())
    return s / total if total > 0 else s


def _agree(verdict: bool, group, counter=None) -> bool:
    """True only if every rank of ``group`` says True (a one-element MIN all-reduce)."""
    W = group_size(group)
    if W == 1:
        return verdict
    flag = torch.tensor([1 if verdict else 0], dtype=torch.int64, device=comm_device(group))
    timer = CallTimer(flag.device, None if counter is None else counter.traffic)
    with timer.stage("control"), guard("automatic freeze decision", group):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if counter is not None:
        counter.count_sent(1, 8, control=True)
    return bool(flag.item())
