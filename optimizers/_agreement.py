"""What every rank of a 1-bit optimizer's group must agree on before an update: the same
starting weights (the first step's replica fingerprints), the same optimizer, shapes, stage and
counters (``verify_ranks``, ``step(check=True)``), finite gradients on every rank (the
non-finite check, one all-reduce per step), and a word when a rank resumed from another rank's
state. A mixin of :class:`~onebit.optimizers._base.OnebitOptimizerBase`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..collectives._failure import guard
from ..collectives._group import comm_device, gather_json, warn_collective, warn_user
from ..collectives.telemetry import CallTimer
from . import _multi


class Agreement:
    """Replica, rank and gradient agreement (module docstring)."""

    def _verify_first_replicas(self) -> None:
        """Before this optimizer's first update (also after a resume): every rank must hold the
        same parameters, or the 1-bit updates (identical on every rank) keep them apart forever.
        One fingerprint all-gather (16 bytes per tensor); ReplicaMismatchError on every rank."""
        from ..collectives.replicas import ReplicaMismatchError, verify_replicas

        named = [(f"param_groups[{i}]['params'][{j}]", p)
                 for i, group in enumerate(self.param_groups) for j, p in enumerate(group["params"])]
        try:
            verify_replicas(named, self.process_group)
        except ReplicaMismatchError as e:
            raise ReplicaMismatchError(
                f"step: before {type(self).__name__}'s first update the ranks hold different "
                f"parameters ({e}). Every rank must start from the same weights: seed every rank alike "
                "before building the model (torch.manual_seed), load the same checkpoint on every rank, "
                "or broadcast rank 0's (DistributedDataParallel does that when it wraps the model)") from e

    def _describe(self) -> dict[str, Any]:
        self._resolve_device_agreement()
        params = [p for g in self.param_groups for p in g["params"]]
        return {
            "optimizer": type(self).__name__,
            "world size": self.world_size,
            "parameters": [[list(p.shape), str(p.dtype).removeprefix("torch.")] for p in params],
            "stage": self.stage,
            "counters": {name: getattr(self, name) for name in self.COUNTERS if name != "freeze_state"},
            "frozen_at": self.frozen_at,
            "bucket_cap_mb": self.bucket_cap_mb,
            "nonfinite": self.nonfinite,
            "auto_mask": self.auto_mask,
            "compression": self.compression,
            "variance_floor": self.variance_floor,
            "update_clip": self.update_clip,
            "block": self.block,
            "freeze": repr(self.schedule),
            "cohorts": [[c.stage, {n: getattr(c, n) for n in c.COUNTERS if n != "freeze_state"}]
                        for c in self._cohorts],
        }

    def verify_ranks(self) -> None:
        """Raise ValueError on every rank unless all ranks of the group have the same
        optimizer, parameter shapes and dtypes, schedule stage and counters (a collective:
        two small all-gathers). ``step(check=True)`` calls it first."""
        if self.world_size == 1:
            return
        table = gather_json(self._describe(), self.process_group, "check")
        me = dist.get_rank(self.process_group)
        for r, desc in enumerate(table):
            if desc != table[0]:
                raise ValueError(
                    f"check: group rank {r} disagrees with group rank 0: {_difference(desc, table[0])} "
                    f"(this is group rank {me})"
                )

    def _local_gradients_finite(self) -> bool:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        return self._grads_finite(grads)

    @staticmethod
    def _grads_finite(grads: list) -> bool:
        if not grads:
            return True
        # A finite sum proves every element finite (NaN and inf propagate); one read per
        # gradient, several times cheaper than isfinite().all(). Only when the sum is not
        # finite (a non-finite element, or a float32 overflow of huge finite values) does
        # the exact elementwise test decide.
        # On a GPU one multi-tensor norm replaces a launch per gradient (the same verdict: a
        # finite norm proves every element finite; an overflow falls to the exact test).
        partials = torch._foreach_norm(grads) if _multi.applies(grads) else [gr.sum() for gr in grads]
        if bool(torch.isfinite(torch.stack(partials).sum())):
            return True
        return all(bool(torch.isfinite(gr).all()) for gr in grads)

    def _gradients_usable(self, local: bool | None = None) -> bool:
        """Agree over the group whether every rank's gradients are finite (one single-element
        all-reduce and a host sync); on any non-finite gradient, every rank skips or raises
        before touching any state. ``local``: this rank's verdict where the step's first phase
        found it (None: a pass over the gradients finds it here)."""
        foreign = self._foreign_state
        if self.nonfinite is None or self._grads_verified:
            if foreign:  # no agreement this step: each rank that loaded a foreign state says so
                self._say_foreign_state(None)
            return True
        ok = self._local_gradients_finite() if local is None else local
        control, size = self.control_group, self._control_size()
        if size == 1:
            bad = [] if ok else [0]
            if foreign:
                self._say_foreign_state(1)
        else:
            # One single-element all-reduce in the common case (gloo: ~4x faster than one of
            # W elements or an all-gather); only when some rank is bad, a second one names them.
            # Bits 32 and up count the ranks that loaded another rank's state since their last
            # step (said once for the group, on rank 0).
            device, group = comm_device(control), control
            count = torch.tensor([(0 if ok else 1) + (int(foreign) << 32)], dtype=torch.int64, device=device)
            with CallTimer(device, self.traffic).stage("control"), guard("non-finite gradient check", group):
                dist.all_reduce(count, group=group)
            self.count_sent(1, 8, control=True)
            total = int(count)
            if total >> 32:
                self._say_foreign_state(total >> 32)
            bad = []
            if total & 0xFFFFFFFF:
                flags = torch.zeros(size, dtype=torch.int64, device=device)
                flags[dist.get_rank(group)] = 0 if ok else 1
                timer = CallTimer(device, self.traffic)
                with timer.stage("control"), guard("non-finite gradient check", group):
                    dist.all_reduce(flags, group=group)
                self.count_sent(size, 8, control=True)
                bad = flags.nonzero().flatten().tolist()
        if not bad:
            return True
        what = (f"non-finite gradient on group rank(s) {bad} at the {self.stage} step after "
                f"{self.updates} updates")
        if self.nonfinite == "raise":
            raise FloatingPointError(f"step: {what}; no parameter or state was changed on any rank")
        self.skipped_steps += 1
        warn_collective(f"onebit: step skipped on every rank: {what}", RuntimeWarning, control)
        return False

    def _say_foreign_state(self, ranks: int | None) -> None:
        """Warn that ``ranks`` ranks (None: this rank, without an agreement) resumed from a state
        that another rank, world size or bucket layout saved."""
        self._foreign_state = False
        who = f"rank {self._rank()}" if ranks is None else f"{ranks} of {self.world_size} ranks"
        message = (f"onebit: {who} loaded an optimizer state saved by another rank, world size or "
                   "bucket layout, so their error-feedback buffers started from zero and the run did not "
                   "resume exactly. Save one state per rank with onebit.checkpoint.save(opt.state_dict(), "
                   "directory, step) and load it on every rank with onebit.checkpoint.load_latest(directory)")
        if ranks is None:
            warn_user(message, RuntimeWarning)
        else:
            warn_collective(message, RuntimeWarning, self.control_group)


def _difference(theirs: dict, ours: dict) -> str:
    """The first field where a rank's description differs from rank 0's, in words."""
    if theirs["parameters"] != ours["parameters"]:
        a, b = theirs["parameters"], ours["parameters"]
        if len(a) != len(b):
            return f"it has {len(a)} parameters where group rank 0 has {len(b)}"
        k = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        return (f"parameter {k} is {a[k][1]} of shape {a[k][0]} there, {b[k][1]} of shape {b[k][0]} on "
                f"group rank 0")
    if theirs["stage"] != ours["stage"] or theirs["counters"] != ours["counters"]:
        return (f"it is at the {theirs['stage']} stage with {theirs['counters']} where group rank 0 is at "
                f"the {ours['stage']} stage with {ours['counters']}")
    key = next(k for k in ours if theirs.get(k) != ours[k])
    return f"its {key} is {theirs.get(key)!r} where group rank 0 has {ours[key]!r}"
