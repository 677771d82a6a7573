"""A DDP communication hook that averages gradients with 1-bit compression, for any optimizer.

    from onebit.collectives import OnebitCompressHookState, onebit_compress_hook
    state = OnebitCompressHookState(process_group=None, start_iter=2)
    ddp_model.register_comm_hook(state, onebit_compress_hook)

In the style of torch's PowerSGD hook: the first ``start_iter`` iterations average in full
precision (DDP rebuilds its buckets after the first iteration, so bucket contents settle
only then); afterwards each bucket goes through ``compressed_allreduce`` with its own worker
and server error buffers, keyed by the bucket's index and made on the bucket's first
compressed use. The state pickles (``__getstate__``/``__setstate__``: error buffers, each
bucket's parameters, the iteration counter and the byte counts; the process group is not
saved and must be given again), so ``torch.save(state.__getstate__())`` /
``state.__setstate__(torch.load(...))`` resumes a run bitwise.

Resuming meets one obstacle: a freshly built DDP runs its first iteration with its initial
bucket layout (all parameters in one bucket unless ``find_unused_parameters``) and rebuilds
the buckets only afterwards. So the state names each parameter by where it sat in the first
layout this process saw (bucket index, position: the same on every rank and in every process
built the same way) and remembers which parameters each compressed bucket holds. A bucket
made of several remembered buckets is compressed as those buckets, each with its own error
buffers, exactly as before the checkpoint; a bucket that matches nothing remembered starts
from zero error (counted in ``stats()["resets"]``, with one warning).

Error feedback makes the average of the compressed gradients unbiased over time, not per
step. Block scales (one per ``block = 64`` elements, docs/ALGORITHMS.md section 7) keep sparse
and heavy-tailed gradients (an output head over rare classes, embedding rows that never occur)
from growing the error without bound: with one scale per chunk SGD with momentum at lr 0.1
diverged on the demo's LM. Pass the optimizer as ``optimizer=``: with SGD (momentum > 0) the
hook then compresses each rank's momentum and hands SGD the gradient that rebuilds the
averaged momentum (docs/ALGORITHMS.md section 8.1; without it SGD near its best learning rate
trains far behind plain DDP); with an Adam-type optimizer it compresses in Adam's
preconditioned space (section 8), where the compression noise lands on the update evenly
instead of being divided by a tiny ``sqrt(v)``. Measured costs behind the hook:
bench/RESULTS.md "The DDP hook with SGD" and "with AdamW".
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.
import copy
import itertools
import time

import torch
import torch.distributed as dist

from ..kernels._checks import check_group, check_int, check_number
from ..kernels.layout import check_block
from ..kernels.preconditioning import sqrt_v_floors, stale_denominator
from ..kernels.rounding import check_error_dtype
from . import _bases, _hook_fused, _momentum, _several
from ._clip_sketch import ClipSketch
from ._frozen_adam import (
    FrozenAdam,
    clip_agreed,
    counts_on_device,
    device_bc2,
    device_counts,
    frozen_pre_,
    frozen_terms,
    is_adam_type,
    momentum_terms,
    step_counts,
)
from ._group import warn_collective
from ._unused import LIVE, rank_of
from .allreduce import compressed_allreduce, compressed_allreduce_passes, error_buffer_numel
from .mesh import flat_group, hierarchy, is_mesh
from .telemetry import CallTimer, counting
from .wire import Traffic, compressed_bytes, ring_allreduce_bytes

__all__ = ["OnebitCompressHookState", "onebit_compress_hook"]


HOOK_BLOCK = 64  # the hooks' default block size (docs/ALGORITHMS.md section 7)


class OnebitCompressHookState:
    """State of :func:`onebit_compress_hook`: error buffers per bucket, the iteration, bytes sent.

    Args:
        process_group: the DDP model's process group (None: the default group).
        start_iter: iterations averaged in full precision before compression starts
            (at least 1: DDP's buckets change after the first iteration).
        block: elements per scale of the compressed all-reduce (``compressed_allreduce``'s
            ``block``); default ``HOOK_BLOCK`` (64: 1.5 bits per element; bench/HISTORY.md
            "DDP hook" measures why), ``None`` for one scale per chunk.
        optimizer: the optimizer stepping this model. SGD-type (a group's ``momentum > 0``,
            its state holds ``momentum_buffer``: torch.optim.SGD): each rank compresses its
            own momentum, ``g + c`` with ``c = b / (1 - dampening) * momentum_buffer``
            (negated under ``maximize``), and SGD gets ``average - c``, so its momentum
            after the step is the compressed average of the ranks' momenta
            (docs/ALGORITHMS.md section 8.1). torch.optim.Muon: its gradient compressed by
            default (measured better), its momentum with ``momentum_share=1.0`` (its lerp's
            ``c = momentum / (1 - momentum) * momentum_buffer``, section 8.3). Another
            optimizer with a ``momentum`` is refused (``TypeError``): its
            buffer would be misread. A list of optimizers over disjoint parameters (Muon and
            its AdamW partner): each parameter read in its own optimizer's state (``freeze_step``
            then works with the one Adam-type among them). Adam-type (its state holds ``exp_avg_sq`` and
            ``step``: torch.optim.Adam, AdamW, ...): each bucket is compressed in
            the optimizer's own preconditioned space, ``u = g / d`` with ``d = max(sqrt(v /
            (1 - b2^t)), floor) + eps`` from the state before this step (identical on every
            rank), and the average is multiplied back by ``d`` (docs/ALGORITHMS.md section
            8): the compression noise then lands on Adam's update evenly instead of being
            amplified on every low-variance coordinate. Not saved with the state (pass it
            again); other parameters are compressed as gradients.
        variance_floor: with ``optimizer``, ``floor`` is this times the mean nonzero
            ``sqrt(v / (1 - b2^t))`` of each parameter (as the 1-bit optimizers' floor).
        freeze_step: with an Adam-type ``optimizer`` (torch's Adam, AdamW): 1-bit Adam's
            recipe (docs/ALGORITHMS.md section 8.2). ``freeze_step`` iterations of
            full-precision averaging (in place of ``start_iter``), then the optimizer's variance
            freezes and each rank compresses its own momentum in the frozen preconditioned
            space; the optimizer's step uses the compressed average momentum and the frozen
            denominator (set by step hooks on the optimizer). About 20-25% of the run, as the
            1-bit optimizers' ``freeze_step``. Beside an SGD or a Muon (several optimizers), their
            parameters are compressed from ``start_iter`` all the same (nothing of theirs freezes): a
            bucket holding both sends theirs 1-bit and the Adam-type's in full precision until the
            freeze, then compresses whole, its worker error seeded from their part's. Not with
            ``sync_each_batch`` accumulation (one
            hook call per optimizer step). Clip with ``clip_grad_norm_`` of this state (or
            ``onebit.integrations``): the gradient DDP hands over carries the momentum's 1-bit
            noise, so its own norm is not the gradient's.
        error_dtype: the error buffers' dtype: bfloat16 (the default: half the bytes, stored with
            stochastic rounding, docs/ALGORITHMS.md 12), or float32.
        momentum_share: the share of an SGD's or a Muon's momentum term ``c`` each rank adds before
            compressing (0: its gradient compressed, 1: its momentum): "auto" (the default) is 1 for
            SGD and 0 for Muon, whose gradient compressed measured better than its momentum
            (docs/ALGORITHMS.md 8.3; bench/RESULTS.md "The DDP hook with Muon").
        momentum_bases: a Muon's matrices (where its momentum share is 0) compressed in the singular
            bases of its momentum, ``(U^T G V) / w``, the average handed back as ``U (A w) V^T``, with
            ``w_kl = s_k + s_l`` of the momentum's singular values (the same wire; the compression's
            error then lies where Newton-Schulz's output hardly reads it, in the momentum's large
            directions, instead of flat over the small ones it lifts: docs/ALGORITHMS.md 8.4). The
            bases are made anew every this many iterations (an SVD of each matrix) and kept
            with the state (``a^2 + b^2`` float32 per ``a x b`` matrix). "auto" (the default):
            every ``MOMENTUM_BASES_EVERY`` iterations, and not where the share is not 0; None: as they
            are (section 8.3).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, start_iter: int = 2,
                 block: int | None = HOOK_BLOCK, optimizer: torch.optim.Optimizer | None = None,
                 variance_floor: float = 0.1, freeze_step: int | None = None, *,
                 error_dtype: torch.dtype = torch.bfloat16, momentum_share: float | str = "auto",
                 momentum_bases: int | str | None = "auto") -> None:
        # a 2-D DeviceMesh: each bucket's compressed all-reduce is hierarchical (1-bit between
        # nodes only); the full-precision iterations average over all the mesh's ranks
        self._mesh = process_group if is_mesh(process_group) else None
        process_group = flat_group(process_group)
        self.process_group = process_group
        self.variance_floor = check_number("variance_floor", variance_floor, low=0.0)
        if momentum_share != "auto":
            momentum_share = check_number("momentum_share", momentum_share, low=0.0)
            if momentum_share > 1.0:
                raise ValueError(f"momentum_share: expected 'auto' or a number in [0, 1], got "
                                 f"{momentum_share}")
        self.momentum_share = momentum_share
        self._bases = _momentum_bases(momentum_bases, momentum_share)
        self._frozen_adam = None if freeze_step is None else FrozenAdam(
            check_int("freeze_step", freeze_step, low=1), self.variance_floor)
        self._optimizer = None
        self.optimizer = optimizer  # checked and unwrapped by the setter
        # the default group of a program that has not called init_process_group yet (Lightning
        # builds ddp_comm_state before fit creates the group): resolved at the hook's first call
        deferred = process_group is None and not (dist.is_available() and dist.is_initialized())
        self._world_size = None if deferred else check_group(process_group)
        self._rank = None if deferred else rank_of(process_group)
        self.start_iter = check_int("start_iter", start_iter, low=1)
        self.block = check_block(block)
        self.error_dtype = check_error_dtype(error_dtype)
        self.iter = 0
        self.errors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layouts: dict[int, tuple[tuple[int, int], ...]] = {}  # bucket index -> its parameters' names
        # freeze_step beside an SGD or a Muon: a mixed bucket's early part (theirs, compressed from
        # start_iter while the Adam-type's average in full precision), by bucket index: errors, names
        self.early_errors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.early_layouts: dict[int, tuple[tuple[int, int], ...]] = {}
        # each bucket's names in the last iteration before compression after DDP's rebuild: a run resumed
        # from there compresses (and sends its early parts) as those buckets, in that order
        self.plan: dict[int, tuple[tuple[int, int], ...]] = {}
        self.bytes_full = 0
        self.bytes_control = 0  # the clip's all-reduces (the sketches of section 8.2)
        self._clip = ClipSketch()  # the clip's sketch of each rank's compressed gradients (section 8.2)
        self.bytes_compressed = 0
        self.resets = 0
        self._timing = Traffic()  # seconds in compute and communication (telemetry; not saved)
        self._tables: dict = {}  # the fused passes' tables between iterations (_hook_fused.pre_)
        self._names: dict[int, tuple[int, int]] = {}  # id(parameter) -> (bucket, position), this process
        self._naming = True  # until the end of the first iteration this process sees
        self._warned = False
        self._warned_unused = False
        # the optimizer's step counts used on their device, not read (None: where they live off the CPU;
        # _frozen_adam.counts_on_device; the tests force True on a CPU)
        self._device_counts: bool | None = None
        LIVE.add(self)

    @property
    def world_size(self) -> int:
        """Ranks of the process group; for the default group of a state built before
        ``init_process_group``, resolved (and fixed) at the hook's first call."""
        if self._world_size is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "onebit_compress_hook: called before torch.distributed.init_process_group; the "
                    "state resolves its default group at the hook's first call and found none")
            self._world_size = check_group(self.process_group)
            self._rank = rank_of(self.process_group)
        return self._world_size

    @property
    def optimizer(self) -> torch.optim.Optimizer | _several.Several | None:
        """The optimizer stepping the model (see the class's ``optimizer`` argument), or the several
        given as a list (a ``Several``: ``.members``). May be set after construction (e.g. in
        Lightning's ``configure_optimizers``); a wrapper that holds the real optimizer as ``.optimizer``
        (Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``) is unwrapped."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer) -> None:
        optimizer = _several.combine(optimizer)
        for member in _several.members(optimizer):
            if hasattr(member, "wants_averaged_gradients"):  # a onebit 1-bit optimizer
                raise TypeError(
                    f"optimizer: {type(member).__name__} compresses its own momentum; compressing its "
                    "gradients in a DDP hook as well would do it twice. Use "
                    "onebit.optimizers.register_ddp_hook(model, opt) instead of onebit_compress_hook")
            if not is_adam_type(member):
                _momentum.check(member)  # an unknown momentum is refused, never misread
        fa = self._frozen_adam
        if fa is not None:
            adam = _adam_member(optimizer)
            fa.detach()
            if adam is not None:
                fa.attach(adam, lambda: self._names)
        self._optimizer = optimizer

    @property
    def freeze_step(self) -> int | None:
        """Adam's full-precision iterations before its variance freezes (None: not in that mode)."""
        return None if self._frozen_adam is None else self._frozen_adam.freeze_step

    def prepare_step(self) -> None:
        """With ``freeze_step`` and ``optimizer.step(closure)``: call at the end of the closure,
        after backward and any clip, so that the optimizer's state is set before its update
        (without a closure the optimizer's step pre-hook does it; Lightning's OnebitCallback
        calls this). Does nothing otherwise."""
        fa, adam = self._frozen_adam, _adam_member(self.optimizer, check=False)
        if fa is not None and adam is not None:
            fa.prepare(adam, self._names)

    def _first_compressed(self) -> int:
        return self.start_iter if self._frozen_adam is None else self._frozen_adam.freeze_step

    def _early(self, bucket: dist.GradBucket) -> list[int]:
        """Positions in ``bucket`` of the parameters compressed from ``start_iter`` although
        ``freeze_step`` has not come: those of an SGD or a Muon beside the Adam-type among several
        optimizers (nothing of theirs freezes; the Adam-type's average in full precision until its
        variance freezes). Empty without ``freeze_step`` or several optimizers."""
        opt = self._optimizer
        if self._frozen_adam is None or not isinstance(opt, _several.Several):
            return []
        out = []
        for i, p in enumerate(bucket.parameters()):
            member = opt.owner_of(p)
            if member is not None and not is_adam_type(member):
                out.append(i)
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the optimizer's gradients between backward and step by a norm every rank agrees
        on; returns it. Full-precision iterations: the averaged gradient's norm (the same on
        every rank). Compressed iterations (with ``freeze_step`` or without): an estimate of that
        norm from count sketches of each rank's own compressed gradients (made by the hook once the
        clip has been asked for; one all-reduce of 256-4096 floats, counted in ``bytes_control``), the
        parameters averaged in full precision counted exactly, because the gradient handed over
        carries 1-bit noise (docs/ALGORITHMS.md 8.2; ``_frozen_adam.clip_agreed``)."""
        return clip_agreed(self.optimizer, self._frozen_adam, max_norm, norm_type, self.process_group,
                           self.world_size, "the state has", self._count_control, self._clip)

    def _count_control(self, numel: int, element_size: int) -> None:
        self.bytes_control += ring_allreduce_bytes(numel, self.world_size, element_size)

    def stats(self) -> dict:
        """Iteration, stage, buckets with error buffers, error buffers started afresh because a
        bucket matched no remembered one, the bytes this rank sent, and the seconds this process
        spent (:mod:`onebit.collectives.telemetry`): ``seconds_codec`` (encode, server reduce,
        decode), ``seconds_comm`` (the compressed all-reduces' collectives, launch to
        completion), ``seconds_full`` (the full-precision iterations' all-reduces)."""
        timing = self._timing
        timing.resolve()
        return {"iter": self.iter, "compressing": self.iter >= self._first_compressed(),
                "buckets": len(self.errors),
                "resets": self.resets, "bytes_full": self.bytes_full, "bytes_control": self.bytes_control,
                "bytes_compressed": self.bytes_compressed, "seconds_codec": timing.codec_seconds,
                "seconds_comm": timing.comm_seconds, "seconds_full": timing.full_seconds}

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("process_group", "optimizer") and not k.startswith("_")}
        state["errors"] = {k: (w.clone(), s.clone()) for k, (w, s) in self.errors.items()}
        state["early_errors"] = {k: (w.clone(), s.clone()) for k, (w, s) in self.early_errors.items()}
        if self._frozen_adam is not None:
            state["frozen_adam"] = self._frozen_adam.state()
        state["clip"] = self._clip.state()
        if self._bases is not None:
            state["bases"] = self._bases.state()
        return state

    def __deepcopy__(self, memo: dict):
        """A live copy that goes on bitwise as the original (issue 58): every attribute copied (the
        error buffers, the parameters' names, the counters, the frozen Adam's scalars), the process
        group and mesh shared. Copied in one call with the model and the optimizer
        (``copy.deepcopy((model, opt, state))``), the names follow the copied parameters and the copy
        works with the copied optimizer; copied alone, it keeps the same parameters and optimizer.
        With ``freeze_step`` the copy hooks that optimizer's step as well (a state's hooks act only on
        the iterations its own DDP hook compressed). ``pickle`` saves ``__getstate__`` instead: the
        checkpoint, which resumes on a freshly built DDP (module docstring)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for handle in (self.process_group, self._mesh):
            if handle is not None:
                memo[id(handle)] = handle
        if self._optimizer is not None and id(self._optimizer) not in memo:
            memo[id(self._optimizer)] = self._optimizer  # copied alone: the same optimizer
        fa = self._frozen_adam
        handles = [] if fa is None else fa._handles
        if fa is not None:
            fa._handles = []  # the optimizer's hooks: made again for the copy
        try:
            rest = copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "_names"}, memo)
        finally:
            if fa is not None:
                fa._handles = handles
        new.__dict__.update(rest)
        # the names are keyed by id(parameter): the copied parameters' ids where they were copied
        new._names = {id(memo[i]) if i in memo else i: name for i, name in self._names.items()}
        adam = _adam_member(new._optimizer, check=False)
        if new._frozen_adam is not None and adam is not None:
            new._frozen_adam.attach(adam, lambda: new._names)
        LIVE.add(new)
        return new

    def __setstate__(self, state: dict) -> None:
        alone = "_world_size" not in self.__dict__  # made by unpickling alone (no constructor ran)
        local = {k: v for k, v in self.__dict__.items()
                 if k in ("process_group", "optimizer") or k.startswith("_")}
        frozen, clip, bases = state.get("frozen_adam"), state.get("clip"), state.get("bases")
        skip = ("world_size", "optimizer", "frozen_adam", "clip", "bases")
        state = {k: v for k, v in state.items() if k not in skip}
        self.__dict__.update(state)
        self.__dict__.update(local)
        self.__dict__.setdefault("process_group", None)
        self.__dict__.setdefault("_optimizer", None)
        if "_world_size" not in self.__dict__:  # a state made by unpickling alone
            self._world_size = None
            self._rank = None
            LIVE.add(self)
        self.__dict__.setdefault("variance_floor", 0.1)
        self.__dict__.setdefault("momentum_share", "auto")
        self.__dict__.setdefault("_names", {})
        self.__dict__.setdefault("_naming", True)
        self.__dict__.setdefault("_warned", False)
        self.__dict__.setdefault("_warned_unused", False)
        self.__dict__.setdefault("_device_counts", None)
        self.__dict__.setdefault("_timing", Traffic())
        self.__dict__.setdefault("_tables", {})
        self.__dict__.setdefault("_mesh", None)
        self.__dict__.setdefault("block", None)  # a state saved before block scales existed
        self.__dict__.setdefault("error_dtype", torch.float32)
        self.__dict__.setdefault("bytes_control", 0)  # a state saved before the clip's sketches
        self.__dict__.setdefault("_clip", ClipSketch())
        self._clip.load(clip)
        dtype = self.error_dtype
        self.errors = {int(k): (w.to(dtype), s.to(dtype)) for k, (w, s) in state["errors"].items()}
        self.layouts = {int(k): tuple(tuple(n) for n in v) for k, v in state.get("layouts", {}).items()}
        self.early_errors = {int(k): (w.to(dtype), s.to(dtype))
                             for k, (w, s) in state.get("early_errors", {}).items()}
        self.early_layouts = {int(k): tuple(tuple(n) for n in v)
                              for k, v in state.get("early_layouts", {}).items()}
        self.plan = {int(k): tuple(tuple(n) for n in v) for k, v in state.get("plan", {}).items()}
        self.__dict__.setdefault("_frozen_adam", None)
        self.__dict__.setdefault("_bases", None)
        if bases is not None:
            if self._bases is None and alone:
                self._bases = _bases.MomentumBases(int(bases["every"]))
            if self._bases is None:
                raise ValueError("state: saved with momentum_bases (its errors are in those bases); build "
                                 "the state with momentum_bases set (not None) before loading it")
            self._bases.load(bases)
        if frozen is not None:
            if self._frozen_adam is None:
                raise ValueError("state: saved with freeze_step (Adam's frozen variance); build the state "
                                 f"with freeze_step={frozen['freeze_step']} before loading it")
            self._frozen_adam.load(frozen)

    def _layout(self, bucket: dist.GradBucket) -> tuple[tuple[int, int], ...]:
        """The names of the bucket's parameters, naming them first if this is the first iteration."""
        params = bucket.parameters()
        if self._naming:
            for position, p in enumerate(params):
                self._names.setdefault(id(p), (bucket.index(), position))
        return tuple(self._names.get(id(p), (-1, -1)) for p in params)

    def _cover(self, layout: tuple[tuple[int, int], ...]) -> list[tuple[int, tuple]] | None:
        """``(index, names)`` of remembered buckets that together hold exactly the parameters of
        ``layout``: several, or one that holds them in another order (a fresh DDP's first bucket after
        a resume). Remembered: those compressed before, else the plan (the buckets of the last
        iteration before compression, where this bucket is not one of them as it is)."""
        found = _cover_in(self.layouts, layout)
        if found is not None:
            return [(i, self.layouts[i]) for i in found]
        found = _cover_in(self.plan, layout)
        if found is None or (len(found) == 1 and self.plan[found[0]] == layout):
            return None  # none, or the plan's own bucket as it is: nothing to map
        return [(i, self.plan[i]) for i in found]

    @property
    def compress_group(self):
        """What the compressed all-reduces run on: the mesh, or the process group."""
        return self.process_group if self._mesh is None else self._mesh

    def _servers(self) -> int:
        """Ranks among which a compressed call's chunks are served (the nodes, on a mesh)."""
        return self.world_size if self._mesh is None else hierarchy(self._mesh).nodes

    def _buffers(self, index: int, buffer: torch.Tensor, layout,
                 sizes: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's error buffers, made (zero, or seeded from its early part's: ``sizes``, its
        gradients' sizes in bucket order) where it has none that fit."""
        N = error_buffer_numel(buffer.numel(), self.compress_group, self.block)
        found = self.errors.get(index)
        if found is None or self.layouts.get(index) != layout or found[0].numel() != N:
            if found is not None:
                self.resets += 1
                if not self._warned:
                    self._warned = True
                    warn_collective(f"onebit_compress_hook: bucket {index} matches no bucket the state "
                                    "remembers (the model or DDP's bucketing changed); its error feedback "
                                    "starts from zero (counted in stats()['resets'])",
                                    RuntimeWarning, self.process_group)
            device = buffer.device
            found = (torch.zeros(N, device=device, dtype=self.error_dtype),
                     torch.zeros(N // self._servers(), device=device, dtype=self.error_dtype))
            self._seed_from_early(index, layout, found[0], sizes)
            self.errors[index] = found
            self.layouts[index] = layout
        return found

    def _seed_from_early(self, index: int, layout, worker_error: torch.Tensor,
                         sizes: tuple[int, ...]) -> None:
        """At the freeze, a mixed bucket's whole-bucket worker error starts from its early part's
        (each element's residual carried to its place in the bucket; the early server error, over
        another chunking, is dropped). Nothing where the bucket had no early part."""
        early = self.early_errors.pop(index, None)
        names = self.early_layouts.pop(index, None)
        if early is None or names is None or not set(names) <= set(layout):
            return
        if len(sizes) != len(layout):
            return
        offsets, o = {}, 0
        for name, n in zip(layout, sizes, strict=True):
            offsets[name] = (o, n)
            o += n
        q = 0
        for name in names:
            start, n = offsets[name]
            worker_error[start:start + n].copy_(early[0][q:q + n])
            q += n


MOMENTUM_BASES_EVERY = 10  # momentum_bases="auto": new bases every this many iterations (8.4)


def _momentum_bases(every, share) -> _bases.MomentumBases | None:
    """The state's :class:`MomentumBases` from its ``momentum_bases`` argument (None: off)."""
    if every is None:
        return None
    if every == "auto":
        return _bases.MomentumBases(MOMENTUM_BASES_EVERY)
    every = check_int("momentum_bases", every, low=1)
    if share != "auto" and share != 0.0:
        raise ValueError(f"momentum_bases: a Muon's matrices are turned into its momentum's bases only "
                         f"where its gradient is compressed (momentum_share 'auto' or 0), got "
                         f"momentum_share={share}; pass momentum_bases=None to compress its momentum")
    return _bases.MomentumBases(every)


def _rebuilt(index: int, layout: tuple) -> bool:
    """Whether a bucket is not DDP's first layout as the state named it (``(index, position)`` each):
    the buckets DDP rebuilt after its first iteration, what the plan keeps. A fresh DDP (a resumed run,
    a copied state's new model) runs its first iteration on the first layout again."""
    return any(name != (index, k) for k, name in enumerate(layout))


def _scatter(views: dict, names, flat: torch.Tensor) -> None:
    """Copy ``flat`` back into the gradients ``views[name]``, one after another in ``names``' order."""
    offset = 0
    for name in names:
        view = views[name]
        view.copy_(flat[offset:offset + view.numel()].view_as(view))
        offset += view.numel()


def _cover_in(table: dict, layout: tuple) -> list[int] | None:
    """Keys of ``table`` (bucket index -> names) whose names together are exactly ``layout``'s."""
    wanted = set(layout)
    if (-1, -1) in wanted or len(wanted) != len(layout):
        return None
    parts = sorted(i for i, names in table.items() if set(names) <= wanted)
    if sum(len(table[i]) for i in parts) != len(layout) or not parts:
        return None
    return parts if set().union(*(set(table[i]) for i in parts)) == wanted else None


def _adam_member(optimizer, check: bool = True):
    """The Adam-type optimizer ``freeze_step`` works with: ``optimizer`` itself, or the one Adam-type
    member of several (None: none). ``check``: raise where there is none, or more than one."""
    adams = [o for o in _several.members(optimizer) if is_adam_type(o)]
    if check and optimizer is not None and len(adams) != 1:
        names = ", ".join(type(o).__name__ for o in _several.members(optimizer))
        raise ValueError(f"freeze_step: needs an Adam-type optimizer= (groups with betas: Adam, AdamW), one "
                         f"among several, got {names}")
    return adams[0] if len(adams) == 1 else None


def _optimizer_terms(state: OnebitCompressHookState, bucket: dist.GradBucket, read_adam: bool = True):
    """``(d, c)``: the flat preconditioner and momentum term of the bucket's gradients (bucket
    order), each None where no parameter of the bucket has one (docs/ALGORITHMS.md section 8).

    ``d``: Adam's denominator from ``exp_avg_sq`` and ``step`` (1 elsewhere). ``c``:
    ``s * momentum / (1 - dampening) * momentum_buffer`` of an SGD-type optimizer, ``momentum / (1 -
    momentum) * momentum_buffer`` of a Muon (its lerp; collectives/_momentum.py), 0 elsewhere and
    where the buffer does not exist yet, ``s = -1`` under ``maximize``. The hook averages
    ``(g + c) / d`` and hands the optimizer ``d * average - c``. ``read_adam`` False: ``d`` is not read
    (None)."""
    opt = state.optimizer
    if opt is None:
        return None, None
    groups = {id(p): group for group in opt.param_groups for p in group["params"]}
    adam, sgd = [], []  # (position, v, bc2, eps) / (position, buffer, factor)
    grads = bucket.gradients()
    rows = []  # (position, entry, group) of the Adam-type parameters: their step counts read together
    for i, p in enumerate(bucket.parameters()):
        entry, group = opt.state.get(p, {}), groups.get(id(p))
        if group is None:
            continue
        v = entry.get("exp_avg_sq")
        if v is not None and v.shape == grads[i].shape:
            if read_adam:
                rows.append((i, entry, group))
            continue
        terms = momentum_terms(opt, p, group, state.momentum_share)  # (None, buffer, factor)
        if terms is not None and terms[1].shape == grads[i].shape:
            sgd.append((i, *terms[1:]))
    steps = [e.get("step", 0) for _, e, _ in rows]
    if rows and counts_on_device(steps, state._device_counts):  # kept on a GPU: used there, not read
        bc2s = [device_bc2(group["betas"][1], t)
                for (_, _, group), t in zip(rows, device_counts(steps, grads[0].device), strict=True)]
    else:  # read together: one host read
        bc2s = [1.0 - group["betas"][1] ** t if t else 1.0
                for (_, _, group), t in zip(rows, step_counts(steps), strict=True)]
    for (i, entry, group), bc2 in zip(rows, bc2s, strict=True):
        adam.append((i, entry["exp_avg_sq"].detach().float(), bc2, group.get("eps", 1e-8)))
    d = c = None
    if adam:
        parts = [torch.ones(g.numel(), dtype=torch.float32, device=g.device) for g in grads]
        floors = sqrt_v_floors([v for _, v, _, _ in adam], state.variance_floor)
        for (i, v, bc2, eps), floor in zip(adam, floors, strict=True):
            parts[i] = stale_denominator(v, floor, eps, bc2).reshape(-1)
        d = torch.cat(parts)
    if sgd:  # one bucket-sized tensor written in place (no per-parameter temporaries, no cat)
        c = torch.zeros_like(bucket.buffer())
        offsets = [0]
        for g in grads:
            offsets.append(offsets[-1] + g.numel())
        for i, buf, factor in sgd:
            torch.mul(buf, factor, out=c[offsets[i]:offsets[i + 1]].view_as(buf))
    return d, c


def _allreduce_parts(state: OnebitCompressHookState, bucket: dist.GradBucket, layout, parts: list):
    """Compress a bucket that holds several remembered buckets (``(index, names)``) as those buckets:
    gather each one's gradients in its remembered order, compress with its own error buffers (made
    where a planned one has none yet), scatter back."""
    buffer = bucket.buffer()
    views = dict(zip(layout, bucket.gradients(), strict=True))
    pieces, futures = [], []
    for index, names in parts:
        piece = torch.cat([views[name].reshape(-1) for name in names])
        sizes = tuple(views[n].numel() for n in names)
        worker_error, server_error = state._buffers(index, piece, names, sizes)
        state.bytes_compressed += compressed_bytes(worker_error.numel(), state._servers(), state.block)
        with counting(state._timing):
            futures.append(compressed_allreduce(piece, worker_error, server_error, state.compress_group,
                                                async_op=True, block=state.block))
        pieces.append(piece)

    def scatter(done) -> torch.Tensor:
        for (_, names), piece, fut in zip(parts, pieces, done.value(), strict=True):
            fut.wait()  # raises what the collective raised
            _scatter(views, names, piece)
        return buffer

    return torch.futures.collect_all(futures).then(scatter)


def _early_allreduce(state: OnebitCompressHookState, bucket: dist.GradBucket, layout, early: list[int]):
    """Before ``freeze_step``, a bucket holding an SGD's or a Muon's parameters (``early``: their
    positions) beside the Adam-type's: theirs compressed (with their momentum term, as after the
    freeze), the rest averaged in full precision. A bucket of theirs alone is compressed whole under
    its own index (its errors go on after the freeze); a mixed one's early part has its own errors,
    which seed the whole bucket's worker error at the freeze (``_seed_from_early``). A fresh DDP's
    first bucket after a resume is sent as the buckets it covers (``_cover``), as before the resume."""
    buffer, grads, index = bucket.buffer(), bucket.gradients(), bucket.index()
    _, c = _optimizer_terms(state, bucket, read_adam=False)  # momentum terms (Adam's part: full precision)
    units = state._cover(layout)
    if len(early) == len(grads) and units is None:
        if c is not None:
            buffer.add_(c)
        fut = _compressed(state, bucket, buffer, layout, index)
        return fut if c is None else fut.then(lambda done: done.value().sub_(c))
    W = state.world_size
    views = dict(zip(layout, grads, strict=True))
    terms = {} if c is None else dict(zip(layout, c.split([g.numel() for g in grads]), strict=True))
    mine = {layout[i] for i in early}
    units = units or [(index, layout)]
    pieces, futures, rest = [], [], []
    for key, names in units:
        ours = tuple(n for n in names if n in mine)
        rest += [n for n in names if n not in mine]
        if not ours:
            continue
        piece = torch.cat([views[n].reshape(-1) for n in ours])
        add = None if c is None else torch.cat([terms[n].reshape(-1) for n in ours])
        if add is not None:
            piece.add_(add)
        if len(ours) == len(names):  # a remembered bucket of theirs alone: its own errors
            we, se = state._buffers(key, piece, names, tuple(views[n].numel() for n in names))
        else:
            N = error_buffer_numel(piece.numel(), state.compress_group, state.block)
            found = state.early_errors.get(key)
            if found is None or state.early_layouts.get(key) != ours or found[0].numel() != N:
                found = (torch.zeros(N, device=buffer.device, dtype=state.error_dtype),
                         torch.zeros(N // state._servers(), device=buffer.device, dtype=state.error_dtype))
                state.early_errors[key], state.early_layouts[key] = found, ours
            we, se = found
        state.bytes_compressed += compressed_bytes(we.numel(), state._servers(), state.block)
        with counting(state._timing):
            futures.append(compressed_allreduce(piece, we, se, state.compress_group, async_op=True,
                                                block=state.block))
        pieces.append((ours, piece, add))
    if rest:
        full = torch.cat([views[n].reshape(-1) for n in rest]).div_(W)
        state.bytes_full += ring_allreduce_bytes(full.numel(), W, full.element_size())
        group = state.process_group if state.process_group is not None else dist.group.WORLD
        futures.append(dist.all_reduce(full, group=group, async_op=True).get_future())
        pieces.append((tuple(rest), full, None))

    def scatter(done) -> torch.Tensor:
        for fut in done.value():
            fut.wait()  # raises what the collective raised
        for names, flat, add in pieces:
            if add is not None:
                flat.sub_(add)
            _scatter(views, names, flat)
        return buffer

    return torch.futures.collect_all(futures).then(scatter)


def _sketch(state: OnebitCompressHookState, bucket: dist.GradBucket, buffer: torch.Tensor, layout,
            positions) -> None:
    """Once the clip has been asked for: the gradients at ``positions`` of a bucket about to be sent
    compressed, count-sketched for the clip's norm (before any pass writes the bucket)."""
    if not state._clip.clips:
        return
    sizes = [g.numel() for g in bucket.gradients()]
    offsets = list(itertools.accumulate([0, *sizes[:-1]]))
    params = bucket.parameters()
    state._clip.add(buffer, [(layout[i], offsets[i], sizes[i]) for i in positions],
                    [params[i] for i in positions])


def onebit_compress_hook(state: OnebitCompressHookState,
                         bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP bucket over ``state.process_group``: in full precision for the first
    ``state.start_iter`` iterations, then with ``compressed_allreduce`` (asynchronously)."""
    if not isinstance(state, OnebitCompressHookState):
        raise TypeError(
            f"onebit_compress_hook: its state must be an OnebitCompressHookState, got "
            f"{type(state).__name__}; for a onebit 1-bit optimizer use "
            "onebit.optimizers.register_ddp_hook(model, opt) instead")
    buffer = bucket.buffer()
    W = state.world_size
    layout = state._layout(bucket)
    it = state.iter
    compressing = it >= state._first_compressed()
    if not compressing and _rebuilt(bucket.index(), layout):
        state.plan[bucket.index()] = layout
    if bucket.is_last():
        state.iter += 1
        state._naming = False
    if W == 1:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done
    if bucket.index() == 0:  # (DDP reduces its buckets in index order: an iteration's first)
        state._clip.begin()
    early = state._early(bucket) if not compressing and it >= state.start_iter else []
    if early:
        _sketch(state, bucket, buffer, layout, early)
        turned = _turn(state, bucket, buffer, layout, it)
        return _back(_early_allreduce(state, bucket, layout, early), turned)
    if not compressing:
        group = state.process_group if state.process_group is not None else dist.group.WORLD
        buffer.div_(W)
        state.bytes_full += ring_allreduce_bytes(buffer.numel(), W, buffer.element_size())
        timer, start = CallTimer(buffer.device, state._timing), time.perf_counter()
        work = dist.all_reduce(buffer, group=group, async_op=True)

        def done(fut) -> torch.Tensor:
            timer.add("full", time.perf_counter() - start)  # launch to completion
            return fut.value()[0]

        return work.get_future().then(done)
    index = bucket.index()
    _sketch(state, bucket, buffer, layout, range(len(layout)))
    turned = _turn(state, bucket, buffer, layout, it)
    return _back(_compressed_call(state, bucket, buffer, layout, index), turned)


def _turn(state: OnebitCompressHookState, bucket: dist.GradBucket, buffer: torch.Tensor, layout, it: int):
    """A Muon's matrices of the bucket turned into their momentum's bases (section 8.4); what to turn
    back."""
    if state._bases is None or state.optimizer is None:
        return []
    spans, made = state._bases.turn_(state.optimizer, state.momentum_share, bucket, buffer, layout, it)
    found = state.errors.get(bucket.index())
    if made and found is not None and state._mesh is None and state.layouts.get(bucket.index()) == layout \
            and found[0].numel() == error_buffer_numel(buffer.numel(), state.process_group, state.block):
        # the bucket's own errors carried into the new bases (those of the buckets a fresh DDP's bucket
        # covers, and a mesh's, which hold shards of the bucket, are read as they are)
        _bases.carry_(found[0], found[1], made, state._rank, state.world_size)
    if made and state.early_errors and state._mesh is None:
        _carry_early(state, bucket, layout, made)
    return spans


def _carry_early(state: OnebitCompressHookState, bucket: dist.GradBucket, layout, made: list) -> None:
    """Before the freeze, a mixed bucket's early part (a Muon's matrices beside the Adam-type's
    parameters, :func:`_early_allreduce`) holds its own errors, over its matrices laid end to end:
    carried into the new bases as a bucket's own are (``_bases.carry_``), each matrix at its place in
    the part. Without it the part's errors, held in the old bases, were read in the new ones (an SVD's
    directions and their signs change): on the HF page's GPT-2 over 2,000 steps never frozen, 1.306
    against 1.267 with Muon's matrices alone 1-bit; frozen at a quarter, 1.027x plain DDP over 3 seeds
    against 1.018x carried (bench/RESULTS.md "The DDP hook with Muon", session 45)."""
    sizes = [g.numel() for g in bucket.gradients()]
    size_of = dict(zip(layout, sizes, strict=True))
    starts = dict(zip(layout, itertools.accumulate([0, *sizes[:-1]]), strict=True))
    by_start = {entry[0]: entry for entry in made}
    made_of = {}
    for name in layout:
        entry = by_start.get(starts[name])
        if entry is not None and entry[1] - entry[0] == size_of[name]:
            made_of[name] = entry
    for key, names in state._cover(layout) or [(bucket.index(), layout)]:
        ours, found = state.early_layouts.get(key), state.early_errors.get(key)
        if found is None or ours is None or not set(ours) <= set(names):
            continue
        if found[0].numel() != error_buffer_numel(sum(size_of[n] for n in ours), state.compress_group,
                                                  state.block):
            continue
        sub, q = [], 0
        for name in ours:
            entry = made_of.get(name)
            if entry is not None:
                sub.append((q, q + size_of[name], *entry[2:]))
            q += size_of[name]
        if sub:
            _bases.carry_(found[0], found[1], sub, state._rank, state.world_size)


def _back(fut: torch.futures.Future, turned: list) -> torch.futures.Future:
    return fut if not turned else fut.then(lambda done: _bases.turn_back_(done.value(), turned))


def _compressed_call(state: OnebitCompressHookState, bucket: dist.GradBucket, buffer: torch.Tensor, layout,
                     index: int):
    """A compressed iteration's call: with the frozen Adam's passes, the momenta's, or the optimizer's
    terms around it (sections 8-8.3)."""
    fa = state._frozen_adam
    adam = None if fa is None else _adam_member(state.optimizer, check=False)
    if fa is not None and adam is not None:
        if not fa.frozen:  # the first compressed iteration: the optimizer's state is that of step F
            fa.freeze(adam, state._names)
        fa.pending = True
        return _around(state, bucket, buffer, layout, index, fa)
    if state.optimizer is not None and not _reads_variance(state.optimizer, bucket):
        # momenta alone (an SGD's, a Muon's): the same passes, d = 1
        return _around(state, bucket, buffer, layout, index, None)
    d, c = _optimizer_terms(state, bucket)  # the same on every rank
    if c is not None:
        buffer.add_(c)  # SGD: compress this rank's momentum, b * m + g (scaled by 1 / (1 - dampening))
    if d is not None:
        buffer.div_(d)  # Adam: compress u = g / d
    fut = _compressed(state, bucket, buffer, layout, index)
    if d is None and c is None:
        return fut

    def back(done) -> torch.Tensor:
        out = done.value()
        if d is not None:
            out.mul_(d)
        return out if c is None else out.sub_(c)

    return fut.then(back)


def _reads_variance(opt, bucket: dist.GradBucket) -> bool:
    """Whether a parameter of the bucket has Adam's ``exp_avg_sq`` (its ``d`` read each iteration)."""
    return any("exp_avg_sq" in opt.state.get(p, {}) for p in bucket.parameters())


def _around(state: OnebitCompressHookState, bucket: dist.GradBucket, buffer: torch.Tensor, layout, index: int,
            fa):
    """The compressed call of ``(g + c) / d`` with ``out * d - c`` after it (section 8.2; ``fa``: the
    frozen Adam state with ``freeze_step``, the bucket counted into its local norm; None: the momenta's
    terms alone, ``d = 1``), the passes fused where a backend has them: on CPU inside the codec's
    (collectives/_hook_fused.py; not with a mesh or a covered bucket), else around the call."""
    d, parts = frozen_terms(state.optimizer, fa, bucket, layout, state.momentum_share)
    if d is None:
        if fa is not None:
            fa.add_local(buffer)
        return _compressed(state, bucket, buffer, layout, index)
    covered = state.layouts.get(index) != layout and state._cover(layout) is not None
    if state._mesh is None and not covered and _hook_fused.backend(buffer, d, parts) == "native":
        passes = _hook_fused.passes(d, parts, fa, state.block)
        return _compressed(state, bucket, buffer, layout, index, passes)
    post = frozen_pre_(buffer, d, parts, fa, state._tables)  # buffer <- (g + c) / d
    return _compressed(state, bucket, buffer, layout, index).then(lambda done: post(done.value()))


def _compressed(state: OnebitCompressHookState, bucket: dist.GradBucket, buffer: torch.Tensor, layout,
                index: int, passes=None):
    """``passes``: the worker and decompress passes with the hook's maths inside (not with a
    covered bucket or a mesh: the caller checks)."""
    if state.layouts.get(index) != layout:
        parts = state._cover(layout)
        if parts is not None:
            return _allreduce_parts(state, bucket, layout, parts)
    worker_error, server_error = state._buffers(index, buffer, layout,
                                                tuple(g.numel() for g in bucket.gradients()))
    state.bytes_compressed += compressed_bytes(worker_error.numel(), state._servers(), state.block)
    with counting(state._timing):
        if passes is not None:
            return compressed_allreduce_passes(buffer, worker_error, server_error, state.process_group,
                                               passes, block=state.block, async_op=True)
        return compressed_allreduce(buffer, worker_error, server_error, state.compress_group, async_op=True,
                                    block=state.block)
