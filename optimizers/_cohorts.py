"""Parameter groups added after the first update (``add_param_group`` mid-run, issue 58;
docs/ALGORITHMS.md 3.3.1). A mixin of :class:`~onebit.optimizers._base.OnebitOptimizerBase`.

A group added once the optimizer has taken an update joins a **cohort**: an optimizer of the same
class and settings over that group alone, with its own schedule (its own warm-up in full
precision, its own freeze), counters, buckets and error buffers. The groups added by one call
make one cohort; each later call makes another. The optimizer the user holds (the root) keeps
its own groups' buckets and schedule untouched (bitwise the run without the new group) and,
after its own update in ``step()``, runs each cohort's update on the same gradients:

- ``param_groups`` holds every group, the cohorts' included, each marked ``"cohort": c``
  (c >= 1; the root's groups have no mark): schedulers and trainers see one optimizer, and a
  checkpoint's ``param_groups`` say which cohort each group belongs to;
- ``state`` is one dict for all (the cohorts share the root's): ``state_dict()`` holds every
  parameter's state; its ``"onebit"`` entry adds ``"cohorts"``, each cohort's own counters,
  bucket layout and error buffers (and so does ``rank_state()``);
- ``load_state_dict`` rebuilds the cohorts the checkpoint's groups name, whether the resuming
  script built the optimizer with every group at once or added the late ones again first;
- the non-finite check is the root's, over every group: a skipped step skips every cohort;
- ``stats()["cohorts"]`` gives each cohort's counters and stage; the bytes are counted together.

Not with ``overlap=True`` (the backward hooks cover the buckets made at construction) nor with
DTensor (FSDP2/HSDP) parameters (FSDP's reduction is decided for the whole model per step).
Under DDP with the warm-up hook (``register_ddp_hook``), a cohort's gradients that DDP averaged
(the hook marks them: the root in its warm-up) are not averaged again; otherwise (the root
compressing, or parameters that did not require a gradient when DDP was built, which DDP never
averages) the cohort averages its own warm-up gradients itself.
"""

from __future__ import annotations

from typing import Any

import torch

_OMIT = ("self", "params", "__class__", "defaults")


def options(local: dict[str, Any]) -> dict[str, Any]:
    """The constructor's keyword arguments from its ``locals()`` at entry (a cohort is built with them)."""
    return {k: v for k, v in local.items() if k not in _OMIT}


class Cohorts:
    """``add_param_group`` after the first update, and the cohorts it makes (module docstring)."""

    def _own_groups(self) -> list[dict]:
        """The groups this optimizer updates itself: all of them, except on a root with cohorts."""
        if not self._cohorts:
            return self.param_groups
        return [g for g in self.param_groups if "cohort" not in g]

    def _started(self) -> bool:
        """Whether an update was taken: from then on the buckets and schedules are in use."""
        return getattr(self, "updates", 0) > 0 or bool(getattr(self, "_cohorts", ()))

    def add_param_group(self, param_group: dict) -> None:
        """As torch's. Before the first update the group joins the optimizer's own buckets and
        schedule. After it, the group starts a cohort of its own (module docstring): its own warm-up
        of ``freeze_step`` (``var_freeze_step``) updates in full precision, then its own compressed
        buckets; the groups given before are untouched. Call it on every rank at the same step."""
        if getattr(self, "_overlap", None) is not None:
            raise ValueError(
                f"add_param_group: {type(self).__name__} was built with overlap=True, whose backward hooks "
                "cover the buckets made at construction; pass every parameter group to the constructor "
                "(a group with lr=0 keeps its parameters still until you raise its lr)")
        if not self._started():
            if getattr(self, "_reducer", None) is not None:  # built by state_dict(): made again
                self._drop_reducer()
            torch.optim.Optimizer.add_param_group(self, param_group)
            return
        if self._sharding is not None:
            raise ValueError(
                f"add_param_group: {type(self).__name__} over DTensor (FSDP2/HSDP) parameters takes its "
                "groups at construction only (FSDP decides each step's reduction for the whole model); pass "
                "every parameter group to the constructor (a group with lr=0 keeps its parameters still)")
        torch.optim.Optimizer.add_param_group(self, param_group)  # validates; fills in the defaults
        group = self.param_groups[-1]
        group["cohort"] = 1 + max((c._cohort for c in self._cohorts), default=0)
        self._cohorts.append(self._new_cohort([group], joined_at=self.updates))

    def _new_cohort(self, groups: list[dict], joined_at: int):
        from ._stats import _LIVE

        cohort = type(self)(groups, **self._options)
        _LIVE.discard(cohort)  # the root says whether the run compressed
        cohort._cohort = groups[0]["cohort"]
        cohort.joined_at = joined_at
        cohort.state = self.state  # one state for all groups (state_dict, load_state_dict)
        cohort.traffic = self.traffic
        cohort._ddp_checked = True  # the root's step checks the cohort's replicas (_step_cohorts)
        cohort._replicas_checked = False
        return cohort

    def _drop_reducer(self) -> None:
        """Forget the buckets (made again at the next use; the flat state in ``self.state`` is copied
        into them) and the fused steps' plans over them."""
        self._reducer = None
        for name in [k for k in vars(self) if k.endswith("_cache")]:
            delattr(self, name)

    def _cohort_grads(self) -> list[torch.Tensor]:
        return [p.grad for c in self._cohorts for g in c.param_groups for p in g["params"]
                if p.grad is not None]

    def _step_cohorts(self) -> None:
        """Each cohort's update, after the root's, on gradients the root found usable."""
        averaged, self._ddp_averaged_params = self._ddp_averaged_params, set()
        for cohort in self._cohorts:
            params = [p for g in cohort.param_groups for p in g["params"]]
            if not cohort._replicas_checked:
                cohort._replicas_checked = True
                if cohort.world_size > 1:
                    cohort._verify_first_replicas()
            # gradients the root's DDP hook averaged (warmup_averaging_hook) are not averaged again
            cohort.external_averaging = bool(averaged) and all(
                id(p) in averaged for p in params if p.grad is not None)
            cohort._take_step()

    # -- checkpoints ------------------------------------------------------------------
    def _cohort_entries(self, state_dict: dict, params: list[torch.Tensor]) -> list[dict]:
        entries = []
        for cohort in self._cohorts:
            entry = cohort._extra_entry()
            entry.pop("traffic")  # counted with the root's
            ids = {id(g) for g in cohort.param_groups}
            entry.update(cohort=cohort._cohort, joined_at=cohort.joined_at,
                         groups=[i for i, g in enumerate(self.param_groups) if id(g) in ids])
            entries.append(entry)
            cohort._add_kept_momenta(state_dict, cohort.reducer(), params)
        return entries

    def _mark_cohorts(self, extra: dict | None) -> None:
        """Where the loaded groups carry no cohort marks but this rank's state names its cohorts' groups
        (a DCP load: torch's helpers load the group keys the target has, and a script that builds every
        group at once has none), mark them from it."""
        entries = (extra or {}).get("cohorts") or []
        if any("cohort" in g for g in self.param_groups) or not entries:
            return
        n = len(self.param_groups)
        if not all(0 <= i < n for e in entries for i in e.get("groups", [-1])):
            return  # another model's state: the load keeps one optimizer (and resets the errors)
        for e in entries:
            for i in e["groups"]:
                self.param_groups[i]["cohort"] = e["cohort"]

    def _regroup(self) -> None:
        """After ``load_state_dict`` (torch replaced ``param_groups`` and ``state``): the cohorts the
        loaded groups name, made anew; the root's buckets made again if its own parameters changed."""
        ids = sorted({g["cohort"] for g in self.param_groups if "cohort" in g})
        self._cohorts = []
        for c in ids:
            self._cohorts.append(self._new_cohort([g for g in self.param_groups if g.get("cohort") == c],
                                                  joined_at=0))
        reducer = self._reducer
        if reducer is not None and self._reducer_params != [id(p) for p, _ in self.compressed_params()]:
            self._drop_reducer()

    def _restore_cohorts(self, entries: list[dict] | None) -> None:
        by_id = {e["cohort"]: e for e in entries or ()}
        for cohort in self._cohorts:
            cohort.reducer()
            cohort._bind_state()
            entry = by_id.get(cohort._cohort)
            cohort.joined_at = 0 if entry is None else entry.get("joined_at", 0)
            cohort._apply_rank_state(entry)
            self._foreign_state |= cohort._foreign_state  # said by the root's agreement
            cohort._foreign_state = False
            cohort.traffic = self.traffic
            cohort.reducer().traffic = self.traffic

    def _cohort_stats(self) -> list[dict[str, Any]]:
        out = []
        for cohort in self._cohorts:
            row = {name: getattr(cohort, name) for name in cohort.COUNTERS if name != "freeze_state"}
            row.update(cohort=cohort._cohort, joined_at=cohort.joined_at, stage=cohort.stage,
                       frozen_at=cohort.frozen_at, steps_to_compression=cohort.steps_to_compression(),
                       coordinates=sum(p.numel() for p, _ in cohort.compressed_params()))
            out.append(row)
        return out
