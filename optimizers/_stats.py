"""What a 1-bit optimizer tells its user: ``stats()`` (counters, bytes, seconds), how far the
compression is, and the warning that a run never compressed (at ``stats()`` or at interpreter
exit). A mixin of :class:`~onebit.optimizers._base.OnebitOptimizerBase`.
"""

from __future__ import annotations

import atexit
import math
import warnings
import weakref
from typing import Any

from ..collectives._group import warn_collective
from ._freeze import DEFAULT_FREEZE
from ._memory import bytes_per_parameter


class Telemetry:
    """``stats()`` and the never-compressed warning (module docstring)."""

    def stats(self) -> dict[str, Any]:
        """Counters a user should see: updates, the stage, ``steps_to_compression`` (0 once
        compressing; None under ``"auto"`` or ``math.inf``), steps skipped for non-finite
        gradients, coordinates masked by ``auto_mask`` (as of the last time the mask was
        built), and the bytes this rank sent for this optimizer: ``bytes_compressed`` (1-bit
        all-reduces, from step() or from backward with ``overlap=True``), ``bytes_full``
        (full-precision averaging, in step() or in its DDP hook), ``bytes_control`` (the
        per-step agreement all-reduces), ``bytes_intra`` (on a 2-D mesh: the full-precision
        bytes inside the node; ``bytes_compressed`` then crosses between nodes), ``bytes_sent``
        (their sum); saved with the state.
        One-off checks (the first step's replica fingerprints, ``check=True``) are not counted.
        Time (:mod:`onebit.collectives.telemetry`): ``seconds_codec`` (encode, server reduce,
        decode), ``seconds_comm`` (the compressed calls' collectives, waiting included),
        ``seconds_full``, ``seconds_control`` (saved with the state), and each as
        ``ms_per_step_*``: per update since the previous ``stats()`` call. Memory:
        ``state_bytes_per_parameter``, the optimizer's state counted from outside as
        :func:`onebit.memory.bytes_per_parameter` counts it (every tensor reachable from the
        optimizer, parameters and gradients left out; docs/optimizers.md's table)."""
        self._resolve_device_agreement()  # a skip agreed on the device is counted by now
        out = {name: getattr(self, name) for name in self.COUNTERS}
        out.pop("freeze_state", None)
        left = self.steps_to_compression()
        out.update(stage=self.stage, frozen_at=self.frozen_at, steps_to_compression=left,
                   skipped_steps=self.skipped_steps, masked_coordinates=self.masked_coordinates,
                   floored_coordinates=self.floored_coordinates(),
                   coordinates=sum(p.numel() for p, _ in self.compressed_params()),
                   bytes_compressed=self.traffic.compressed, bytes_full=self.traffic.full,
                   bytes_control=self.traffic.control, bytes_intra=self.traffic.intra,
                   bytes_sent=self.traffic.compressed + self.traffic.full + self.traffic.control
                   + self.traffic.intra)
        out.update(self._seconds())
        if self._cohorts:  # groups added after the first update, each with its own schedule (_cohorts.py)
            out["cohorts"] = self._cohort_stats()
        out["state_bytes_per_parameter"] = bytes_per_parameter(self)
        schedule = self.schedule
        default = schedule.auto is None and schedule.fixed == DEFAULT_FREEZE
        # the reference's default freeze is what keeps this run from compressing
        if default and left and left == schedule.steps_left(self.updates) and not self._default_warned:
            self._default_warned = True
            warn_collective(self._not_compressed_message(), RuntimeWarning, self.control_group)
        return out

    def _seconds(self) -> dict[str, float]:
        """Seconds spent so far, and milliseconds per update since the previous stats() call."""
        traffic = self.traffic
        traffic.resolve()  # CUDA: waits for the events of the stages still queued
        now = {kind: getattr(traffic, f"{kind}_seconds") for kind in TIMED}
        then_updates, then = self._last_seconds
        self._last_seconds = (self.updates, now)
        steps = self.updates - then_updates
        out = {f"seconds_{kind}": now[kind] for kind in TIMED}
        for kind in TIMED:
            out[f"ms_per_step_{kind}"] = 1000.0 * (now[kind] - then.get(kind, 0.0)) / steps if steps else 0.0
        return out

    def steps_to_compression(self) -> int | None:
        """Updates left before the first compressed one: 0 once compressing (or when the next
        update compresses), None when unknown (``"auto"`` before it decided) or never."""
        return self.schedule.steps_left(self.updates)

    def _not_compressed_message(self) -> str:
        schedule, left = self.schedule, self.steps_to_compression()
        why = (f"{schedule!r} is {left} updates away" if left is not None else
               f"{schedule!r} never found the variance settled (AutoFreeze.max_step bounds the wait)")
        if schedule.auto is None and schedule.fixed == DEFAULT_FREEZE:
            why = f"{schedule.name}={DEFAULT_FREEZE} (the reference's default) is {left} updates away"
        return (f"onebit: {type(self).__name__} has sent full-precision gradients at every one of its "
                f"{self.updates} update(s) and compressed none: {why}, so this run trains (and costs) as "
                f"plain data parallelism. Set {schedule.name} to about 20% of the run (the convergence "
                f"suite's choice) or 'auto'; opt.stats()['steps_to_compression'] counts down to it")

    def _never_compressed(self) -> bool:
        """True when this optimizer stepped on more than one rank and never sent a compressed byte,
        though its schedule would compress some day (not ``math.inf``)."""
        never = self.schedule.auto is None and self.schedule.fixed == math.inf
        return self.world_size > 1 and self.updates > 0 and self.traffic.compressed == 0 and not never


TIMED = ("codec", "comm", "full", "control")  # stats()'s seconds_* and ms_per_step_* (see telemetry)
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every 1-bit optimizer alive (OnebitOptimizerBase adds itself)


@atexit.register
def say_never_compressed() -> None:
    """At the end of training (interpreter exit; callable earlier): every live 1-bit optimizer
    that stepped and never compressed says so once, on its group's rank 0 (no collective: the
    counters are the same on every rank)."""
    for opt in list(_LIVE):
        if opt._never_compressed() and not opt._default_warned:
            opt._default_warned = True
            if opt._group_rank == 0:
                warnings.warn(opt._not_compressed_message(), RuntimeWarning, stacklevel=1)
