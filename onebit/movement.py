"""Which coordinates still move: a check from outside the optimizer.

An optimizer can stop a coordinate silently (a mask, a zero step, a frozen variance that
never lets it move again). :class:`MovementMeter` sees it the way a user would: it keeps the
parameters at the start and at a mark (for example the step the variance froze) and reports,
among the coordinates that moved before the mark, how many never moved after it (bitwise
equal at the end to their value at the mark). Weight decay moves every coordinate, so the
count is meaningful without it. Memory: two copies of the parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["MovementMeter"]


class MovementMeter:
    """``meter = MovementMeter(model.parameters())`` before training; ``meter.mark(step)`` at
    the freeze; ``meter.report()`` at the end: ``{"marked_at", "moved_before", "stalled",
    "stalled_share"}`` (``stalled_share`` = stalled / moved_before, 0 when nothing moved)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = [p for p in params]
        self._start = [p.detach().clone() for p in self.params]
        self._mark: list[torch.Tensor] | None = None
        self.marked_at: int | None = None

    @property
    def marked(self) -> bool:
        return self._mark is not None

    def mark(self, step: int | None = None) -> None:
        """Remember the parameters now (the first call only counts)."""
        if self._mark is None:
            self._mark = [p.detach().clone() for p in self.params]
            self.marked_at = step

    def report(self) -> dict:
        if self._mark is None:
            return {"marked_at": None, "moved_before": 0, "stalled": 0, "stalled_share": 0.0}
        moved = stalled = 0
        for p, start, mark in zip(self.params, self._start, self._mark, strict=True):
            before = start != mark
            moved += int(before.sum())
            stalled += int((before & (p.detach() == mark)).sum())
        return {"marked_at": self.marked_at, "moved_before": moved, "stalled": stalled,
                "stalled_share": stalled / moved if moved else 0.0}
