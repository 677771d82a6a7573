"""ZeroOneAdam: 0/1 Adam (Lu et al., ICLR 2023), docs/ALGORITHMS.md section 4.2."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives._failure import guard
from ..kernels import cpu_fused, decompress
from ..kernels._checks import check_int
from . import _fused, _multi
from ._base import MODE_DEFAULT, VARIANCE_FLOOR, OnebitOptimizerBase, adam_defaults
from ._cohorts import options
from ._freeze import AutoFreeze, FreezeSchedule
from ._functional import direction, fold_, mask_, moments_, stale_direction

__all__ = ["ZeroOneAdam"]


class ZeroOneAdam(OnebitOptimizerBase):
    """0/1 Adam: adaptive variance freezing and local steps with 1-bit synchronisation.

    Phase 1 (the first ``var_freeze_step`` updates): on steps ``t % var_interval == 0`` the
    gradients are averaged in full precision and both moments are updated; on the other
    steps the GRADIENT goes through ``compressed_allreduce`` (bucketed) and only the
    momentum is updated. After every ``var_update_scaler`` variance updates the interval
    doubles. Phase 2: local Adam steps with the frozen variance, no communication, the
    applied updates accumulated in ``u``; every ``local_step_interval`` steps the ranks
    synchronise ``u`` with ``compressed_allreduce`` and become bitwise identical again. The
    interval doubles every ``local_step_scaler`` steps, capped at ``local_step_clipper``.

    ``local_step_scaler`` defaults to the reference's 32678 (32768 was probably meant).
    Step counting starts at the first real update (the reference swallowed one call).

    ``u`` is formed at each sync as ``p - p_sync`` from the parameters of the last sync
    (``sync_params``), and the new parameters are ``p_sync + mean(u)/(sqrt(v)+eps)``. In
    exact arithmetic that is the spec's ``p -= u; ...; p += u/(sqrt(v)+eps)``; in float32
    the spec's order leaves each replica with its own rounding of ``p + d - d``, so replicas
    would not be bitwise identical after a sync.

    Optimizer state per parameter: ``exp_avg``, ``exp_avg_sq``, ``sync_params`` and the
    flat buffer ``momentum_accumulator`` (carries the compressed gradient in phase 1 and
    ``u`` at syncs; float32, 16 bytes per element in all) plus the error buffers (about
    2 + 2/W bytes per element in bfloat16, ``error_dtype``). After a synchronisation (W > 1,
    no mask, no mesh) only ``exp_avg_sq`` is held: the momentum is kept as the sync's messages,
    ``sync_params`` is ``p`` and the accumulator zero, all three made again by the next step or
    ``state_dict()`` (docs/ALGORITHMS.md 6.4): ``opt.state[p]`` has no ``exp_avg`` then.
    ``nonfinite`` (non-finite gradients on any rank: skip, raise or no check) and
    ``step(check=True)`` (rank agreement): see :class:`OnebitOptimizerBase`.

    ``overlap=True``: on phase 1's compressed steps each gradient bucket is copied into the
    accumulator and its compressed all-reduce started from backward, as soon as the bucket's
    gradients are all accumulated (see :mod:`onebit.optimizers._overlap`); results are bitwise
    those of ``overlap=False``. Phase 1's variance steps (full precision) and phase 2's syncs
    (the update ``u`` needs this step's local update first) stay after backward. Gradient
    accumulation: all passes but the last under ``with opt.no_sync():``. Not with a
    GradScaler, nor with ``register_ddp_hook``.
    """

    FLAT_STATE = ("momentum_accumulator",)
    DENSE_STATE = ("exp_avg", "exp_avg_sq", "sync_params")
    COUNTERS = ("updates", "var_interval", "var_counter", "local_step_interval", "local_step_counter",
                "lrs", "last_sync", "var_updates", "freeze_state")

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int | float | str | AutoFreeze = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        *,
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
    ) -> None:
        self._options = options(locals())  # a cohort of groups added later is built with them
        defaults = adam_defaults(lr, betas, eps, weight_decay)
        super().__init__(params, defaults, group=group, bucket_cap_mb=bucket_cap_mb, nonfinite=nonfinite,
                         auto_mask=auto_mask, compression=compression, variance_floor=variance_floor,
                         update_clip=update_clip, block=block,
                         error_dtype=error_dtype, variance_dtype=variance_dtype)
        if any(g.get("non_freeze", False) for g in self.param_groups):
            raise ValueError("params: non_freeze groups are an OnebitAdam option; ZeroOneAdam has none")
        self.schedule = FreezeSchedule("var_freeze_step", var_freeze_step)
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = check_int("var_update_scaler", var_update_scaler, low=1)
        self.local_step_scaler = check_int("local_step_scaler", local_step_scaler, low=1)
        self.local_step_clipper = check_int("local_step_clipper", local_step_clipper, low=1)
        self.updates = 0
        self.var_interval, self.var_counter = 1, 0
        self.local_step_interval, self.local_step_counter = 1, 0
        self.lrs = [0.0] * len(self.param_groups)  # learning rates summed since the last sync
        self.last_sync = 0  # the last update after which the replicas were identical
        self.var_updates = 0  # variance updates so far
        # at rest after a synchronisation (issue 56): the momentum as the sync's messages and the groups'
        # nl, sync_params as p itself, the accumulator freed (see _rest); None while they are held
        self._kept: dict | None = None
        self.register_state_dict_pre_hook(ZeroOneAdam._checkpoint_wake)
        self.register_load_state_dict_pre_hook(ZeroOneAdam._forget_rest)
        if overlap:
            self._enable_overlap(self._compresses_gradients, self._load_grad)

    def add_param_group(self, param_group: dict) -> None:
        """As the base class's; a group that joins this optimizer's own (before the first update)
        starts its summed learning rate at zero (a cohort has its own)."""
        super().add_param_group(param_group)
        if hasattr(self, "lrs") and "cohort" not in param_group:  # (torch's constructor: before lrs exists)
            self.lrs.append(0.0)

    def _compresses_gradients(self) -> bool:
        """Whether the next step sends the gradient through compressed_allreduce (phase 1)."""
        return self.phase == 1 and not self.wants_averaged_gradients()

    @property
    def phase(self) -> int:
        """1 while the variance still updates, 2 once it is frozen (local steps)."""
        return 1 if self.frozen_at is None else 2

    def _variance_samples(self) -> int:
        return self.var_updates

    def _stale_variance(self) -> bool:
        return self.var_updates > 0

    def _frozen_for_good(self) -> bool:
        return self.phase == 2

    def _stale_bc2(self, g: dict) -> float:
        """Preconditioned: the variance holds ``var_updates`` updates, so it estimates
        ``(1 - b2^var_updates) E[g^2]``; divide that out (docs/ALGORITHMS.md 6.4)."""
        if not self.preconditioned or self.var_updates == 0:  # (no stale step comes before the first)
            return 1.0
        return 1.0 - g["betas"][1] ** self.var_updates

    def _load_grad(self, k: int, p: torch.Tensor, g: dict, view: torch.Tensor) -> None:
        """Phase 1's compressed steps: the accumulator view carries this rank's gradient (zero
        where it has none), divided by the stale denominator when preconditioned."""
        if p.grad is None:
            view.zero_()
        elif self.preconditioned:
            torch.div(p.grad, self.stale_denominator(k, p, g), out=view)
        else:
            view.copy_(p.grad)

    @property
    def stage(self) -> str:
        return f"phase {self.phase}"

    def steps_to_compression(self) -> int | None:
        """Updates left before the first compressed one: phase 1 compresses its first gradient
        once ``var_update_scaler`` variance updates doubled the interval, phase 2 syncs with a
        compressed all-reduce from its first step; 0 from then on."""
        if self.var_interval > 1 or self.phase == 2:
            return 0
        doubling = self.var_update_scaler - self.var_counter  # variance updates until the interval doubles
        freeze = self.schedule.steps_left(self.updates)  # None under "auto": it may come earlier
        return doubling if freeze is None else min(doubling, freeze)

    @property
    def replicas_identical(self) -> bool:  # and every cohort's (groups added later: their own syncs)
        return self.last_sync == self.updates and all(c.replicas_identical for c in self._cohorts)

    def wants_averaged_gradients(self) -> bool:
        return self.phase == 1 and (self.updates + 1) % self.var_interval == 0

    # -- the state at rest after a synchronisation (issue 56; docs/ALGORITHMS.md 6.4) ------------------
    def _rest(self, messages: list, nl: list[float]) -> None:
        """After a synchronisation whose every bucket's gathered message is in ``messages``: the
        momentum is ``m = (mean d) / nl`` (``mean / nl`` in momentum mode) of the messages' decode,
        ``sync_params`` is ``p`` and the accumulator is zero: none is held until the next step
        (:meth:`_wake`) reads them. ``nl``: each group's minus summed learning rates at the sync."""
        self._kept = {"messages": messages, "nl": nl}
        reducer = self.reducer()
        for p, _ in self.compressed_params():
            self.state[p].pop("exp_avg", None)
            self.state[p].pop("sync_params", None)
        for b in reducer.buckets:
            reducer.release(b)

    def _wake(self) -> None:
        """The momentum, ``sync_params`` and the accumulator made again from what :meth:`_rest` kept
        (bitwise what the synchronisation wrote): before a step, and for ``state_dict()``."""
        kept, self._kept = self._kept, None
        if kept is None:
            return
        reducer = self.reducer()
        pairs = self.compressed_params()
        if _fused.wake(self, reducer, pairs, kept):  # every bucket in one launch (GPU)
            return
        index = {id(g): i for i, g in enumerate(self._own_groups())}
        for b, message in zip(reducer.buckets, kept["messages"], strict=True):
            mean = torch.empty(b.n, dtype=torch.float32, device=reducer.device)
            if message is not None:
                gathered, layout = message
                decompress(gathered, mean, layout.W, padded=layout.N, block=layout.block)
            for k, off, size in zip(b.indices, b.offsets, b.numels, strict=True):
                p, g = pairs[k]
                u, nl = mean[off : off + size].view(p.shape), kept["nl"][index[id(g)]]
                state = self.state[p]
                if self.preconditioned:
                    frozen = self.frozen_variance(k, p, g)
                    m = state["exp_avg"] = torch.empty_like(u)
                    if frozen is None or not cpu_fused.zoa_momentum_(m, u, *frozen, nl):
                        torch.mul(u, self.stale_denominator(k, p, g), out=m).div_(nl)
                else:
                    state["exp_avg"] = u.clone().div_(nl)
                state["sync_params"] = p.detach().to(torch.float32, copy=True)

    def _checkpoint_wake(self) -> None:
        """``state_dict()`` holds every state tensor: the momentum and ``sync_params`` made again, the
        released accumulator too (zero)."""
        self._wake()
        self.reducer().materialise()

    def _forget_rest(self, state_dict: dict) -> None:
        """A load replaces the state: nothing kept at rest applies."""
        self._kept = None

    def _missing_dense(self) -> tuple[str, ...]:
        if getattr(self, "_kept", None) is not None:  # at rest: made by the next wake, not as zeros here
            return tuple(n for n in self.DENSE_STATE if n not in ("exp_avg", "sync_params"))
        return self.DENSE_STATE

    def _bind_views(self, reducer) -> None:
        super()._bind_views(reducer)
        if getattr(self, "_kept", None) is not None:  # at rest: the views made again hold no momentum
            for p, _ in self.compressed_params():
                self.state[p].pop("exp_avg", None)
                self.state[p].pop("sync_params", None)

    def _take_step(self) -> None:
        if self.updates == self.frozen_at:  # phase 2's first step: the variance is stored in variance_dtype
            self._narrow_variance()  # from here on (not at phase 1's last step: a skip agreed on the
            # device may still undo that one, docs/ALGORITHMS.md 12.1)
        self._wake()
        reducer = self.reducer()
        phase = self.phase
        if phase == 2 and self.updates == self.frozen_at:
            reducer.reset_errors()  # errors change domain: gradients -> accumulated updates
        self.updates += 1
        t = self.updates
        pairs = self.compressed_params()
        if phase == 1:
            self._phase_one(reducer, pairs, t)
            self.last_sync = t
            self._observe_variance()
        else:
            self._phase_two(reducer, pairs, t)

    def _agreement_on_device(self):
        """The steps that agree on the device (optimizers/_device_agreement.py), each rank's verdict a
        float32 poison: phase 1's compressed steps in the fused Triton passes (the poison in the messages'
        scales, the decompress pass gated by them, as OnebitAdam's; a fixed ``var_freeze_step``), and
        phase 2's steps but its first, where the local step is the one Triton launch (the poison summed
        over the ranks on the device: one all-reduce, nothing read back; the launch leaves every tensor
        where the sum is NaN) and a synchronisation runs in the fused Triton passes (the summed poison
        in every message, the decompress pass gated by the gathered scales: errors, momenta,
        ``sync_params`` and parameters left as they were). The host's counters (``COUNTERS``: the update
        count, the schedules, the summed learning rates) are kept before the step and put back when the
        skip is learnt, at the next step (it waits for the flag: the counters choose that step's kind);
        so is the state at rest (:meth:`_rest`) before a synchronisation: a skipped one rested on NaN
        messages. Phase 1's variance steps in Triton agree on the device as the local steps do (the poison
        summed over the ranks, the moments' and the stale step's launches gated by it); the first step of
        phase 2 agrees on the host."""
        if self.phase == 1:
            return self._phase_one_agreement()
        if self.updates == self.frozen_at:
            return None
        t = self.updates + 1
        if t == self.frozen_at + 1:
            return None
        reducer = self.reducer()
        if not self._may_agree_on_device(reducer.device):
            return None
        before = self._kept  # the state at rest before this step (None: held)
        self._wake()  # what the step does first (its local step reads the momentum)
        pairs, masks = self.compressed_params(), self.auto_masks()
        if not _fused.local_applies(self, pairs, masks):
            return None
        if t % self.local_step_interval == 0 and not self._sync_agrees_on_device(reducer, pairs):
            return None
        agreement = self._new_agreement(pairs, reducer, snapshot=True, summed=True)
        agreement.rest_before = before
        return agreement

    def _sync_agrees_on_device(self, reducer, pairs) -> bool:
        """Whether this step's synchronisation can agree on the device: the fused Triton passes, and every
        group moved since the last one (a group at lr 0 all along takes the exact all-reduce)."""
        if any(lrs + g["lr"] == 0.0 for lrs, g in zip(self.lrs, self._own_groups(), strict=True)):
            return False
        if not _fused.zoa_applies(self, reducer, pairs, phase=2):
            return False
        return _fused.plan(self, "_zos_cache", reducer, _fused.ZeroOneSync).agrees_on_device()

    def _undo_skipped(self, agreement) -> None:
        super()._undo_skipped(agreement)
        before = getattr(agreement, "rest_before", None)
        if before is not None:  # a synchronisation skipped on the device rested on its NaN messages
            self._kept = before

    def _phase_one_agreement(self):
        """Phase 1's step (compressed, or a variance step in Triton) agreed on the device, where it applies
        (see _agreement_on_device)."""
        if self.schedule.auto is not None:
            return None  # an automatic freeze (it reads the variance)
        reducer = self.reducer()
        if not self._may_agree_on_device(reducer.device):
            return None
        pairs = self.compressed_params()
        if (self.updates + 1) % self.var_interval == 0:  # a variance step: its poison summed over the ranks,
            # its moments and stale step gated by it (no collective of its own carries it)
            if not _fused.variance_applies(self, reducer, pairs):
                return None
            return self._new_agreement(pairs, reducer, snapshot=True, summed=True)
        if not _fused.zoa_applies(self, reducer, pairs) or not self._zoa_plan(reducer).agrees_on_device():
            return None
        return self._new_agreement(pairs, reducer, snapshot=True)

    def _counts_enter_update(self) -> bool:
        return True  # the counters choose each step's kind (a local step, a synchronisation, phase 1's)

    def _prepare_step(self) -> bool | None:
        """Phase 1's fused compressed step (optimizers/_fused.py): its worker pass before the
        agreement, the messages' scales giving this rank's verdict (the pass changes no state)."""
        if not self._compresses_gradients() or self._overlap is not None:
            return None
        reducer, pairs = self.reducer(), self.compressed_params()
        if not _fused.zoa_applies(self, reducer, pairs):
            return None
        return _fused.prepared_verdict(self, self._zoa_plan(reducer), pairs)

    def _abandon_step(self) -> None:
        plan = getattr(self, "_zoa_cache", None)
        if plan is not None:
            plan.abandon()

    def _zoa_plan(self, reducer):
        return _fused.plan(self, "_zoa_cache", reducer, _fused.ZeroOneStep)

    def _phase_one(self, reducer, pairs, t: int) -> None:
        var_step = t % self.var_interval == 0
        prepared = getattr(getattr(self, "_zoa_cache", None), "ready", None) is not None  # applies held
        fused = not var_step and (prepared or not self._overlapped)
        if fused and (prepared or _fused.zoa_applies(self, reducer, pairs, during=True)):
            # the gradient's compressed mean, the fold and the stale step inside the codec's passes
            self._zoa_plan(reducer).step(self, pairs, t)
        else:
            self._phase_one_unfused(reducer, pairs, var_step)
        if var_step:
            self.var_counter += 1
            if self.var_counter == self.var_update_scaler:
                self.var_counter = 0
                self.var_interval *= 2

    def _phase_one_unfused(self, reducer, pairs, var_step: bool) -> None:
        if var_step and _fused.variance_applies(self, reducer, pairs):  # two launches, whatever the buckets
            plan = _fused.plan(self, "_zov_cache", reducer, _fused.VarianceStep)
            plan.moments(self, pairs)
            self._variance_changed()
            self.var_updates += 1
            plan.stale(self, pairs)
            return
        if var_step:
            for _, p, g, grad in self.averaged_gradients(reducer, pairs):
                moments_(self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"], grad, g["betas"])
            self._variance_changed()
            self.var_updates += 1
        else:  # the accumulator is zero in phase 1: it carries the compressed gradient
            if not self._overlapped:  # overlap=True copied and all-reduced it during backward
                for k, (p, g) in enumerate(pairs):
                    self._load_grad(k, p, g, reducer.views[k])
                reducer.compressed_mean_()
            masks = self.auto_masks()
            if not self._fold_all(pairs, reducer.views, masks):
                self._fold_each(pairs, reducer.views, masks)
        if not self._stale_step_all(pairs):
            self._stale_step_each(pairs)

    def _fold_each(self, pairs, views, masks) -> None:
        """Phase 1: the decompressed mean gradient into the momentum, then the accumulator zeroed."""
        for k, ((p, g), dead) in enumerate(zip(pairs, masks, strict=True)):
            grad = mask_(views[k], dead, g.get("exp_avg_mask"))
            m, b1 = self.state[p]["exp_avg"], g["betas"][0]
            if self.preconditioned:  # m = b1*m + (1-b1) * mean(g / denom) * denom
                m.mul_(b1).addcmul_(grad, self.stale_denominator(k, p, g), value=1 - b1)
            else:
                fold_(m, grad, g["betas"][0])
            grad.zero_()

    def _stale_step_each(self, pairs) -> None:
        for k, (p, g) in enumerate(pairs):
            m, v = self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]
            # even on a variance step m holds compressed gradients that v has never seen
            # (a coordinate first hit between variance steps has v = 0): floor and clip always
            if self._reference_maths():
                update = direction(p, m, v, g["eps"], g["weight_decay"])
            else:
                frozen = self.frozen_variance(k, p, g)
                if frozen is not None and cpu_fused.stale_step_(p, m, *frozen, lr=g["lr"],
                                                                weight_decay=g["weight_decay"],
                                                                clip=self.update_clip):
                    continue  # the same maths in one pass (CPU), d computed from v in it
                update = stale_direction(p, m, self.stale_denominator(k, p, g), g["weight_decay"],
                                         self.update_clip)
            p.add_(update, alpha=-g["lr"])

    def _phase_two(self, reducer, pairs, t: int) -> None:
        if t == self.frozen_at + 1:  # replicas are identical here: remember them
            for p, _ in pairs:
                self.state[p]["sync_params"].copy_(p)
            reducer.release_scratch()  # phase 1's variance steps were the last to average
        masks = self.auto_masks()
        if not self._local_step_all(pairs, masks):
            self._local_step_each(pairs, masks)
        for i, g in enumerate(self._own_groups()):
            self.lrs[i] += g["lr"]
        if t % self.local_step_interval == 0:
            self._sync(reducer, pairs, masks, t)
        if self._kept is None:  # zero between phase 2's steps, made again by the next sync that reads it
            for b in reducer.buckets:
                reducer.release(b)
        self.local_step_counter += 1
        if self.local_step_counter == self.local_step_scaler:
            self.local_step_counter = 0
            self.local_step_interval = min(self.local_step_clipper, self.local_step_interval * 2)

    def _local_step_each(self, pairs, masks) -> None:
        reference = self._reference_maths()
        for k, ((p, g), dead) in enumerate(zip(pairs, masks, strict=True)):
            state = self.state[p]
            frozen = None if reference or dead is not None else self.frozen_variance(k, p, g)
            if frozen is not None and cpu_fused.local_step_(
                    p, state["exp_avg"], p.grad, *frozen, beta1=g["betas"][0],
                    lr=g["lr"], weight_decay=g["weight_decay"], clip=self.update_clip):
                continue  # fold and step in one pass (CPU), d computed from v in it
            m = mask_(fold_(state["exp_avg"], p.grad, g["betas"][0]), dead, None)
            if reference:
                update = direction(p, m, state["exp_avg_sq"], g["eps"], g["weight_decay"])
            else:
                update = stale_direction(p, m, self.stale_denominator(k, p, g), g["weight_decay"],
                                         self.update_clip)
            p.add_(update, alpha=-g["lr"])

    # -- GPU: one multi-tensor op per param group instead of one op per tensor (optimizers/_multi.py)
    def _multi(self, pairs) -> bool:
        return not self._reference_maths() and _multi.applies([p for p, _ in pairs])

    def _fold_all(self, pairs, views, masks) -> bool:
        if (not self._multi(pairs) or any(d is not None for d in masks)
                or any(g.get("exp_avg_mask") is not None for _, g in pairs)):
            return False
        if self.preconditioned:  # the denominators made batch by batch (bounded transients)
            for batch in _multi.in_batches(pairs):
                rows = [(g, self.state[p]["exp_avg"], views[k], self.stale_denominator(k, p, g))
                        for k, (p, g) in batch]
                for g, ms, xs, denoms in _multi.by_group(rows):
                    _multi.fold_scaled_(ms, xs, denoms, g["betas"][0])
        else:
            for g, ms, xs in _multi.by_group((g, self.state[p]["exp_avg"], views[k]) for k, (p, g) in
                                             enumerate(pairs)):
                _multi.fold_(ms, xs, g["betas"][0])
        torch._foreach_zero_(list(views))
        return True

    def _stale_step_all(self, pairs) -> bool:
        if not self._multi(pairs):
            return False
        for batch in _multi.in_batches(pairs):
            rows = [(g, p, self.state[p]["exp_avg"], self.stale_denominator(k, p, g)) for k, (p, g) in batch]
            for g, ps, ms, denoms in _multi.by_group(rows):
                _multi.stale_step_(ps, ms, denoms, lr=g["lr"], weight_decay=g["weight_decay"],
                                   clip=self.update_clip)
        return True

    def _local_step_all(self, pairs, masks) -> bool:
        if _fused.local_applies(self, pairs, masks):  # one Triton launch (GPU)
            plan = getattr(self, "_local_cache", None)
            if plan is None:
                plan = self._local_cache = _fused.LocalStep()
            plan.step(self, pairs)
            return True
        if not self._multi(pairs) or any(d is not None for d in masks):
            return False
        for batch in _multi.in_batches(pairs):
            rows = [(g, p, self.state[p]["exp_avg"], p.grad, self.stale_denominator(k, p, g))
                    for k, (p, g) in batch]
            for g, ps, ms, grads, denoms in _multi.by_group(rows):
                _multi.fold_(ms, grads, g["betas"][0])
                _multi.stale_step_(ps, ms, denoms, lr=g["lr"], weight_decay=g["weight_decay"],
                                   clip=self.update_clip)
        return True

    def _sync(self, reducer, pairs, masks, t: int) -> None:
        """Phase 2's synchronisation: the replicas average their accumulated updates ``u``
        (momentum: in momentum space, ``u * denom``; preconditioned: as they are) and set the
        momentum to ``-mean(u) * denom / lrs``; afterwards they are bitwise identical. On an x86
        CPU or a GPU (preconditioned) inside the codec's passes (optimizers/_fused.py). A group whose
        learning rates summed to 0 since the last sync (a schedule at 0, a frozen group) did not move:
        it stays where it is and its momentum becomes the ranks' exact mean (docs/ALGORITHMS.md 6.4)."""
        index = {id(g): i for i, g in enumerate(self._own_groups())}
        still = {i for i, lr in enumerate(self.lrs) if lr == 0.0}
        if not still and _fused.zoa_applies(self, reducer, pairs, phase=2):
            plan = _fused.plan(self, "_zos_cache", reducer, _fused.ZeroOneSync)
            plan.step(self, pairs, t)
            nl = [-lr for lr in self.lrs]
            self.lrs = [0.0] * len(self._own_groups())
            self.last_sync = t
            messages, plan.messages = plan.messages, []  # the plan holds none between steps
            # agreed on the device: at rest only where the step began at rest (a skip, learnt at the next
            # step, puts back what rested before it; a held state is left as it was by the gated passes)
            agreement = self._on_device
            rests = agreement is None or agreement.rest_before is not None
            if rests and self._may_keep(reducer, pairs, masks) and None not in messages:
                self._rest(messages, nl)
            elif agreement is not None:
                agreement.rest_before = None
            return

        def denom(k, p, g):  # made where it is read, once before the collective and once after
            if self._reference_maths():
                return self.state[p]["exp_avg_sq"].float().sqrt() + g["eps"]
            return self.stale_denominator(k, p, g)

        for k, (p, g) in enumerate(pairs):
            u, state = reducer.views[k], self.state[p]
            torch.sub(p, state["sync_params"], out=u)  # the local steps' accumulated update
            if not self.preconditioned:
                u.mul_(denom(k, p, g))
        kept = reducer.compressed_mean_(keep=not still and self._may_keep(reducer, pairs, masks))
        self._average_momenta([self.state[p]["exp_avg"] for p, g in pairs if index[id(g)] in still])
        for k, ((p, g), dead) in enumerate(zip(pairs, masks, strict=True)):
            state, u = self.state[p], mask_(reducer.views[k], dead, g.get("exp_avg_mask"))
            sync = state["sync_params"]
            if index[id(g)] in still:  # no local step moved it (x = 0): nothing to apply, m averaged above
                p.copy_(sync)
            elif self.preconditioned:
                torch.mul(u, denom(k, p, g), out=state["exp_avg"]).div_(-self.lrs[index[id(g)]])
                sync.add_(u)
            else:
                state["exp_avg"].copy_(u).div_(-self.lrs[index[id(g)]])
                sync.add_(u / denom(k, p, g))
            p.copy_(sync)
            u.zero_()
        nl = [-lr for lr in self.lrs]
        self.lrs = [0.0] * len(self._own_groups())
        self.last_sync = t
        if kept is not None:
            self._rest(kept, nl)

    def _average_momenta(self, momenta: list[torch.Tensor]) -> None:
        """The exact mean over the ranks of ``momenta`` (one full-precision all-reduce): the momentum of
        a group that did not move since the last sync, the same bits on every rank."""
        if not momenta or self.world_size == 1:
            return
        flat = torch.cat([m.reshape(-1) for m in momenta])
        with guard("ZeroOneAdam momentum all_reduce (a group at lr 0)", self.process_group):
            dist.all_reduce(flat, group=self.process_group)
        flat.div_(self.world_size)
        self.count_sent(flat.numel(), flat.element_size())
        offset = 0
        for m in momenta:
            m.copy_(flat[offset : offset + m.numel()].view_as(m))
            offset += m.numel()
