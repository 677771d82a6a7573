"""Machinery shared by the 1-bit optimizers: construction, the step's order of events,
parameter order and reducers. Each other concern has a module of its own, mixed into
:class:`OnebitOptimizerBase`:

  _agreement.py  replica fingerprints, verify_ranks, the non-finite check, foreign state
  _variance.py   momentum masks, variance floors, stale denominators, the freeze accessors
  _stats.py      stats(), the never-compressed warning
  _state_io.py   the state dict's "onebit" entry, load and restore, rank_state()
  _sharded.py    DTensor (HSDP) parameters; _clip.py the agreed clip; _overlap.py overlap=True;
  ddp.py         the DDP hook; _functional.py the update maths; _freeze.py the schedules

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

import contextlib
from contextlib import contextmanager
from typing import Any

import torch

from ..collectives._group import group_size, warn_collective
from ..collectives.bucket import BucketedReducer
from ..collectives.mesh import flat_group, hierarchy, is_mesh
from ..collectives.wire import Traffic, traffic
from ..kernels import backends
from ..kernels._checks import check_betas, check_choice, check_fraction, check_number
from ..kernels.layout import check_block
from ..kernels.rounding import check_error_dtype
from ._agreement import Agreement
from ._capture import Counts, capturing
from ._clip import clip_grads_
from ._cohorts import Cohorts
from ._copying import Copying
from ._overlap import BackwardOverlap
from ._sharded import Sharding, local_params
from ._state_io import StateIO
from ._stats import _LIVE, Telemetry
from ._variance import VarianceState, check_variance_dtype
from .ddp import adopt_ddp_model


def check_lr(name: str, value: object) -> float | torch.Tensor:
    """A learning rate: a number >= 0, or (as torch's optimizers take it) a 0-dim floating tensor
    holding one, kept as that tensor (a scheduler writes into it)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or not value.is_floating_point():
            raise ValueError(f"{name}: expected a number >= 0 or a 0-dim floating tensor, got a "
                             f"{value.dtype} tensor of shape {list(value.shape)}")
        check_number(name, float(value))
        return value
    return check_number(name, value)


@contextmanager
def float_lrs(groups: list[dict]):
    """Each group's learning rate as a Python float for the duration of a step (a 0-dim tensor's
    value read once per group and step: one host read on a GPU; the passes take scalars), the
    group's own tensor put back afterwards (a scheduler keeps writing into it)."""
    held = []
    for i, g in enumerate(groups):
        lr = g.get("lr")
        if isinstance(lr, torch.Tensor):
            held.append((g, lr))
            g["lr"] = float(check_lr(f"param_groups[{i}]['lr']", lr))
    try:
        yield
    finally:
        for g, lr in held:
            g["lr"] = lr


def adam_defaults(lr: object, betas: object, eps: object, weight_decay: object, **extra: Any) -> dict:
    """The validated hyper-parameters every 1-bit optimizer shares, plus group options."""
    return dict(
        lr=check_lr("lr", lr),
        betas=check_betas("betas", betas),
        eps=check_number("eps", eps),
        weight_decay=check_number("weight_decay", weight_decay),
        non_freeze=False,
        exp_avg_mask=None,
        **extra,
    )


NONFINITE_POLICIES = ("skip", "raise", None)
COMPRESSIONS = ("preconditioned", "momentum")
VARIANCE_FLOOR = 0.1  # default: docs/ALGORITHMS.md section 6 and bench/HISTORY.md say why
UPDATE_CLIP = 1.0  # default with compression="preconditioned" (ALGORITHMS.md section 6)
MODE_DEFAULT = "default"  # update_clip: UPDATE_CLIP when preconditioned, None with "momentum"


def closure_loss(closure) -> Any:
    """Evaluate an optimizer closure with gradients enabled (step() runs under no_grad)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class OnebitOptimizerBase(Cohorts, Copying, Agreement, StateIO, VarianceState, Telemetry,
                          torch.optim.Optimizer):
    """Base class: subclasses set FLAT_STATE / DENSE_STATE and implement step().

    ``nonfinite`` decides what a non-finite gradient on ANY rank does (checked at the start
    of every step with a one-element all-reduce and a host sync, before any state
    changes): ``"skip"`` (default) skips the step on every rank with a RuntimeWarning naming
    the ranks (``skipped_steps`` counts them), ``"raise"`` raises FloatingPointError on every
    rank, ``None`` checks nothing (non-finite values then reach the parameters on every rank
    alike; the error buffers stay finite). onebit's GradScaler makes the check unnecessary
    and it is skipped under ``scaler.step``. ``step(check=True)`` first verifies that all
    ranks agree on parameters, stage and counters (:meth:`verify_ranks`).

    ``error_dtype``: the error buffers' dtype. ``torch.bfloat16`` (the default) keeps them in half
    the bytes, stored with stochastic rounding (docs/ALGORITHMS.md 12: zero-mean, no drift; the
    convergence suite within its seed spread of the float32 errors, bench/RESULTS.md);
    ``torch.float32`` keeps them exact. A checkpoint of either loads into either (float32 errors
    are rounded once to nearest when loaded into bfloat16 buffers).

    ``variance_dtype``: how ``exp_avg_sq`` is stored once it is frozen for good (after the freeze;
    ZeroOneAdam: from phase 2), float32 before. ``torch.bfloat16`` (the default with
    ``compression="preconditioned"``) rounds it once to nearest there: half the bytes, and the
    stale denominator within ``2^-9`` of float32's (docs/ALGORITHMS.md 12.1); ``torch.float32``
    keeps it (the default with ``compression="momentum"``: the reference's maths, bitwise).
    ``state_dict()`` holds it as float32 either way; a loaded one is rounded again (exact for one
    saved so).
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
        error_dtype: torch.dtype = torch.bfloat16, variance_dtype: torch.dtype | None = None,
    ) -> None:
        # a 2-D DeviceMesh: hierarchical compressed all-reduces; everything else (full-precision
        # averaging, agreement checks) on the group of all its ranks
        self._mesh = group if is_mesh(group) else None
        self.hierarchy = None if self._mesh is None else hierarchy(self._mesh)
        group = flat_group(group)
        self.world_size = group_size(group)  # validates group before anything is built
        self.block = check_block(block)
        self.error_dtype = check_error_dtype(error_dtype)
        self.bucket_cap_mb = check_number("bucket_cap_mb", bucket_cap_mb)
        self.nonfinite = check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        self.auto_mask = check_fraction("auto_mask", auto_mask, optional=True)
        self.compression = check_choice("compression", compression, COMPRESSIONS)
        self.variance_floor = check_fraction("variance_floor", variance_floor, optional=True)
        if isinstance(update_clip, str) and update_clip == MODE_DEFAULT:
            update_clip = self.UPDATE_CLIP if compression == "preconditioned" else None
        self.update_clip = check_number("update_clip", update_clip, low_open=True, optional=True)
        self.variance_dtype = check_variance_dtype(variance_dtype, self.compression)
        self._floors: list[torch.Tensor | None] | None = None  # per compressed param; from v
        self._floor_values: list[float] | None = None  # the floors on the host (the C passes')
        self._floor_columns: dict = {}  # the fused tables' floor columns, on the device (floor_column)
        self._masks: list[torch.Tensor | None] | None = None  # per compressed param; from v
        self.masked_coordinates = 0
        self._mask_warned = False
        self._default_warned = False  # said once that this run has not compressed (stats() or exit)
        self._ddp_checked = False  # the first step looked for a DDP model and compared replicas
        self._foreign_state = False  # a loaded state came from another rank: said at the next step
        self._cohorts: list[OnebitOptimizerBase] = []  # groups added after the first update (_cohorts.py)
        self._cohort = 0  # this optimizer's cohort: 0 for the one the user built
        self._ddp_averaged_params: set[int] = set()  # marked by the DDP hook for this step's cohorts
        # the non-finite agreement on the device (optimizers/_device_agreement.py): None = on a GPU where
        # it applies; the last such step's agreement until the host reads whether it skipped
        self._device_agreement: bool | None = None
        self._pending_agreements: list = []
        self._on_device = None
        self._counts = None  # a capturable step's counters on the device (optimizers/_capture.py)
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
        self.register_state_dict_pre_hook(OnebitOptimizerBase._cohorts_pre_state_dict)
        # at interpreter exit, group rank 0 says whether this optimizer never compressed
        self._group_rank = self._rank()
        _LIVE.add(self)

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
        # DTensor parameters: the maths runs on the local slices; a tensor lr read as a float (a
        # capturable step reads it on the device)
        lrs = contextlib.nullcontext() if self._device_lrs() else float_lrs(self.param_groups)
        with local_params(self), lrs:
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

    def _wants_counts(self) -> bool:
        """Whether the next step is a capturable one (optimizers/_capture.py): OnebitAdam's, with
        ``capturable=True``, in its compression stage."""
        return False

    def _device_lrs(self) -> bool:
        """Whether the next step reads a tensor ``lr`` on the device (a capturable step in Triton)."""
        return False

    def _check_capture(self) -> None:
        """Called where a CUDA graph is being captured: raises unless this step can be (module _capture)."""
        raise RuntimeError(f"{type(self).__name__}.step: a CUDA graph is being captured; this optimizer's "
                           "step synchronises with the host (OnebitAdam(capturable=True) is capturable "
                           "in its compression stage)")

    def _step(self, check: bool) -> None:
        if self._counts is None and self._wants_counts():  # the host's counters exact, then on the device
            self._resolve_device_agreement()
            self._counts = Counts(self, self.reducer().device)
        # the earlier steps' flags that have arrived (all of them where the update count enters this step)
        self._resolve_device_agreement(wait=self._counts_enter_update() and self._counts is None)
        if capturing():
            self._check_capture()
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
            agreement = self._agreement_on_device()
            if agreement is None and self.nonfinite is not None and capturing():
                raise RuntimeError(f"{type(self).__name__}.step: a CUDA graph is being captured, but this "
                                   "step agrees on non-finite gradients on the host (the first compression "
                                   "step, or settings the agreement on the device does not take: "
                                   "docs/failures.md); capture a later step, or use nonfinite=None")
            if agreement is not None:  # no host synchronisation: a skip is learnt at the next step
                self._on_device = agreement
                try:
                    self._take_step()
                finally:
                    self._on_device = None
                if self._counts is not None:  # a capturable step: counted on the device
                    self._counts.advance(agreement)
                    return
                agreement.finish()
                self._pending_agreements.append(agreement)
                return
            try:
                prepare = self.nonfinite is not None and not self._grads_verified
                verdict = self._prepare_step() if prepare else None
                if verdict is not None and self._cohorts:  # the cohorts' gradients are checked here too
                    verdict = verdict and self._grads_finite(self._cohort_grads())
                usable = self._gradients_usable(verdict)
            except BaseException:
                self._abandon_step()
                raise
            if usable:
                averaged = self._sharding is not None and self.wants_averaged_gradients()
                self._take_step()
                if self._counts is not None:
                    self._counts.advance(None)
                if averaged:
                    self._count_fsdp_all_reduce()
                self._step_cohorts()
            else:
                self._ddp_averaged_params = set()
                self._abandon_step()
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

    def _agreement_on_device(self):
        """This step's :class:`~onebit.optimizers._device_agreement.DeviceAgreement`, where the step can
        agree on the device (None: the host agreement). The optimizers that can say so override it."""
        return None

    def _may_agree_on_device(self, device: torch.device) -> bool:
        """The settings under which a step may agree on the device (module _device_agreement)."""
        wanted = self._device_agreement if self._device_agreement is not None else device.type == "cuda"
        return (wanted and self.nonfinite == "skip" and not self._grads_verified and not self._foreign_state
                and self._overlap is None and not self._cohorts and self._sharding is None
                and not any(g.get("non_freeze", False) for g in self.param_groups))

    def _new_agreement(self, pairs, reducer, *, snapshot: bool = False, summed: bool = False):
        """A step's agreement on the device over ``pairs``' gradients (optimizers/_device_agreement.py).
        ``snapshot``: the host's counters (``COUNTERS``) kept, put back if the step is skipped; ``summed``:
        the poison summed over the ranks on the device, for a step with no compressed collective of its own
        to carry it (one 4-byte all-reduce, counted)."""
        import copy

        from ._device_agreement import DeviceAgreement

        agreement = DeviceAgreement([p.grad for p, _ in pairs if p.grad is not None], reducer.device)
        if snapshot:
            agreement.snapshot = {name: copy.deepcopy(getattr(self, name)) for name in self.COUNTERS}
        if summed:
            agreement.all_reduce(reducer.group)
            if reducer.world_size > 1:
                self.count_sent(1, 4, control=True)
        return agreement

    def _undo_skipped(self, agreement) -> None:
        """What a step skipped on the device changed on the host, undone: the update count (the step's own
        counters, where it kept a ``snapshot`` of them: those)."""
        if agreement.snapshot is None:
            self.updates -= 1
            return
        for name, value in agreement.snapshot.items():
            setattr(self, name, value)

    def _counts_enter_update(self) -> bool:
        """Whether the next update's arithmetic reads the update count (a bias correction): then a skip
        agreed on the device must be counted first."""
        return any(g.get("bias_correction", False) for g in self.param_groups)

    def _resolve_device_agreement(self, wait: bool = True) -> None:
        """Learn whether the steps that agreed on the device were skipped: a skipped one did not count
        (``updates`` back by one), ``skipped_steps`` counts it and group rank 0 says so. ``wait=False``:
        only the flags that have arrived (the others stay pending: no wait for the device; a rank may then
        count a skip a step after another, where the count enters no arithmetic). The flags are the
        gathered messages', alike on every rank."""
        counts = getattr(self, "_counts", None)
        if wait and counts is not None:  # a capturable step's counters (one read)
            counts.settle(self)
        pending = getattr(self, "_pending_agreements", [])
        while pending and (wait or pending[0].arrived()):
            agreement = pending.pop(0)
            if agreement.skipped_step():
                self._undo_skipped(agreement)
                self.skipped_steps += 1
                warn_collective(f"onebit: step skipped on every rank: a non-finite gradient at the "
                                f"{self.stage} step after {self.updates} updates (agreed on the device: the "
                                "ranks are not named, and this is said at a later step)", RuntimeWarning,
                                self.control_group)

    def _prepare_step(self) -> bool | None:
        """The step's first phase before the ranks agree on the gradients, where an optimizer can
        undo it (``_abandon_step``): returns this rank's verdict on its gradients' finiteness, read
        from that phase's own pass; None: not prepared (the agreement reads the gradients)."""
        return None

    def _abandon_step(self) -> None:
        """Undo ``_prepare_step`` (the ranks skip the step, or one raised)."""

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

    def _communicate_average(self) -> bool:
        """Average in step() unless a DDP hook already did it for this step."""
        return not self.external_averaging

    def averaged_gradients(self, reducer: BucketedReducer, pairs: list[tuple[torch.Tensor, dict]]):
        """Yield ``(k, p, group, grad)`` for every compressed parameter, ``grad`` being its
        gradient averaged over the group in full precision (a view of the reducer's scratch
        buffer, valid until the next bucket is averaged). Bucket by bucket: the caller's
        update of one bucket runs before the next bucket is averaged. A missing ``.grad``
        counts as zero."""
        for items in self.averaged_gradient_buckets(reducer, pairs):
            yield from items

    def averaged_gradient_buckets(self, reducer: BucketedReducer, pairs: list[tuple[torch.Tensor, dict]]):
        """As :meth:`averaged_gradients`, one list of ``(k, p, group, grad)`` per bucket."""
        for bucket in reducer.buckets:
            grads = [pairs[i][0].grad for i in bucket.indices]
            avg = reducer.average(bucket, grads, self._communicate_average())
            yield [(i, *pairs[i], avg[off : off + size].view_as(pairs[i][0]))
                   for i, off, size in zip(bucket.indices, bucket.offsets, bucket.numels, strict=True)]

    # -- parameters and buffers -------------------------------------------------------
    def compressed_params(self) -> list[tuple[torch.Tensor, dict]]:
        """(param, group) of every parameter whose state is compressed, in a fixed order."""
        return [(p, g) for g in self._own_groups() if not g.get("non_freeze", False) for p in g["params"]]

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
            traffic=self.traffic, error_dtype=self.error_dtype,
        )
        self._reducer_params = [id(p) for p in params]  # the parameters the buckets were laid out for
        self._reducer.on_release = self._flat_state_released
        self._reducer.on_materialise = self._bind_state
        self._bind_state()

    def _cohorts_pre_state_dict(self) -> None:  # (and the last step's agreement, first)
        """The cohorts' own state-dict pre-hooks (ZeroOneAdam's wake from rest), before the root's
        ``state_dict()`` reads their state."""
        self._resolve_device_agreement()
        for cohort in self._cohorts:
            for hook in cohort._optimizer_state_dict_pre_hooks.values():
                hook(cohort)

    def _may_keep(self, reducer, pairs, masks) -> bool:
        """Whether an unfused compressed step may keep its buckets as the calls' messages
        (after it the flat state, a momentum, is the call's decoded message: kept as that message
        between steps, BucketedReducer.keep_as_message, issue 56; the ``message`` route on; the reducer
        can return them; no mask writes the decoded buffers; not with ``overlap``, whose backward hooks
        write into the buckets' buffers)."""
        return (backends.route("message") and self._overlap is None and reducer.can_keep()
                and all(d is None for d in masks)
                and all(g.get("exp_avg_mask") is None for _, g in pairs))

    @staticmethod
    def _keep(reducer, kept: list | None) -> None:
        """Keep each bucket as its message from ``compressed_mean_(keep=True)`` (None: nothing)."""
        for b, message in zip(reducer.buckets, kept or [None] * len(reducer.buckets), strict=True):
            if message is not None:
                reducer.keep_as_message(b, *message)

    def _flat_state_released(self, bucket) -> None:
        """The reducer keeps ``bucket`` as its last message (``BucketedReducer.keep_as_message``): its
        parameters' flat state leaves ``self.state`` (``state_dict()`` decodes it into the checkpoint;
        reading the reducer's views decodes it back, ``_bind_state``)."""
        (flat_name,) = self.FLAT_STATE
        pairs = self.compressed_params()
        for i in bucket.indices:
            self.state[pairs[i][0]].pop(flat_name, None)

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
            for name in self._missing_dense():  # (not setdefault: its zeros would be made every call)
                if name not in state:
                    state[name] = torch.zeros_like(p, dtype=torch.float32)
            for name, value in self.SCALAR_STATE.items():
                if name not in state:
                    state[name] = torch.tensor(value, dtype=torch.float64, device=view.device)

    def _missing_dense(self) -> tuple[str, ...]:
        """The dense state that ``_bind_views`` makes (zero) where a parameter lacks it."""
        return self.DENSE_STATE

    def dense_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        for name in self.DENSE_STATE + self.FLAT_STATE:
            if name not in state:
                state[name] = torch.zeros_like(p, dtype=torch.float32)
        return state

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

    def _frozen_for_good(self) -> bool:
        return self.compressing

    def _counts_enter_update(self) -> bool:
        # the warm-up: the update count decides when it ends (a skip agreed on the device counted first),
        # and the compression's bias corrections, where it has them
        return not self.compressing or super()._counts_enter_update()

    def _enter_compression(self) -> None:
        """Called once, right after the last warm-up update. Preconditioned: the momentum
        buffers change domain, ``m -> m / denom`` (denom frozen from here on), so that the
        compressed quantity and its error feedback live in update space (ALGORITHMS.md 6).
        The warm-up's averaging buffer is freed (no full-precision step follows); the variance is
        stored in ``variance_dtype`` from here on (rounded once, before anything reads it)."""
        self.reducer().release_scratch()
        self._narrow_variance()
        self._variance_changed()
        if not self.preconditioned:
            return
        views = self.reducer().views
        for k, (p, g) in enumerate(self.compressed_params()):
            views[k].div_(self.stale_denominator(k, p, g))
