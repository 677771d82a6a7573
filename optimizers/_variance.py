"""What the 1-bit optimizers derive from their variance: the automatic momentum mask, the
floor under ``sqrt(v)``, the stale denominators (computed, not kept), and the freeze schedule's accessors
(docs/ALGORITHMS.md sections 3.4 and 6). A mixin of :class:`~onebit.optimizers._base.OnebitOptimizerBase`:
it reads the optimizer's state and settings, and caches the small things it builds (masks, floors)
until the variance changes.
"""

from __future__ import annotations

from typing import Any

import torch

from ..collectives._group import warn_collective
from ..kernels._checks import check_half_or_float
from ..kernels.preconditioning import inverse_sqrt_bc2
from ._freeze import FreezeSchedule
from ._functional import sqrt_v_floors, stale_denominator, tiny_variance_mask


def check_variance_dtype(variance_dtype: object, compression: str) -> torch.dtype:
    """``variance_dtype`` if it is float32 or bfloat16 (else a clear error naming it); None: bfloat16 with
    ``compression="preconditioned"``, float32 with ``"momentum"`` (the reference's maths, bitwise)."""
    if variance_dtype is None:
        return torch.bfloat16 if compression == "preconditioned" else torch.float32
    return check_half_or_float("variance_dtype", variance_dtype)


class VarianceState:
    """Masks, floors, stale denominators and the freeze schedule (module docstring)."""

    # -- automatic momentum mask --------------------------------------------------------
    VARIANCE_STATE = "exp_avg_sq"

    def auto_masks(self) -> list[torch.Tensor | None]:
        """Per compressed parameter: the coordinates whose compressed updates are masked
        (bool, True = masked) or None; built from the variance when first needed after it
        changed (see ``auto_mask`` and :func:`tiny_variance_mask`). All None when off."""
        pairs = self.compressed_params()
        if self.auto_mask is None:
            return [None] * len(pairs)
        if self._masks is None:
            samples = self._variance_samples()
            self._masks = [tiny_variance_mask(self.state[p][self.VARIANCE_STATE], self.auto_mask, samples)
                           for p, _ in pairs]
            self.masked_coordinates = sum(int(m.sum()) for m in self._masks if m is not None)
            if self.masked_coordinates and not self._mask_warned:
                self._mask_warned = True
                total = sum(p.numel() for p, _ in pairs)
                warn_collective(
                    f"onebit: {type(self).__name__} masks the compressed momentum of "
                    f"{self.masked_coordinates:,} of {total:,} coordinates whose variance is at most "
                    f"{self.auto_mask:g} x their tensor's mean (they had (almost) no gradient: "
                    f"always-zero features, dead units, unused embedding rows); Adam gives them "
                    f"(almost) no update either. opt.stats() counts them; auto_mask=None restores "
                    f"the reference's behaviour", RuntimeWarning, self.control_group,
                )
        return self._masks

    # -- the frozen variance's storage (docs/ALGORITHMS.md 12.1) -----------------------------
    def _frozen_for_good(self) -> bool:
        """Whether the variance of the compressed parameters changes no more (OnebitAdam and
        OnebitLamb: after the freeze; ZeroOneAdam: in phase 2)."""
        raise NotImplementedError

    def _narrow_variance(self) -> None:
        """Store each compressed parameter's variance in ``variance_dtype`` (rounded once to nearest:
        exact for one already representable, as a checkpoint of a narrowed one is) once it is frozen
        for good; a no-op before, for float32, and where it is stored so already."""
        if self.variance_dtype == torch.float32 or not self._frozen_for_good():
            return
        changed = False
        for p, _ in self.compressed_params():
            state = self.state[p]
            v = state.get(self.VARIANCE_STATE)
            if v is not None and v.dtype != self.variance_dtype:
                state[self.VARIANCE_STATE] = v.to(self.variance_dtype)
                changed = True
        if changed:  # the floors and masks are those of the stored variance
            self._variance_changed()

    def _variance_changed(self) -> None:
        self._masks = None
        self._floors = None
        self._floor_values = None
        self._floor_columns = {}

    # -- preconditioned compression: variance floor, stale denominators ---------------------
    @property
    def preconditioned(self) -> bool:
        """Whether the compressed quantity is divided by Adam's denominator first
        (``compression="preconditioned"``, docs/ALGORITHMS.md section 6)."""
        return self.compression == "preconditioned"

    def _reference_maths(self) -> bool:
        """compression="momentum" without floor or clip: the reference's update, bitwise."""
        return not self.preconditioned and self.variance_floor is None and self.update_clip is None

    def _stale_variance(self) -> bool:
        """Whether updates now use a variance that is not refreshed every step (after the
        freeze; 0/1 Adam: from its first variance update on). Floors exist only then."""
        raise NotImplementedError

    def sqrt_v_floors(self) -> list[torch.Tensor | None]:
        """Per compressed parameter: the floor under its ``sqrt(v)`` (a 0-dim float32), or
        None without ``variance_floor``; built from the variance when first needed after it
        changed (see :func:`~onebit.optimizers._functional.sqrt_v_floors`)."""
        pairs = self.compressed_params()
        if self.variance_floor is None:
            return [None] * len(pairs)
        if self._floors is None:
            self._floors = list(sqrt_v_floors([self.state[p][self.VARIANCE_STATE] for p, _ in pairs],
                                              self.variance_floor))
        return self._floors

    def _stale_bc2(self, g: dict) -> float:
        """The variance's bias correction on stale steps (OnebitAdam's frozen one); 1 without."""
        return 1.0

    def stale_denominator(self, k: int, p: torch.Tensor, g: dict) -> torch.Tensor:
        """Compressed parameter k (``p`` in group ``g``): ``max(sqrt(v), floor) / sqrt(bc2) + eps``,
        a new tensor computed from the variance each call (docs/ALGORITHMS.md 6.2: the optimizers
        keep ``v`` only; the fused passes compute the same from ``v`` as they read it)."""
        return stale_denominator(self.state[p][self.VARIANCE_STATE], self.sqrt_v_floors()[k], g["eps"],
                                 self._stale_bc2(g), g.get("eps_inside_sqrt", False))

    def denominator_scalars(self, k: int, g: dict) -> tuple[float, float, float]:
        """Compressed parameter k's ``(floor, r, eps)``, from which the fused passes compute its stale
        denominator ``max(sqrt(v), floor) * r + eps`` (floor 0.0 without ``variance_floor``). The
        floors' values reach the host once per variance change (one synchronisation)."""
        if self._floor_values is None:  # every floor in one read (a GPU: one synchronisation, not one each)
            floors = self.sqrt_v_floors()
            known = [f for f in floors if f is not None]
            values = iter(torch.stack([f.reshape(()) for f in known]).tolist() if known else [])
            self._floor_values = [0.0 if f is None else float(next(values)) for f in floors]
        return self._floor_values[k], inverse_sqrt_bc2(self._stale_bc2(g)), float(g["eps"])

    def floor_column(self, indices: list[int]) -> torch.Tensor | None:
        """The floors of compressed parameters ``indices`` as one float32 tensor on their device, as a fused
        table's floor column takes them (:meth:`onebit.kernels.fused.table.Table.fill`): nothing read
        back to the host (issue 57; on a GPU a read is a synchronisation, and ZeroOneAdam's variance
        changes every variance step). None without ``variance_floor`` (the floor 0.0 in the rows). Made
        once per variance change and set of tensors."""
        if self.variance_floor is None:
            return None
        key = tuple(indices)
        column = self._floor_columns.get(key)
        if column is None:
            floors = self.sqrt_v_floors()
            column = torch.stack([floors[i].reshape(()) for i in indices]) if indices else None
            self._floor_columns[key] = column
        return column

    def table_denominator(self, k: int, g: dict) -> tuple[float, float, float]:
        """Compressed parameter k's ``(floor, r, eps)`` as a fused table's row holds them where its floor
        column comes from :meth:`floor_column`: the floor 0.0 there (the column overwrites it)."""
        return 0.0, inverse_sqrt_bc2(self._stale_bc2(g)), float(g["eps"])

    def frozen_variance(self, k: int, p: torch.Tensor, g: dict):
        """``(v, (floor, r, eps))`` of compressed parameter k, for the C passes that compute its stale
        denominator as they read ``v`` (:mod:`onebit.kernels.cpu_fused`); None with ``eps_inside_sqrt``
        (its denominator has another form)."""
        if g.get("eps_inside_sqrt", False):
            return None
        return self.state[p][self.VARIANCE_STATE], self.denominator_scalars(k, g)

    def floored_coordinates(self) -> int:
        """How many coordinates have their ``sqrt(v)`` raised to the floor now (0 before the
        variance goes stale, or without ``variance_floor``). One host synchronisation."""
        if self.variance_floor is None or not self._stale_variance():
            return 0
        pairs = self.compressed_params()
        counts = [(self.state[p][self.VARIANCE_STATE].float().sqrt() < floor).sum()
                  for (p, _), floor in zip(pairs, self.sqrt_v_floors(), strict=True)]
        return int(sum(int(c) for c in counts))

    # -- freeze schedule (subclasses set self.schedule and count self.updates) ------------
    schedule: FreezeSchedule

    @property
    def frozen_at(self) -> int | None:
        """Number of full-precision updates before the variance froze; None before that."""
        return self.schedule.frozen_at(self.updates)

    def _observe_variance(self) -> None:
        """After a full-precision update: let an automatic schedule judge the variance."""
        self.schedule.observe(
            self.updates,
            [self.state[p][self.VARIANCE_STATE] for p, _ in self.compressed_params()],
            self.control_group,
            self,
        )

    @property
    def freeze_state(self) -> dict[str, Any]:
        """The schedule's checkpointed state (a counter: saved and restored with them)."""
        return self.schedule.state()

    @freeze_state.setter
    def freeze_state(self, value: dict[str, Any]) -> None:
        self.schedule.load(value)

    def _variance_samples(self) -> int:
        """How many updates went into the variance the masks are built from."""
        raise NotImplementedError
