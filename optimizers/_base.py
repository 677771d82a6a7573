"""Machinery shared by the 1-bit optimizers: parameter order, reducers, exact resume.

State layout: the compressed per-parameter state (``FLAT_STATE``, e.g. ``exp_avg``) lives
in the flat buckets of a :class:`~onebit.collectives.bucket.BucketedReducer` and
``self.state[p]`` holds views of it; other per-parameter state is float32 tensors of the
parameter's shape. ``state_dict()`` adds an ``"onebit"`` entry with this rank's error
buffers, the bucket layout, rank, world size and the optimizer's counters; loading restores
all of it when the same rank loads its own state at the same world size (otherwise the
errors are reset, with one warning). Float32 state is restored as float32 whatever the
parameters' dtype (torch would cast it to the parameter dtype).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ..collectives._failure import guard
from ..collectives._group import comm_device, gather_json, group_size, warn_collective, warn_user
from ..collectives.bucket import BucketedReducer
from ..collectives.mesh import flat_group, hierarchy, is_mesh
from ..collectives.telemetry import CallTimer
from ..collectives.wire import Traffic, traffic
from ..kernels._checks import check_betas, check_choice, check_fraction, check_number
from ..kernels.layout import check_block
from ._clip import clip_grads_
from ._freeze import DEFAULT_FREEZE, FreezeSchedule
from ._functional import sqrt_v_floors, stale_denominator, tiny_variance_mask
from ._overlap import BackwardOverlap
from ._sharded import Sharding, local_params, to_local
from .ddp import adopt_ddp_model


def adam_defaults(lr: object, betas: object, eps: object, weight_decay: object, **extra: Any) -> dict:
    """The validated hyper-parameters every 1-bit optimizer shares, plus group options."""
    return dict(
        lr=check_number("lr", lr),
        betas=check_betas("betas", betas),
        eps=check_number("eps", eps),
        weight_decay=check_number("weight_decay", weight_decay),
        non_freeze=False,
        exp_avg_mask=None,
        **extra,
    )


NONFINITE_POLICIES = ("skip", "raise", None)
COMPRESSIONS = ("preconditioned", "momentum")
VARIANCE_FLOOR = 0.1  # default: docs/ALGORITHMS.md section 6 and bench/RESULTS.md say why
UPDATE_CLIP = 1.0  # default with compression="preconditioned" (ALGORITHMS.md section 6)
MODE_DEFAULT = "default"  # update_clip: UPDATE_CLIP when preconditioned, None with "momentum"


def closure_loss(closure) -> Any:
    """Evaluate an optimizer closure with gradients enabled (step() runs under no_grad)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class OnebitOptimizerBase(torch.optim.Optimizer):
    """Base class: subclasses set FLAT_STATE / DENSE_STATE and implement step().

    ``nonfinite`` decides what a non-finite gradient on ANY rank does (checked at the start
    of every step with a one-element all-reduce and a host sync, before any state
    changes): ``"skip"`` (default) skips the step on every rank with a RuntimeWarning naming
    the ranks (``skipped_steps`` counts them), ``"raise"`` raises FloatingPointError on every
    rank, ``None`` checks nothing (non-finite values then reach the parameters on every rank
    alike; the error buffers stay finite). onebit's GradScaler makes the check unnecessary
    and it is skipped under ``scaler.step``. ``step(check=True)`` first verifies that all
    ranks agree on parameters, stage and counters (:meth:`verify_ranks`).
    """

    FLAT_STATE: tuple[str, ...] = ()
    DENSE_STATE: tuple[str, ...] = ()
    SCALAR_STATE: dict[str, float] = {}  # float64 0-dim tensors per parameter, initial values
    COUNTERS: tuple[str, ...] = ()
    FLAT_PADDING = False  # flat buffers include the padding (compressed as data)
    UPDATE_CLIP: float | None = UPDATE_CLIP  # update_clip's default with compression="preconditioned"
    SHARDED = False  # supports DTensor (FSDP2/HSDP) parameters (optimizers/_sharded.py)

    def __init__(
        self, params, defaults: dict[str, Any], *, group, bucket_cap_mb: float,
        nonfinite: str | None = "skip", auto_mask: float | None = None,
        compression: str = "preconditioned", variance_floor: float | None = VARIANCE_FLOOR,
        update_clip: float | str | None = MODE_DEFAULT, block: int | None = None,
    ) -> None:
        # a 2-D DeviceMesh: hierarchical compressed all-reduces; everything else (full-precision
        # averaging, agreement checks) on the group of all its ranks
        self._mesh = group if is_mesh(group) else None
        self.hierarchy = None if self._mesh is None else hierarchy(self._mesh)
        group = flat_group(group)
        self.world_size = group_size(group)  # validates group before anything is built
        self.block = check_block(block)
        self.bucket_cap_mb = check_number("bucket_cap_mb", bucket_cap_mb)
        self.nonfinite = check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        self.auto_mask = check_fraction("auto_mask", auto_mask, optional=True)
        self.compression = check_choice("compression", compression, COMPRESSIONS)
        self.variance_floor = check_fraction("variance_floor", variance_floor, optional=True)
        if isinstance(update_clip, str) and update_clip == MODE_DEFAULT:
            update_clip = self.UPDATE_CLIP if compression == "preconditioned" else None
        self.update_clip = check_number("update_clip", update_clip, low_open=True, optional=True)
        self._floors: list[torch.Tensor | None] | None = None  # per compressed param; from v
        self._denominators: dict[int, tuple[tuple, torch.Tensor]] = {}  # k -> (eps, bc2, ...), d
        self._masks: list[torch.Tensor | None] | None = None  # per compressed param; from v
        self.masked_coordinates = 0
        self._mask_warned = False
        self._default_warned = False  # said once that this run has not compressed (stats() or exit)
        self._ddp_checked = False  # the first step looked for a DDP model and compared replicas
        self._foreign_state = False  # a loaded state came from another rank: said at the next step
        super().__init__(params, defaults)
        self.process_group = group
        # DTensor parameters (HSDP): compress across the mesh's replicate dimension, agree over
        # all its ranks (the control group); FSDP averages the warm-up's gradients itself
        self._sharding = Sharding.detect(self.param_groups, group, type(self).__name__, self.SHARDED)
        self.control_group = group
        if self._sharding is not None:
            self.process_group, self.world_size = self._sharding.replicate_group, self._sharding.replicas
            self.control_group = self._sharding.control_group
            self._sharding.adopt([p for g in self.param_groups for p in g["params"]])
        self.skipped_steps = 0  # steps skipped for non-finite gradients (saved with the state)
        self._grads_verified = False  # set by onebit's GradScaler around the step it lets through
        self._reducer: BucketedReducer | None = None
        # bytes this optimizer, its DDP hook and its backward overlap sent (stats(); saved)
        self.traffic = Traffic()
        self._last_seconds: tuple[int, dict[str, float]] = (0, {})  # updates, seconds at the last stats()
        self._pending: dict[str, Any] | None = None
        self._rank_state_loaded: dict[str, Any] | None = None  # load_rank_state's, for the next load
        # set by register_ddp_hook: DDP averages when asked; FSDP does for DTensor parameters
        self.external_averaging = self._sharding is not None
        self._overlap: BackwardOverlap | None = None  # set by subclasses that offer overlap=True
        self._overlapped = False  # this step's compressed all-reduces ran from backward
        self.register_state_dict_post_hook(OnebitOptimizerBase._add_extra_state)
        self.register_load_state_dict_pre_hook(OnebitOptimizerBase._stash_loaded_state)
        self.register_load_state_dict_post_hook(OnebitOptimizerBase._restore_loaded_state)
        # at interpreter exit, group rank 0 says whether this optimizer never compressed
        self._group_rank = self._rank()
        _LIVE.add(self)

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

    def add_param_group(self, param_group: dict) -> None:
        """As torch's, before training starts. Refused once the optimizer has built its buckets
        and error buffers (the first step) or its backward hooks (``overlap=True``): every rank
        would need the same new buckets at the same step, and the saved states would no
        longer match the model."""
        started = getattr(self, "_reducer", None) is not None or any(self.state.values())
        if started or getattr(self, "_overlap", None) is not None:
            when = "training started" if started else "overlap=True hooked backward at construction"
            raise ValueError(
                f"add_param_group: {type(self).__name__} fixes its buckets, error buffers and hooks "
                f"when they are made, and {when}; pass every parameter group to the constructor "
                "(a group with lr=0 keeps parameters still until you raise its lr)")
        super().add_param_group(param_group)

    def wants_averaged_gradients(self) -> bool:
        """Whether the next step() uses full-precision gradients averaged over the group."""
        raise NotImplementedError

    @property
    def stage(self) -> str:
        """The schedule stage of the next step, for messages and the rank agreement check."""
        raise NotImplementedError

    @property
    def replicas_identical(self) -> bool:
        """Whether the parameters are bitwise identical on every rank after the last step
        (always, except between 0/1 Adam's synchronisations)."""
        return True

    # -- step: agreement check, non-finite gradients, then the subclass's update ---------
    @torch.no_grad()
    def step(self, closure=None, *, check: bool = False):
        """One update. ``check=True`` first verifies that all ranks agree (see verify_ranks).
        Non-finite gradients on any rank: see the ``nonfinite`` argument."""
        loss = closure_loss(closure)
        with local_params(self):  # DTensor parameters: the maths runs on the local slices
            self._step(check)
        if self._sharding is not None:  # FSDP all-reduces across replicas only when asked
            self._sharding.reduction.full(self.wants_averaged_gradients())
        return loss

    def _state_initialisation(self) -> bool:
        """torch.distributed.checkpoint's ``_init_optim_state`` (and torchtitan's checkpoint) builds an
        optimizer's state with one ``step()`` at lr 0 on zero gradients before the first real one:
        recognised here, it builds the state and counts no update."""
        if self.state or getattr(self, "updates", 0) or self.skipped_steps:
            return False
        params = [(p, g) for g in self.param_groups for p in g["params"]]
        if any(g.get("lr", 0.0) != 0 for g in self.param_groups) or not params:
            return False
        if any(p.grad is None or bool(p.grad.any()) for p, _ in params):
            return False
        self.reducer()
        return True

    def _step(self, check: bool) -> None:
        if self._state_initialisation():
            return
        if not self._ddp_checked:
            self._ddp_checked = True
            if self.world_size > 1 and not self.external_averaging:
                adopt_ddp_model(self)
            if self.world_size > 1 and self.replicas_identical:
                self._verify_first_replicas()
        overlap = self._overlap
        if overlap is None or not overlap.wanted():
            if check:
                self.verify_ranks()
            if self._gradients_usable():
                averaged = self._sharding is not None and self.wants_averaged_gradients()
                self._take_step()
                if averaged:
                    self._count_fsdp_all_reduce()
            return
        try:  # overlap=True: finish the collectives backward started, then agree and update
            if self._grads_verified:
                raise ValueError("overlap: the compressed all-reduces started in backward, before GradScaler "
                                 "unscaled the gradients; use overlap=False with a GradScaler")
            overlap.launch_rest()
            overlap.wait()
            if check:
                self.verify_ranks()
            if self._gradients_usable():
                self._overlapped = True
                self._take_step()
            else:
                overlap.restore()
        except BaseException:
            overlap.restore()
            raise
        finally:
            self._overlapped = False
            overlap.done()

    def _count_fsdp_all_reduce(self) -> None:
        """Count the full-precision all-reduce across replicas that FSDP made for this step's
        gradients (each parameter's slice padded to FSDP's equal row blocks), as the DDP hook counts
        DDP's."""
        params = [p for g in self.param_groups for p in g["params"]]
        for p, numel in zip(params, self._sharding.padded_numels, strict=True):
            if p.grad is not None:
                self.count_sent(numel, p.grad.element_size())

    def _enable_overlap(self, wanted, fill) -> None:
        """``overlap=True``: launch the compressed buckets from backward (see ``_overlap``).
        ``fill(k, p, group, view)`` writes compressed parameter k's contribution into its view."""
        if self._sharding is not None:
            raise ValueError("overlap: not with DTensor (FSDP2/HSDP) parameters, whose gradients FSDP hands "
                             "over after backward; use overlap=False")
        pairs, views = self.compressed_params(), self.reducer().views

        def fill_one(k: int) -> None:
            p, g = pairs[k]
            fill(k, p, g, views[k])

        self._overlap = BackwardOverlap(self.reducer(), [p for p, _ in pairs], wanted=wanted, fill=fill_one,
                                        backup=lambda: self.nonfinite is not None)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside this context do not start compressed all-reduces
        (``overlap=True``): for all but the last pass of a gradient accumulation."""
        if self._overlap is None:
            yield
            return
        self._overlap.paused += 1
        try:
            yield
        finally:
            self._overlap.paused -= 1

    def _take_step(self) -> None:
        """The optimizer's update, on gradients every rank has agreed are usable."""
        raise NotImplementedError

    def _describe(self) -> dict[str, Any]:
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
        if not grads:
            return True
        # A finite sum proves every element finite (NaN and inf propagate); one read per
        # gradient, several times cheaper than isfinite().all(). Only when the sum is not
        # finite (a non-finite element, or a float32 overflow of huge finite values) does
        # the exact elementwise test decide.
        if bool(torch.isfinite(torch.stack([gr.sum() for gr in grads]).sum())):
            return True
        return all(bool(torch.isfinite(gr).all()) for gr in grads)

    def _gradients_usable(self) -> bool:
        """Agree over the group whether every rank's gradients are finite (one single-element
        all-reduce and a host sync); on any non-finite gradient, every rank skips or raises
        before touching any state."""
        foreign = self._foreign_state
        if self.nonfinite is None or self._grads_verified:
            if foreign:  # no agreement this step: each rank that loaded a foreign state says so
                self._say_foreign_state(None)
            return True
        ok = self._local_gradients_finite()
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

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for this optimizer's parameters by a norm every rank
        agrees on: call it between ``backward()`` and ``step()``. Each rank's gradients are its
        own there (always without DDP, after the freeze with DDP), so torch's would clip by a
        different factor per rank. The norm is the p-mean over ranks of the local norms (for
        p = 2 their root mean square: at least the averaged gradient's norm, about ``sqrt(W)``
        times it where minibatch noise dominates); every rank scales by ``min(1, max_norm /
        (norm + 1e-6))``. One float64 all-reduce (counted in ``stats()['bytes_control']``);
        returns the norm (float64, bitwise the same on every rank). See docs/migrating.md."""
        with local_params(self):
            params = [p for g in self.param_groups for p in g["params"]]
            # DTensor parameters: every replica's norm sums its slices over the shard ranks
            norm = clip_grads_(params, max_norm, norm_type, self.control_group, replicas=self.world_size)
        if self._control_size() > 1:
            self.count_sent(1, 8, control=True)
        return norm

    def count_sent(self, numel: int, element_size: int, *, control: bool = False) -> None:
        """Count an all-reduce of ``numel`` elements that this optimizer (or its hook) made
        outside the reducer, in its own traffic and in onebit's per-process counter."""
        for counter in (self.traffic, traffic):
            counter.add_full(numel, self.world_size, element_size, control=control)

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

    def _communicate_average(self) -> bool:
        """Average in step() unless a DDP hook already did it for this step."""
        return not self.external_averaging

    def averaged_gradients(self, reducer: BucketedReducer, pairs: list[tuple[torch.Tensor, dict]]):
        """Yield ``(k, p, group, grad)`` for every compressed parameter, ``grad`` being its
        gradient averaged over the group in full precision (a view of the reducer's scratch
        buffer, valid until the next bucket is averaged). Bucket by bucket: the caller's
        update of one bucket runs before the next bucket is averaged. A missing ``.grad``
        counts as zero."""
        for bucket in reducer.buckets:
            grads = [pairs[i][0].grad for i in bucket.indices]
            avg = reducer.average(bucket, grads, self._communicate_average())
            for i, off, size in zip(bucket.indices, bucket.offsets, bucket.numels, strict=True):
                p, g = pairs[i]
                yield i, p, g, avg[off : off + size].view_as(p)

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

    def _variance_changed(self) -> None:
        self._masks = None
        self._floors = None
        self._denominators.clear()

    # -- preconditioned compression: variance floor, stale denominators ---------------------
    @property
    def preconditioned(self) -> bool:
        """Whether the compressed quantity is divided by Adam's denominator first
        (``compression="preconditioned"``, docs/ALGORITHMS.md section 6)."""
        return self.compression == "preconditioned"

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
        """Compressed parameter k (``p`` in group ``g``): ``max(sqrt(v), floor) / sqrt(bc2) + eps``.
        Cached until the variance changes (one model-sized float32 buffer: the stale steps then
        read it instead of recomputing it); callers must not modify it."""
        key = (g["eps"], self._stale_bc2(g), g.get("eps_inside_sqrt", False))
        found = self._denominators.get(k)
        if found is None or found[0] != key:
            d = stale_denominator(self.state[p][self.VARIANCE_STATE], self.sqrt_v_floors()[k], *key)
            found = self._denominators[k] = (key, d)
        return found[1]

    def floored_coordinates(self) -> int:
        """How many coordinates have their ``sqrt(v)`` raised to the floor now (0 before the
        variance goes stale, or without ``variance_floor``). One host synchronisation."""
        if self.variance_floor is None or not self._stale_variance():
            return 0
        pairs = self.compressed_params()
        counts = [(self.state[p][self.VARIANCE_STATE].sqrt() < floor).sum()
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
        ``ms_per_step_*``: per update since the previous ``stats()`` call."""
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

    # -- parameters and buffers -------------------------------------------------------
    def compressed_params(self) -> list[tuple[torch.Tensor, dict]]:
        """(param, group) of every parameter whose state is compressed, in a fixed order."""
        return [(p, g) for g in self.param_groups if not g.get("non_freeze", False) for p in g["params"]]

    def reducer(self) -> BucketedReducer:
        if self._reducer is None:
            with local_params(self):
                self._build_reducer()
        return self._reducer

    def _build_reducer(self) -> None:
        params = [p for p, _ in self.compressed_params()]
        devices = {p.device for p in params}
        if len(devices) > 1:
            names = sorted(map(str, devices))
            raise ValueError(f"params: expected all parameters on one device, got {names}")
        device = devices.pop() if devices else torch.device("cpu")
        self._reducer = BucketedReducer(
            [p.shape for p in params], device, group=self.process_group, mesh=self._mesh,
            bucket_cap_mb=self.bucket_cap_mb, flat_padding=self.FLAT_PADDING, block=self.block,
            traffic=self.traffic,
        )
        self._bind_state()

    def _bind_state(self) -> None:
        """Point every compressed parameter's flat state at its view of the reducer's buckets and
        give it the dense and scalar state it lacks. Run when the reducer is built and again
        after ``load_state_dict``: torch's loading replaces ``self.state`` wholesale, so a reducer
        built earlier (by ``state_dict()``, which Accelerate's ``load_state_dict(state_dict())``
        round trip calls before the first step) would otherwise keep buckets nobody reads."""
        reducer = self._reducer
        assert reducer is not None
        with local_params(self):
            self._bind_views(reducer)

    def _bind_views(self, reducer: BucketedReducer) -> None:
        (flat_name,) = self.FLAT_STATE  # one compressed quantity per parameter
        for k, (p, _) in enumerate(self.compressed_params()):
            state = self.state[p]
            view = reducer.views[k]
            old = state.get(flat_name)
            if old is not None and old is not view:
                view.copy_(old)
            state[flat_name] = view
            for name in self.DENSE_STATE:
                state.setdefault(name, torch.zeros_like(p, dtype=torch.float32))
            for name, value in self.SCALAR_STATE.items():
                state.setdefault(name, torch.tensor(value, dtype=torch.float64, device=view.device))

    def dense_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        for name in self.DENSE_STATE + self.FLAT_STATE:
            if name not in state:
                state[name] = torch.zeros_like(p, dtype=torch.float32)
        return state

    # -- state_dict -----------------------------------------------------------------
    def _rank(self) -> int:
        if self._control_size() == 1 or not dist.is_initialized():
            return 0
        return dist.get_rank(self.control_group)

    def _control_size(self) -> int:
        """Ranks that agree on every step: the group's, or all the mesh's with DTensor parameters."""
        return self.world_size if self._sharding is None else dist.get_world_size(self.control_group)

    def _mesh_shape(self) -> list[int] | None:
        """[nodes, ranks per node] on a 2-D mesh (the error buffers' layout), else None."""
        h, sharding = self.hierarchy, self._sharding
        if sharding is not None:  # HSDP: [replicas, shards]
            return [sharding.replicas, sharding.shards]
        return None if h is None else [h.nodes, h.per_node]

    def _add_extra_state(self, state_dict: dict) -> dict:
        reducer = self.reducer()
        state_dict["onebit"] = {
            "rank": self._rank(),
            "world_size": self.world_size,
            "mesh": self._mesh_shape(),
            "buckets": reducer.signature(),
            "worker_errors": [we for we, _ in reducer.errors()],
            "server_errors": [se for _, se in reducer.errors()],
            # with FLAT_PADDING the padding is data the next call compresses
            "flat_tails": [b.flat[b.n :] for b in reducer.buckets],
            "counters": {name: getattr(self, name) for name in self.COUNTERS + ("skipped_steps",)},
            "traffic": self.traffic.state(),
        }
        sharding = self._sharding
        if sharding is not None:  # DTensor parameters: their state as DTensors (what DCP saves per slice)
            params = [p for g in self.param_groups for p in g["params"]]
            for key, entry in list(state_dict["state"].items()):
                entry = state_dict["state"][key] = dict(entry)  # torch's entry is self.state's own dict
                for name in self.FLAT_STATE + self.DENSE_STATE:
                    if name in entry:  # bucket views cloned: torch.save fails on DTensors over views
                        local = entry[name].clone() if name in self.FLAT_STATE else entry[name]
                        entry[name] = sharding.wrap(local, params[key])
        return state_dict

    def _stash_loaded_state(self, state_dict: dict) -> dict:
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", None)
        # masks are configuration: the ones given at construction win over a checkpoint
        masks = [g.get("exp_avg_mask") for g in self.param_groups]
        tensors = {}
        new_state = {}
        # keys are the saved param_groups' ids: positions, or names (torch's DCP helpers use FQNs)
        saved = [k for g in state_dict["param_groups"] for k in g["params"]]
        position = {key: i for i, key in enumerate(saved)}
        for key, entry in state_dict["state"].items():
            entry = dict(entry)
            names = self.FLAT_STATE + self.DENSE_STATE + tuple(self.SCALAR_STATE)
            tensors[position[key]] = {n: to_local(entry.pop(n)) for n in names if n in entry}
            new_state[key] = entry
        state_dict["state"] = new_state
        self._pending = {"extra": extra, "tensors": tensors, "masks": masks}
        return state_dict

    def _restore_loaded_state(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        self._variance_changed()  # masks are a function of the loaded variance
        for g, mask in zip(self.param_groups, pending["masks"], strict=True):
            g["exp_avg_mask"] = mask
        params = [p for g in self.param_groups for p in g["params"]]
        self.reducer()
        self._bind_state()  # torch replaced self.state: the buckets' views go back in
        for key, values in pending["tensors"].items():
            p = params[key]
            state = self.state[p]
            for name, value in values.items():
                if name in state and state[name] is not None:
                    state[name].copy_(value)  # a view into a bucket, or a dense buffer
                else:
                    dtype = torch.float64 if name in self.SCALAR_STATE else torch.float32
                    state[name] = value.to(device=p.device, dtype=dtype).clone()
        extra = pending["extra"]
        if extra is None:  # DCP's optimizer state keeps no "onebit" entry: RankState brought this rank's
            extra = self._rank_state_loaded
        self._rank_state_loaded = None
        self._apply_rank_state(extra)

    def rank_state(self) -> dict:
        """This rank's own part of the state (error buffers, bucket layout, counters): the
        ``"onebit"`` entry of ``state_dict()``, which torch's and torchtitan's DCP helpers drop.
        :class:`onebit.checkpoint.RankState` saves it in a DCP checkpoint."""
        return self._add_extra_state({"state": {}})["onebit"]

    def load_rank_state(self, extra: dict) -> None:
        """Restore :meth:`rank_state` now, and again at the next ``load_state_dict`` whose state
        has no ``"onebit"`` entry (torch's ``set_optimizer_state_dict`` loads one after DCP)."""
        self._apply_rank_state(extra)
        self._rank_state_loaded = extra

    def _apply_rank_state(self, extra: dict | None) -> None:
        reducer = self.reducer()
        same = (
            extra is not None
            and extra.get("rank") == self._rank()
            and extra.get("world_size") == self.world_size
            and extra.get("mesh") == self._mesh_shape()
            and extra.get("buckets") == reducer.signature()
        )
        if same:
            for (we, se), we_saved, se_saved in zip(
                reducer.errors(), extra["worker_errors"], extra["server_errors"], strict=True
            ):
                we.copy_(we_saved)
                se.copy_(se_saved)
            for b, tail in zip(reducer.buckets, extra.get("flat_tails", []), strict=False):
                b.flat[b.n :].copy_(tail)
            # this rank's own state, loaded after another's (a framework's rank-0 checkpoint, then
            # onebit's per-rank file): nothing foreign is left to report
            self._foreign_state = False
        else:
            reducer.reset_errors()
            for b in reducer.buckets:
                b.flat[b.n :].zero_()
            self._foreign_state = True  # said once for the group at the next step (_say_foreign_state)
        if extra is not None:
            for name, value in extra.get("counters", {}).items():
                setattr(self, name, value)
            self.traffic = Traffic(**extra.get("traffic", {}))
            reducer.traffic = self.traffic
        if self._sharding is not None:  # the loaded counters decide FSDP's next reduction
            self._sharding.reduction.full(self.wants_averaged_gradients())


TIMED = ("codec", "comm", "full", "control")  # stats()'s seconds_* and ms_per_step_* (see telemetry)
_LIVE: weakref.WeakSet[OnebitOptimizerBase] = weakref.WeakSet()


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


class WarmupThenCompress(OnebitOptimizerBase):
    """1-bit Adam / LAMB schedule: full-precision warm-up until the freeze, then compression.

    ``freeze_step``: an int (exactly that many warm-up updates), ``math.inf`` (never
    compress), or ``"auto"`` / an :class:`~onebit.optimizers.AutoFreeze` (freeze when the
    variance settles; see :mod:`onebit.optimizers._freeze`). ``frozen_at`` reports it."""

    updates: int

    @property
    def compressing(self) -> bool:
        """True once the warm-up is over: the next step is compressed."""
        return self.frozen_at is not None

    def wants_averaged_gradients(self) -> bool:
        return not self.compressing

    @property
    def stage(self) -> str:
        return "compression" if self.compressing else "warm-up"

    def _variance_samples(self) -> int:
        frozen = self.frozen_at
        return self.updates if frozen is None else frozen

    def _stale_variance(self) -> bool:
        return self.compressing

    def _enter_compression(self) -> None:
        """Called once, right after the last warm-up update. Preconditioned: the momentum
        buffers change domain, ``m -> m / denom`` (denom frozen from here on), so that the
        compressed quantity and its error feedback live in update space (ALGORITHMS.md 6)."""
        self._variance_changed()
        if not self.preconditioned:
            return
        views = self.reducer().views
        for k, (p, g) in enumerate(self.compressed_params()):
            views[k].div_(self.stale_denominator(k, p, g))
