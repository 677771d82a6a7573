"""OnebitLamb: 1-bit LAMB (Li et al., 2021), docs/ALGORITHMS.md section 4.1."""

from __future__ import annotations

import math

import torch

from ..kernels._checks import check_fraction, check_number, check_order
from ._base import MODE_DEFAULT, WarmupThenCompress, adam_defaults
from ._freeze import AutoFreeze, FreezeSchedule
from ._functional import (
    clip_,
    fold_,
    fold_preconditioned_,
    lamb_compressed_update,
    lamb_live_update,
    lamb_warmup_update,
    mask_,
    moments_,
)

__all__ = ["OnebitLamb"]

# OnebitLamb keeps the reference's momentum compression and the automatic mask by default for
# now: its preconditioned mode (a live trust ratio, docs/ALGORITHMS.md 6.3) trains without
# stopping coordinates but ends 40-50% above LAMB on the digits MLPs (bench/RESULTS.md).
LAMB_AUTO_MASK = 0.5


def _rms(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t).to(torch.float64) / math.sqrt(max(t.numel(), 1))


class OnebitLamb(WarmupThenCompress):
    """1-bit LAMB: LAMB for ``freeze_step`` updates, then one compressed flat momentum buffer.

    Warm-up: gradients averaged over ``group`` in full precision; LAMB without bias
    correction, whose layer-wise trust ratio is tracked as an EMA (``coeff_freeze``). At the
    last warm-up update a fresh copy of the variance starts. Compression stage: the local
    momentum of every parameter, scaled to a common RMS (coefficients fixed at the first
    compressed update; 1 for a parameter whose momentum is all zero), goes through ONE
    ``compressed_allreduce`` for the whole model (its padded tail keeps the previous
    output, like the reference); the update uses the frozen variance, the frozen trust
    ratio and a bounded correction factor from the fresh variance.

    Defaults: ``compression="momentum"`` with ``auto_mask=0.5`` (coordinates whose frozen
    ``sqrt(v)`` is at most half their tensor's mean are masked after the freeze and stop moving;
    ``stats()`` counts them). ``compression="preconditioned"`` (with ``variance_floor=0.1``)
    stops nothing: the momentum is compressed as ``m / denom`` and the trust ratio is computed
    live from the averaged update (docs/ALGORITHMS.md 6.3); on our suite it does not yet train
    as well as LAMB, which is why it is not the default.

    Optimizer state per parameter: ``exp_avg``, ``exp_avg_sq``, ``exp_avg_sq_fresh``
    (float32, 12 bytes per element) and three float64 scalars; plus the error buffers
    (about 4 + 4/W bytes per element) and, from the first compressed step, a float32 copy
    of the previous momentum (4 bytes per element).
    ``nonfinite`` (non-finite gradients on any rank: skip, raise or no check) and
    ``step(check=True)`` (rank agreement): see :class:`OnebitOptimizerBase`.
    """

    FLAT_STATE = ("exp_avg",)
    DENSE_STATE = ("exp_avg_sq", "exp_avg_sq_fresh")
    SCALAR_STATE = {"lamb_coeff_freeze": 0.0, "last_factor": 1.0, "scaling_coeff": 1.0}
    COUNTERS = ("updates", "freeze_state")
    FLAT_PADDING = True
    UPDATE_CLIP = None  # the live trust ratio bounds the step (ALGORITHMS.md section 6.3)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int | float | str | AutoFreeze = 100000,
        *,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        group=None,
        nonfinite: str | None = "skip",
        auto_mask: float | None = LAMB_AUTO_MASK,
        compression: str = "momentum",
        variance_floor: float | None = None,
        update_clip: float | str | None = MODE_DEFAULT,
        block: int | None = None,
    ) -> None:
        defaults = adam_defaults(lr, betas, eps, weight_decay)
        for name, value in [("max_coeff", max_coeff), ("min_coeff", min_coeff),
                            ("factor_max", factor_max), ("factor_min", factor_min)]:
            check_number(name, value)
        check_fraction("coeff_beta", coeff_beta)  # an EMA decay
        check_fraction("factor_threshold", factor_threshold)  # f may move by this fraction per step
        check_order("min_coeff", min_coeff, "max_coeff", max_coeff)
        check_order("factor_min", factor_min, "factor_max", factor_max)
        super().__init__(params, defaults, group=group, bucket_cap_mb=math.inf, nonfinite=nonfinite,
                         auto_mask=auto_mask, compression=compression, variance_floor=variance_floor,
                         update_clip=update_clip, block=block)
        self.schedule = FreezeSchedule("freeze_step", freeze_step)
        self.freeze_step = freeze_step
        self.max_coeff, self.min_coeff, self.coeff_beta = max_coeff, min_coeff, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        if any(g.get("non_freeze", False) for g in self.param_groups):
            raise ValueError("params: non_freeze groups are an OnebitAdam option; OnebitLamb has none")
        self.updates = 0
        self._coeffs: list[torch.Tensor] = []
        self._m_last: torch.Tensor | None = None

    def get_lamb_coeffs(self) -> list[float]:
        """The per-parameter coefficients of the last step (a copy; reads them to the host)."""
        return [float(c) for c in self._coeffs]

    def _take_step(self) -> None:
        reducer = self.reducer()
        compress = self.compressing
        first = compress and self.updates == self.frozen_at
        self.updates += 1
        pairs = self.compressed_params()
        if compress:
            self._coeffs = self._compressed_step(reducer, pairs, first)
        else:
            self._coeffs = self._warmup_step(reducer, pairs)
            self._observe_variance()
            if self.compressing:
                self._enter_compression()

    def _lamb_kwargs(self, g: dict) -> dict:
        return dict(lr=g["lr"], eps=g["eps"], weight_decay=g["weight_decay"], min_coeff=self.min_coeff,
                    max_coeff=self.max_coeff, coeff_beta=self.coeff_beta)

    def _warmup_step(self, reducer, pairs) -> list[torch.Tensor]:
        coeffs = []
        for k, p, g, grad in self.averaged_gradients(reducer, pairs):
            state = self.state[p]
            m, v = reducer.views[k], state["exp_avg_sq"]
            moments_(m, v, grad, g["betas"])
            coeffs.append(lamb_warmup_update(p, m, v, state["lamb_coeff_freeze"], **self._lamb_kwargs(g)))
        return coeffs

    def _preconditioned_step(self, reducer, pairs) -> list[torch.Tensor]:
        """The buffer holds u = m / denom (from the freeze on): fold, one compressed all-reduce
        for the whole model, then LAMB with a live trust ratio (docs/ALGORITHMS.md 6.3)."""
        views = reducer.views
        for k, (p, g) in enumerate(pairs):
            fold_preconditioned_(views[k], p.grad, self.stale_denominator(k, p, g), g["betas"][0])
        reducer.compressed_mean_()
        coeffs = []
        for k, ((p, g), dead) in enumerate(zip(pairs, self.auto_masks(), strict=True)):
            u = clip_(mask_(views[k], dead, g.get("exp_avg_mask")), self.update_clip)
            coeffs.append(lamb_live_update(p, u, lr=g["lr"], weight_decay=g["weight_decay"],
                                           min_coeff=self.min_coeff, max_coeff=self.max_coeff, clip=None))
        return coeffs

    def _compressed_step(self, reducer, pairs, first: bool) -> list[torch.Tensor]:
        views = reducer.views
        if not reducer.buckets:
            return []
        if self.preconditioned:
            return self._preconditioned_step(reducer, pairs)
        if first:  # the fresh variance starts from the frozen one
            for p, _ in pairs:
                self.state[p]["exp_avg_sq_fresh"].copy_(self.state[p]["exp_avg_sq"])
        floored = self.variance_floor is not None  # else the reference's sqrt(v) + eps
        denoms = [self.stale_denominator(k, p, g) if floored else None for k, (p, g) in enumerate(pairs)]
        if first:  # equalise the momentum magnitudes once; 1 where a momentum is all zero
            rms = [_rms(views[k]) for k in range(len(pairs))]
            united = torch.stack(rms).mean() if rms else None
            for k, (p, _) in enumerate(pairs):
                self.state[p]["scaling_coeff"].copy_(torch.where(rms[k] > 0, united / rms[k], 1.0))
        (bucket,) = reducer.buckets  # one flat buffer for the whole model
        if self._m_last is None:
            self._m_last = torch.empty(bucket.n, dtype=torch.float32, device=bucket.flat.device)
        self._m_last.copy_(bucket.flat[: bucket.n])
        for k, (p, g) in enumerate(pairs):
            fold_(views[k], p.grad, g["betas"][0]).mul_(self.state[p]["scaling_coeff"].to(torch.float32))
        reducer.compressed_mean_()
        coeffs = []
        for k, ((p, g), dead) in enumerate(zip(pairs, self.auto_masks(), strict=True)):
            state, m = self.state[p], views[k]
            mask_(m.div_(state["scaling_coeff"].to(torch.float32)), dead, g.get("exp_avg_mask"))
            off = bucket.offsets[k]
            m_last = self._m_last[off : off + m.numel()].view_as(m)
            coeffs.append(lamb_compressed_update(
                p, m, m_last, state["exp_avg_sq"], state["exp_avg_sq_fresh"], state["lamb_coeff_freeze"],
                state["last_factor"], lr=g["lr"], betas=g["betas"], eps=g["eps"],
                weight_decay=g["weight_decay"], factor_min=self.factor_min, factor_max=self.factor_max,
                factor_threshold=self.factor_threshold, denom=denoms[k], clip=self.update_clip,
            ))
        return coeffs
