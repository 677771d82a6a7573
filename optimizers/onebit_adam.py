"""OnebitAdam: 1-bit Adam (Tang et al., 2021), docs/ALGORITHMS.md section 3."""

from __future__ import annotations

import torch

from ..collectives.bucket import allreduce_mean_
from ..kernels import cpu_fused
from . import _fused, _multi
from ._base import MODE_DEFAULT, VARIANCE_FLOOR, WarmupThenCompress, adam_defaults
from ._cohorts import options
from ._freeze import AutoFreeze, FreezeSchedule
from ._functional import adam_update, fold_, fold_preconditioned_, mask_, moments_, stale_direction

__all__ = ["OnebitAdam"]


class OnebitAdam(WarmupThenCompress):
    """1-bit Adam: Adam for ``freeze_step`` updates, then compressed momentum with frozen v.

    Warm-up: gradients averaged over ``group`` in full precision (flat buckets), then Adam
    (no bias correction unless ``bias_correction=True``). Afterwards each rank folds its
    LOCAL gradient into the momentum, the momentum buckets go through
    ``compressed_allreduce`` (one call per bucket), an optional ``exp_avg_mask`` per group
    multiplies the result, and the update uses the variance frozen at the freeze step.
    ``freeze_step=F`` means exactly F warm-up updates. Weight decay is decoupled (AdamW).

    Groups with ``non_freeze=True`` keep full-precision averaging and a live variance.
    A parameter whose ``.grad`` is None counts as having a zero gradient on this rank.
    Optimizer state per parameter: ``exp_avg_sq`` (float32, 4 bytes per element; the stale
    denominator is computed from it where it is read), the momentum ``exp_avg`` (float32; in the
    compression stage, between fused steps, kept as its last 1-bit message: 1/8 byte, and
    ``state_dict()`` decodes it) and the bucket's error buffers (about 2 + 2/W bytes per element in
    bfloat16, ``error_dtype``: see :class:`OnebitOptimizerBase`):
    ``onebit.memory.bytes_per_parameter(opt)`` counts them.
    ``nonfinite`` (non-finite gradients on any rank: skip, raise or no check) and
    ``step(check=True)`` (rank agreement): see :class:`OnebitOptimizerBase`.

    ``overlap=True``: in the compression stage each momentum bucket is folded and its
    compressed all-reduce started from backward, as soon as the bucket's gradients are all
    accumulated (see :mod:`onebit.optimizers._overlap`); results are bitwise those of
    ``overlap=False`` without its fused passes (with them, on a GPU or an x86 CPU, to float32
    rounding). Gradient accumulation: all passes but the last under
    ``with opt.no_sync():``. Not with a GradScaler (it unscales after the send), nor with
    ``register_ddp_hook`` (DDP then owns the gradients). Costs one copy of each launched
    bucket per step (restored when a non-finite gradient skips the step).

    ``capturable=True``: the compression stage's step, from its second step on, in the fused Triton
    stage (a GPU), can be captured in a CUDA graph and replayed (optimizers/_capture.py): the update and
    skip counts, the learning rate (give a tensor ``lr`` for a schedule) and the bias correction are read
    on the device, the step's messages are kept between steps (0.38-0.44 B per parameter); ``updates``
    and ``skipped_steps`` are read back by ``stats()`` and ``state_dict()``. Capturing any other step
    raises a ``RuntimeError`` before it changes anything.
    """

    FLAT_STATE = ("exp_avg",)
    DENSE_STATE = ("exp_avg_sq",)
    COUNTERS = ("updates", "freeze_state")
    SHARDED = True  # DTensor parameters (HSDP): optimizers/_sharded.py

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int | float | str | AutoFreeze = 100000,
        *,
        bias_correction: bool = False,
        eps_inside_sqrt: bool = False,
        bucket_cap_mb: float = 25.0,
        group=None,
        nonfinite: str | None = "skip",
        auto_mask: float | None = None,
        compression: str = "preconditioned",
        variance_floor: float | None = VARIANCE_FLOOR,
        update_clip: float | str | None = MODE_DEFAULT,
        block: int | None = None,
        error_dtype: torch.dtype = torch.bfloat16,
        variance_dtype: torch.dtype | None = None,
        overlap: bool = False,
        capturable: bool = False,
    ) -> None:
        self._options = options(locals())  # a cohort of groups added later is built with them
        defaults = adam_defaults(
            lr, betas, eps, weight_decay,
            bias_correction=bool(bias_correction), eps_inside_sqrt=bool(eps_inside_sqrt),
        )
        super().__init__(params, defaults, group=group, bucket_cap_mb=bucket_cap_mb, nonfinite=nonfinite,
                         auto_mask=auto_mask, compression=compression, variance_floor=variance_floor,
                         update_clip=update_clip, block=block,
                         error_dtype=error_dtype, variance_dtype=variance_dtype)
        self.schedule = FreezeSchedule("freeze_step", freeze_step)
        self.freeze_step = freeze_step
        self.updates = 0
        self.capturable = bool(capturable)
        if self.capturable and overlap:
            raise ValueError("capturable: expected overlap=False (the overlap's collectives start in "
                             "backward, outside the step)")
        if overlap:
            self._enable_overlap(lambda: self.compressing, self._fold_one)

    def _stale_bc2(self, g: dict) -> float:
        """The frozen variance's bias correction: always when preconditioned (the frozen v must
        estimate E[g^2], as the baseline's v does by the end of the run; docs/ALGORITHMS.md
        6.2), only with ``bias_correction`` in momentum mode (the reference's)."""
        if g["bias_correction"] or self.preconditioned:
            return 1.0 - g["betas"][1] ** self.frozen_at
        return 1.0

    def _fold_one(self, k: int, p, g: dict, view) -> None:
        """Fold p's local gradient into its compressed momentum (preconditioned: into m/denom)."""
        if self.preconditioned:
            frozen = self.frozen_variance(k, p, g)  # one pass on CPU, d computed from v in it
            if frozen is None or not cpu_fused.fold_preconditioned_(view, p.grad, *frozen, g["betas"][0]):
                fold_preconditioned_(view, p.grad, self.stale_denominator(k, p, g), g["betas"][0])
        else:
            fold_(view, p.grad, g["betas"][0])

    def _take_step(self) -> None:
        reducer = self.reducer()
        compress = self.compressing
        self.updates += 1
        t = self.updates
        pairs = self.compressed_params()
        # two passes per bucket (GPU, x86 CPU); where _prepare_step ran, applies held this step
        prepared = getattr(getattr(self, "_fused_cache", None), "ready", None) is not None
        # (the agreement on the device chose the fused step already: _agreement_on_device)
        if compress and (prepared or self._on_device is not None or _fused.applies(self, reducer, pairs)):
            self._fused_plan(reducer).step(self, pairs, t)
            return self._after_update(compress, t)
        forget = getattr(getattr(self, "_fused_cache", None), "forget", None)
        if forget is not None:  # another path writes the momentum: its last message no longer decodes to it
            forget()
        if compress:
            masks, kept = self.auto_masks(), None
            if not self._overlapped:  # overlap=True folded and all-reduced during backward
                if not self._fold_all(pairs, reducer.views):
                    for k, (p, g) in enumerate(pairs):
                        self._fold_one(k, p, g, reducer.views[k])
                # the momentum after the call is its message's decode: kept as that message (issue 56)
                kept = reducer.compressed_mean_(keep=self._may_keep(reducer, pairs, masks))
            if not self._update_all(pairs, reducer.views, masks, t):
                self._update_each(pairs, reducer.views, masks, t)
            self._keep(reducer, kept)
        elif _fused.warmup_applies(self, reducer, pairs):  # each bucket's update in one launch (GPU)
            plan = _fused.plan(self, "_warmup_cache", reducer, _fused.WarmupStep)
            communicate = self._communicate_average()
            for k, b in enumerate(reducer.buckets):
                if b.numel:
                    avg = reducer.average(b, [pairs[i][0].grad for i in b.indices], communicate)
                    plan.update(self, pairs, k, avg, t)
        else:
            for items in self.averaged_gradient_buckets(reducer, pairs):
                if not self._adam_all(items, reducer.views, t):
                    for k, p, g, grad in items:
                        m, v = reducer.views[k], self.state[p]["exp_avg_sq"]
                        moments_(m, v, grad, g["betas"])
                        self._apply(p, g, m, v, t, frozen=False)
        self._after_update(compress, t)

    def _after_update(self, compress: bool, t: int) -> None:
        self._step_non_freeze(t, communicate=not (self.external_averaging and not compress))
        if not compress:
            self._observe_variance()
            if self.compressing:
                self._enter_compression()

    def _wants_counts(self) -> bool:
        return self.capturable and self.compressing

    def _device_lrs(self) -> bool:
        return self._wants_counts() and _fused.stage_backend(self)

    def _check_capture(self) -> None:
        """A captured step (optimizers/_capture.py): ``capturable=True``, the compression stage, the fused
        Triton stage over momenta kept as messages."""
        if not self.capturable:
            super()._check_capture()
        reducer = self.reducer()
        pairs = self.compressed_params()
        fused = self.compressing and _fused.applies(self, reducer, pairs)
        plan = self._fused_plan(reducer) if fused else None
        if plan is None or not plan._stages() or not plan.agrees_on_device():
            raise RuntimeError("OnebitAdam.step: a CUDA graph is being captured; the capturable step is the "
                               "compression stage's from its second step on, in the fused Triton stage "
                               f"(now: the {self.stage} step after {self.updates} updates)")

    def _prepare_step(self) -> bool | None:
        """The fused native step's fold and encode, before the agreement (optimizers/_fused.py):
        its messages' scales give this rank's verdict, without a pass over the gradients."""
        if not self.compressing or self._overlap is not None:
            return None
        reducer, pairs = self.reducer(), self.compressed_params()
        if not _fused.applies(self, reducer, pairs):
            return None
        return _fused.prepared_verdict(self, self._fused_plan(reducer), pairs)

    def _agreement_on_device(self):
        """The step's agreement on the device where it applies (optimizers/_device_agreement.py): the
        fused Triton compression step over momenta kept as messages, and the warm-up's update in one Triton
        launch per bucket (its poison summed over the ranks on the device, each launch gated by it)."""
        if not self.compressing:
            return self._warmup_agreement()
        reducer = self.reducer()
        if not self._may_agree_on_device(reducer.device):
            return None
        pairs = self.compressed_params()
        if not _fused.applies(self, reducer, pairs) or not self._fused_plan(reducer).agrees_on_device():
            return None
        return self._new_agreement(pairs, reducer)

    def _warmup_agreement(self):
        """A warm-up step agreed on the device, where it applies: each rank's verdict a float32 poison, summed
        over the ranks on the device (one all-reduce, nothing read back), every bucket's update gated by it
        (kernels/fused/warmup.py); a skip undone on the host at the next step, which waits for the flag.
        The last warm-up step (it enters compression) and an automatic freeze (it reads the variance)
        agree on the host."""
        if self.schedule.auto is not None or self.updates + 1 >= self.schedule.fixed:
            return None
        reducer = self.reducer()
        if not self._may_agree_on_device(reducer.device):
            return None
        pairs = self.compressed_params()
        if not _fused.warmup_applies(self, reducer, pairs):
            return None
        return self._new_agreement(pairs, reducer, summed=True)

    def _abandon_step(self) -> None:
        plan = getattr(self, "_fused_cache", None)
        if plan is not None:
            plan.abandon()

    def _fused_plan(self, reducer):
        return _fused.plan(self, "_fused_cache", reducer, _fused.AdamStep)

    # -- GPU: one multi-tensor op per param group instead of one op per tensor (optimizers/_multi.py)
    def _fold_all(self, pairs, views) -> bool:
        if not _multi.applies(views):
            return False
        if self.preconditioned:  # the denominators made batch by batch (bounded transients)
            for batch in _multi.in_batches(pairs):
                rows = [(g, views[k], p.grad, self.stale_denominator(k, p, g)) for k, (p, g) in batch]
                for g, us, grads, denoms in _multi.by_group(rows):
                    _multi.fold_preconditioned_(us, grads, denoms, g["betas"][0])
        else:
            for g, ms, grads in _multi.by_group((g, views[k], p.grad) for k, (p, g) in enumerate(pairs)):
                _multi.fold_(ms, grads, g["betas"][0])
        return True

    def _update_all(self, pairs, views, masks, t: int) -> bool:
        if (not self.preconditioned or not _multi.applies(views) or any(d is not None for d in masks)
                or any(g.get("exp_avg_mask") is not None for _, g in pairs)):
            return False
        for g, ps, ms in _multi.by_group((g, p, views[k]) for k, (p, g) in enumerate(pairs)):
            _multi.stale_update_(ps, ms, lr=g["lr"], weight_decay=g["weight_decay"], clip=self.update_clip,
                                 bc1=_stale_bc1(g, t))
        return True

    def _adam_all(self, items, views, t: int) -> bool:
        if not _multi.applies([views[k] for k, *_ in items]):
            return False
        rows = [(g, p, views[k], self.state[p]["exp_avg_sq"], grad) for k, p, g, grad in items]
        for g, ps, ms, vs, grads in _multi.by_group(rows):
            _multi.moments_(ms, vs, grads, g["betas"])
            b1, b2 = g["betas"]
            bc1, bc2 = (1.0 - b1**t, 1.0 - b2**t) if g["bias_correction"] else (1.0, 1.0)
            _multi.adam_update_(ps, ms, vs, lr=g["lr"], eps=g["eps"], weight_decay=g["weight_decay"], bc1=bc1,
                                bc2=bc2, eps_inside_sqrt=g["eps_inside_sqrt"])
        return True

    def _update_each(self, pairs, views, masks, t: int) -> None:
        for k, ((p, g), dead) in enumerate(zip(pairs, masks, strict=True)):
            m = mask_(views[k], dead, g.get("exp_avg_mask"))
            if self._reference_maths():
                self._apply(p, g, m, self.state[p]["exp_avg_sq"], t, frozen=True)
            else:  # preconditioned: m is already m / denom
                denom = None if self.preconditioned else self.stale_denominator(k, p, g)
                self._apply_stale(p, g, m, denom, t)

    def _apply_stale(self, p, g: dict, m, denom, t: int) -> None:
        """Compression-stage update with the floored frozen denominator and the clip:
        ``p -= lr * (clip(m / denom / bc1) + wd * p)`` (``denom=None``: m is m/denom)."""
        bc1 = _stale_bc1(g, t)
        if denom is None and cpu_fused.stale_update_(p, m, lr=g["lr"], weight_decay=g["weight_decay"],
                                                     clip=self.update_clip, bc1=bc1):
            return  # the same maths in one pass (CPU)
        update = stale_direction(p, m, denom, 0.0, self.update_clip, bc1)
        if g["weight_decay"]:
            p.mul_(1.0 - g["lr"] * g["weight_decay"])
        p.add_(update, alpha=-g["lr"])

    def _step_non_freeze(self, t: int, communicate: bool) -> None:
        for g in self._own_groups():
            if not g.get("non_freeze", False):
                continue
            for p in g["params"]:
                state = self.dense_state(p)
                grad = torch.zeros_like(p) if p.grad is None else p.grad
                avg = self._average_one(grad) if communicate else grad.to(torch.float32)
                moments_(state["exp_avg"], state["exp_avg_sq"], avg, g["betas"])
                self._apply(p, g, state["exp_avg"], state["exp_avg_sq"], t, frozen=False)

    def _average_one(self, grad: torch.Tensor) -> torch.Tensor:
        avg = grad.to(torch.float32, copy=True)
        if self.world_size > 1:
            allreduce_mean_(avg, self.process_group, self.world_size)
        return avg

    def _apply(self, p, g: dict, m, v, t: int, frozen: bool) -> None:
        b1, b2 = g["betas"]
        if g["bias_correction"]:
            bc1 = 1.0 - b1**t
            bc2 = 1.0 - b2 ** (self.frozen_at if frozen else t)
        else:
            bc1 = bc2 = 1.0
        adam_update(
            p, m, v, lr=g["lr"], eps=g["eps"], weight_decay=g["weight_decay"], bc1=bc1, bc2=bc2,
            eps_inside_sqrt=g["eps_inside_sqrt"],
        )


def _stale_bc1(g: dict, t: int) -> float:
    """The compression-stage update's first-moment bias correction (1 without ``bias_correction``)."""
    return 1.0 - g["betas"][0] ** t if g["bias_correction"] else 1.0
