"""OnebitLamb: 1-bit LAMB (Li et al., 2021), docs/ALGORITHMS.md section 4.1."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..collectives._failure import guard
from ..collectives._group import warn_collective
from ..collectives.telemetry import CallTimer
from ..kernels._checks import check_fraction, check_number, check_order
from ._base import MODE_DEFAULT, WarmupThenCompress, adam_defaults
from ._cohorts import options
from ._freeze import AutoFreeze, FreezeSchedule
from ._functional import (
    TRUST_SKETCH,
    SketchHash,
    clip_,
    count_sketch,
    count_sketch_index,
    fold_,
    lamb_compressed_update,
    lamb_sketched_update,
    lamb_warmup_update,
    mask_,
    moments_,
)

__all__ = ["OnebitLamb"]

# OnebitLamb's variance floor: LAMB normalises each tensor's step, so the coordinates with the
# largest m / d take its largest share; at 0.1 (the Adams' floor) the frozen-variance stage
# ends 9% above LAMB on the 64-128-128-10 MLP even with an exact average (ALGORITHMS.md 6.3).
LAMB_VARIANCE_FLOOR = 0.5
_SKETCH_SEED = 0x1B17  # the sketch hash of compressed parameter k is drawn with seed _SKETCH_SEED + k
# at the freeze OnebitLamb names the tensors with more than this share of coordinates at zero variance
ZERO_VARIANCE_SHARE = 0.5


def _rms(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t).to(torch.float64) / math.sqrt(max(t.numel(), 1))


class OnebitLamb(WarmupThenCompress):
    """1-bit LAMB: LAMB for ``freeze_step`` updates, then one compressed flat momentum buffer.

    Warm-up: gradients averaged over ``group`` in full precision; LAMB without bias
    correction, whose layer-wise trust ratio is tracked as an EMA (``coeff_freeze``).
    Compression stage: every rank's local momentum goes through ONE ``compressed_allreduce``
    for the whole model (its padded tail keeps the previous output, like the reference).
    With ``compression="momentum"`` (the reference): at the last warm-up update a fresh copy
    of the variance starts, the momenta are scaled to a common RMS (coefficients fixed at the
    first compressed update; 1 for a parameter whose momentum is all zero), and the update
    uses the frozen variance, the frozen trust ratio and a bounded correction factor from the
    fresh variance.

    Defaults: ``compression="preconditioned"``, ``variance_floor=0.5``, no update clip, no
    mask (docs/ALGORITHMS.md 6.3): from the freeze on the momentum is compressed as
    ``u = m / d`` (``d`` the floored frozen denominator) and the trust ratio is
    ``||p|| / ||m* + wd*p||``, ``m*`` the momentum of the exact averaged gradients, whose norm
    comes from a count sketch (``TRUST_SKETCH = 256`` floats per tensor, all-reduced in full
    precision with one more of ``p``'s sketch each step). The reference's maths (frozen
    ratio, fresh-variance factor, equalised momentum scales) is
    ``compression="momentum", variance_floor=None, auto_mask=None``; its masked variant adds
    ``auto_mask=0.5``.

    Optimizer state per parameter: ``exp_avg`` (``u`` after the freeze), ``exp_avg_sq``
    (float32, 8 bytes per element), ``lamb_sketch`` (at most 256 floats) and three float64
    scalars; plus the error buffers (about 2 + 2/W bytes per element in bfloat16, ``error_dtype``);
    the sketch's hash is computed as it reads (no index stored; a run resumed from a checkpoint
    written in the compression stage before that keeps the int32 index it drew: 4 bytes per
    element). With ``compression="momentum"`` also ``exp_avg_sq_fresh`` and, from the first
    compressed step, a copy of the previous momentum (8 bytes per element).
    ``nonfinite`` (non-finite gradients on any rank: skip, raise or no check) and
    ``step(check=True)`` (rank agreement): see :class:`OnebitOptimizerBase`.
    """

    FLAT_STATE = ("exp_avg",)
    DENSE_STATE = ("exp_avg_sq", "exp_avg_sq_fresh")
    SCALAR_STATE = {"lamb_coeff_freeze": 0.0, "last_factor": 1.0, "scaling_coeff": 1.0}
    # sketch_hash: 1 where the trust ratio's sketches hash their index as they read (6.3), 0 in a run
    # resumed from a checkpoint written before that (its sketches made with a drawn index)
    COUNTERS = ("updates", "freeze_state", "sketch_hash")
    FLAT_PADDING = True
    UPDATE_CLIP = None  # the trust ratio bounds the step; a clip would break the linear step (6.3)

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
        auto_mask: float | None = None,
        compression: str = "preconditioned",
        variance_floor: float | None = LAMB_VARIANCE_FLOOR,
        update_clip: float | str | None = MODE_DEFAULT,
        block: int | None = None,
        error_dtype: torch.dtype = torch.bfloat16,
        variance_dtype: torch.dtype | None = None,
    ) -> None:
        self._options = options(locals())  # a cohort of groups added later is built with them
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
                         update_clip=update_clip, block=block,
                         error_dtype=error_dtype, variance_dtype=variance_dtype)
        self.schedule = FreezeSchedule("freeze_step", freeze_step)
        self.freeze_step = freeze_step
        self.max_coeff, self.min_coeff, self.coeff_beta = max_coeff, min_coeff, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        if any(g.get("non_freeze", False) for g in self.param_groups):
            raise ValueError("params: non_freeze groups are an OnebitAdam option; OnebitLamb has none")
        self.updates = 0
        self._coeffs: list[torch.Tensor] = []
        self._m_last: torch.Tensor | None = None
        self._sketch_index: list[SketchHash | torch.Tensor | None] | None = None
        self.sketch_hash = 1
        if self.preconditioned:  # no fresh variance in this mode
            self.DENSE_STATE = ("exp_avg_sq",)

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

    def _agreement_on_device(self):
        """A steady preconditioned compression step agreed on the device (optimizers/_device_agreement.py):
        every bucket's momentum kept as its last message (from the second compressed step on; no mask, no
        clip), this rank's poison added to ``g / d`` (its messages' scales and sketches then NaN on every
        rank; the collective leaves the errors), the kept message, the sketch, the parameters and the
        coefficients selected on the device. A warm-up step but the last (it enters compression; and none
        under an automatic freeze, which reads the variance) agrees too: the ranks' poisons summed on the
        device (one 4-byte all-reduce, nothing read back), the moments, the parameters and the trust-ratio
        EMA selected by it. Elsewhere (the first step, the first compressed one) the host agrees."""
        if not self._coeffs:
            return None
        if not self.compressing:
            if self.schedule.auto is not None or self.updates + 1 >= self.schedule.fixed:
                return None
            reducer = self.reducer()
            if not self._may_agree_on_device(reducer.device):
                return None
            return self._new_agreement(self.compressed_params(), reducer, summed=True)
        if not (self.preconditioned and self.update_clip is None):
            return None
        reducer = self.reducer()
        if not self._may_agree_on_device(reducer.device):
            return None
        pairs = self.compressed_params()
        if not self._may_keep(reducer, pairs, self.auto_masks()):
            return None
        if any(b.message is None for b in reducer.buckets if b.numel):
            return None
        return self._new_agreement(pairs, reducer)

    def _lamb_kwargs(self, g: dict) -> dict:
        return dict(lr=g["lr"], eps=g["eps"], weight_decay=g["weight_decay"], min_coeff=self.min_coeff,
                    max_coeff=self.max_coeff, coeff_beta=self.coeff_beta)

    def _warmup_step(self, reducer, pairs) -> list[torch.Tensor]:
        skip = None if self._on_device is None else self._on_device.skipped  # agreed on the device: its gate
        coeffs = []
        for k, p, g, grad in self.averaged_gradients(reducer, pairs):
            state = self.state[p]
            m, v = reducer.views[k], state["exp_avg_sq"]
            if skip is None:
                moments_(m, v, grad, g["betas"])
            else:  # the same operations, each moment kept where the step is skipped
                b1, b2 = g["betas"]
                m.copy_(torch.where(skip, m, m.mul(b1).add_(grad, alpha=1.0 - b1)))
                v.copy_(torch.where(skip, v, v.mul(b2).addcmul_(grad, grad, value=1.0 - b2)))
            coeffs.append(lamb_warmup_update(p, m, v, state["lamb_coeff_freeze"], skip=skip,
                                             **self._lamb_kwargs(g)))
        if skip is not None:  # a skipped step's coefficients are the last step's
            coeffs = [torch.where(skip, last, c) for last, c in zip(self._coeffs, coeffs, strict=True)]
        return coeffs

    # -- preconditioned stage (docs/ALGORITHMS.md 6.3) --------------------------------------
    def _sketch_indices(self, pairs) -> list[SketchHash | torch.Tensor | None]:
        """Each tensor's sketch index: hashed where read (``sketch_hash``), or the int32 index drawn by
        ``torch.randint`` that a checkpoint from before the hash made its ``lamb_sketch`` with."""
        if self._sketch_index is None:
            if self.sketch_hash:
                self._sketch_index = [SketchHash(p.numel(), TRUST_SKETCH, _SKETCH_SEED + k)
                                      if p.numel() > TRUST_SKETCH else None for k, (p, _) in enumerate(pairs)]
            else:
                self._sketch_index = [count_sketch_index(p.numel(), TRUST_SKETCH, _SKETCH_SEED + k, p.device)
                                      for k, (p, _) in enumerate(pairs)]
        return self._sketch_index

    def _apply_rank_state(self, extra: dict | None) -> None:
        super()._apply_rank_state(extra)
        if extra is not None and "sketch_hash" not in extra.get("counters", {}):
            # a checkpoint from before the hashed index: its sketches (if any yet) used the drawn one
            sketched = any("lamb_sketch" in self.state[p] for p, _ in self.compressed_params())
            self.sketch_hash = 0 if sketched else 1
        self._sketch_index = None

    def _mean_over_ranks(self, flat: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1 and flat.numel():
            timer = CallTimer(flat.device, self.traffic)
            with timer.stage("full"), guard("OnebitLamb trust-ratio sketch all_reduce", self.process_group):
                dist.all_reduce(flat, group=self.process_group)
            self.count_sent(flat.numel(), flat.element_size())
            flat.div_(self.world_size)
        return flat

    def _enter_compression(self) -> None:
        super()._enter_compression()
        if not self.preconditioned:
            return
        self._say_zero_variance()
        pairs, views = self.compressed_params(), self.reducer().views
        index = self._sketch_indices(pairs)
        # y = S(m / d): the buffers are equal on every rank here; averaging the sketches makes
        # them bitwise equal even where index_add_ adds in no fixed order (CUDA)
        flat = self._mean_over_ranks(torch.cat([count_sketch(views[k], index[k], TRUST_SKETCH)
                                                for k in range(len(pairs))] or [torch.zeros(0)]))
        offset = 0
        for p, _ in pairs:
            size = min(p.numel(), TRUST_SKETCH)
            self.state[p]["lamb_sketch"] = flat[offset : offset + size].clone()
            offset += size

    def zero_variance_tensors(self) -> list[tuple[str, int, int]]:
        """(name, coordinates at zero variance, coordinates) of each compressed tensor with more than
        ``ZERO_VARIANCE_SHARE`` of its coordinates at ``exp_avg_sq == 0`` (no gradient in the whole
        warm-up: unused embedding rows, always-zero inputs, dead units). Named by the group's
        ``param_names`` where the optimizer was given named parameters, else
        ``param_groups[i]['params'][j]``. One host read for all tensors."""
        where, counts = [], []
        for i, g in enumerate(self.param_groups):
            if g.get("non_freeze", False):
                continue
            names = g.get("param_names")
            for j, p in enumerate(g["params"]):
                v = self.state[p].get(self.VARIANCE_STATE)
                if v is None or not p.numel():
                    continue
                where.append((names[j] if names else f"param_groups[{i}]['params'][{j}]", p.numel()))
                counts.append((v == 0).sum())
        zeros = torch.stack(counts).tolist() if counts else []
        return [(name, int(z), n) for (name, n), z in zip(where, zeros, strict=True)
                if z > ZERO_VARIANCE_SHARE * n]

    def _say_zero_variance(self) -> None:
        """Once, at the freeze: which tensors are mostly coordinates that never had a gradient, what
        that costs and which settings recover it (docs/optimizers.md, "OnebitLamb and coordinates
        without gradient")."""
        found = self.zero_variance_tensors()
        if not found:
            return
        listed = ", ".join(f"{name} ({z / n:.0%} of {n:,})" for name, z, n in found[:5])
        more = f" and {len(found) - 5} more" if len(found) > 5 else ""
        warn_collective(
            f"onebit: OnebitLamb froze its variance with {len(found)} tensor(s) more than half of whose "
            f"coordinates never had a gradient: {listed}{more}. The 1-bit signs of such a momentum are "
            "mostly noise (one scale per chunk), and LAMB's per-tensor trust ratio turns that noise into "
            "steps: on a model with 61% of its coordinates at zero variance OnebitLamb ended 1.29x LAMB's "
            "validation loss. block=16 with variance_floor=2.0 recovered it there (0.93x LAMB over 3 "
            "seeds; 3 bits per element on the wire instead of 1), and a later freeze_step narrows it "
            "(docs/optimizers.md, 'OnebitLamb and coordinates without gradient')",
            RuntimeWarning, self.control_group)

    def _preconditioned_step(self, reducer, pairs) -> list[torch.Tensor]:
        """Fold ``g / d`` into ``u`` and sketch it; one full-precision all-reduce of the sketches
        (and of ``p``'s), one compressed all-reduce of ``u``; LAMB's step with the trust ratio
        from the sketched norm of the exact momentum."""
        agreement = self._on_device  # the step's agreement on the device (_agreement_on_device), or None
        old = [b.message for b in reducer.buckets] if agreement is not None else None  # (views decode them)
        views, index = reducer.views, self._sketch_indices(pairs)
        sketches = []
        for k, (p, g) in enumerate(pairs):
            b1, d = g["betas"][0], self.stale_denominator(k, p, g)
            gd = p.grad / d if p.grad is not None else torch.zeros_like(views[k])
            if agreement is not None:
                gd.add_(agreement.poison)  # 0, or NaN: this rank's messages and sketches poisoned
            views[k].mul_(b1).add_(gd, alpha=1.0 - b1)
            sketches.append(count_sketch(gd, index[k], TRUST_SKETCH))
        sketches += [count_sketch(p.detach(), index[k], TRUST_SKETCH) for k, (p, _) in enumerate(pairs)]
        means = self._mean_over_ranks(torch.cat(sketches)) if sketches else None
        masks = self.auto_masks()
        # u after the call is its message's decode: kept as that message between steps (issue 56) where
        # nothing writes u after the call (no mask, no clip)
        keep = self.update_clip is None and self._may_keep(reducer, pairs, masks)
        kept = reducer.compressed_mean_(keep=keep)
        skip = None
        if agreement is not None:  # each bucket keeps the gathered message, or its old one on a skip
            kept = [None if k is None else (agreement.keep(k[0], k[1], o[0]), k[1])
                    for k, o in zip(kept, old, strict=True)]
            skip = agreement.skipped
        coeffs, offset, half = [], 0, means.numel() // 2 if means is not None else 0
        for k, ((p, g), dead) in enumerate(zip(pairs, masks, strict=True)):
            size = min(p.numel(), TRUST_SKETCH)
            y = self.state[p]["lamb_sketch"]
            b1 = g["betas"][0]
            if skip is None:
                y.mul_(b1).add_(means[offset : offset + size], alpha=1.0 - b1)
            else:
                y.copy_(torch.where(skip, y, y.mul(b1).add_(means[offset : offset + size], alpha=1.0 - b1)))
            sketch_p = means[half + offset : half + offset + size]
            estimate = torch.linalg.vector_norm(y + g["weight_decay"] * sketch_p)
            offset += size
            u = clip_(mask_(views[k], dead, g.get("exp_avg_mask")), self.update_clip)
            coeffs.append(lamb_sketched_update(p, u, estimate, lr=g["lr"], weight_decay=g["weight_decay"],
                                               min_coeff=self.min_coeff, max_coeff=self.max_coeff, skip=skip))
        if skip is not None:  # a skipped step's coefficients are the last step's
            coeffs = [torch.where(skip, last, c) for last, c in zip(self._coeffs, coeffs, strict=True)]
        self._keep(reducer, kept)
        return coeffs

    def _compressed_step(self, reducer, pairs, first: bool) -> list[torch.Tensor]:
        if not reducer.buckets:
            return []
        if self.preconditioned:  # (its buckets' kept messages read before their views decode them)
            return self._preconditioned_step(reducer, pairs)
        views = reducer.views
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
