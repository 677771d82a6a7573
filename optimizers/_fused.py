"""The fused steps' driver: OnebitAdam's compression step, ZeroOneAdam's phase-1 step, its phase-2
synchronisation and local step, each inside the codec's passes in the backend that
:func:`onebit.kernels.backends.select` gives for its step (``adam``, ``zoa``, ``local``). The maths of
each, in every backend, is one file of :mod:`onebit.kernels.fused`; here are when a step applies, its
table (one per bucket) filled from the optimizer's groups, and the call of the collective's stage
sequence (:func:`onebit.collectives.allreduce.compressed_allreduce_passes`).

A fused step applies with the default ``compression="preconditioned"``, no block scales, no mesh,
no ``overlap``, no masks, no ``eps_inside_sqrt``, float32 contiguous parameters, gradients,
variances (and momenta: the passes compute each stale denominator from its variance), more
than one rank (or the benchmarks' local collective), and in Triton buckets of fewer than 2^31
elements (its int32 indices). Elsewhere the optimizer takes its unfused path, with the same results.
"""

from __future__ import annotations

import math

import torch

from ..collectives.allreduce import (
    compressed_allreduce,
    compressed_allreduce_passes,
    compressed_allreduce_stage,
    stage_buffers,
)
from ..collectives.telemetry import counting
from ..kernels import backends
from ..kernels.api import own_bfloat16
from ..kernels.fused import adam, warmup, zero_one
from ..kernels.fused.stage import Stage, StagePasses, keep_launches
from ..kernels.fused.table import Table
from ..kernels.layout import Layout, empty_message, layout_of, message_scales
from ..kernels.rounding import widen
from ._capture import Scalars, constant_group

_NOTHING = torch.empty(0, dtype=torch.float32)  # the C passes' flat where a kept message holds the values


def plain(t: torch.Tensor) -> bool:
    """A float32 contiguous tensor (or parameter), no subclass."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == torch.float32 and t.is_contiguous()


def int32_indexable(reducer) -> bool:
    """Whether every bucket's padded length fits the Triton passes' int32 element indices (a
    parameter of 2^31 elements or more gets a bucket of its own: the unfused path takes it)."""
    return all(b.worker_error.numel() < 2**31 for b in reducer.buckets)


def _backend(step: str, device, reducer) -> str | None:
    """The backend of a fused ``step`` here: ``native`` or ``triton``; None: the unfused path."""
    name = backends.select(device, step).name
    if name == "triton" and not int32_indexable(reducer):
        return None
    return None if name == "plain" else name


def stage_backend(opt) -> bool:
    """Whether ``opt``'s fused compression step would run in Triton (its stage, where it applies)."""
    pairs = opt.compressed_params()
    return bool(pairs) and backends.select(pairs[0][0].device, "adam").name == "triton"


def _settings_ok(opt, reducer, pairs, overlap) -> bool:
    if opt.block is not None or reducer.mesh is not None or overlap:
        return False
    if any(g.get("eps_inside_sqrt", False) for _, g in pairs):  # the passes compute d outside the sqrt
        return False
    if opt.auto_mask is not None or any(g.get("exp_avg_mask") is not None for _, g in pairs):
        return False
    local = bool(getattr(reducer.allreduce, "local_compute", False))
    return local or (reducer.allreduce is compressed_allreduce and reducer.world_size >= 2)


def _tensors_ok(opt, pairs, extra=()) -> bool:
    """Every parameter, gradient, variance and ``extra`` state tensor plain, on one device, of the
    parameter's size."""
    device = pairs[0][0].device

    def ok(t, p) -> bool:
        return t is not None and plain(t) and t.device == device and t.numel() == p.numel()

    def variance_ok(v, p) -> bool:  # float32, or bfloat16 where frozen for good (``variance_dtype``)
        return (v is not None and type(v) is torch.Tensor and v.dtype in (torch.float32, torch.bfloat16)
                and v.is_contiguous() and v.device == device and v.numel() == p.numel())

    for p, _ in pairs:
        if not (plain(p) and p.device == device):
            return False
        if p.grad is not None and (not ok(p.grad, p) or p.grad.shape != p.shape):
            return False
        state = opt.state[p]
        if not variance_ok(state.get(opt.VARIANCE_STATE), p) or not all(ok(state.get(n), p) for n in extra):
            return False
    return True


def applies(opt, reducer, pairs) -> bool:
    """Whether ``opt`` (an OnebitAdam) can take this compression-stage step fused."""
    if not (pairs and opt.compressing and opt.preconditioned):
        return False
    if not _settings_ok(opt, reducer, pairs, opt._overlapped):
        return False
    return _backend("adam", pairs[0][0].device, reducer) is not None and _tensors_ok(opt, pairs)


def zoa_applies(opt, reducer, pairs, phase: int = 1, during: bool = False) -> bool:
    """Whether ``opt`` (a ZeroOneAdam in ``phase``) can take this compressed step (phase 1) or
    synchronisation (phase 2) fused. ``during``: asked inside the step, whose phase the caller knows
    (phase 1's last step has moved the update count to the freeze already)."""
    if not (pairs and opt.preconditioned and (during or opt.phase == phase)):
        return False
    if not _settings_ok(opt, reducer, pairs, opt._overlap is not None):
        return False
    extra = ("exp_avg", "sync_params") if phase == 2 else ("exp_avg",)
    return _backend("zoa", pairs[0][0].device, reducer) is not None and _tensors_ok(opt, pairs, extra)


def prepared_verdict(opt, plan, pairs) -> bool | None:
    """``plan.prepare`` for ``opt``'s next step, and with it this rank's verdict on its gradients
    (those of the groups that are not compressed read as before); None: not prepared."""
    others = [p.grad for g in opt._own_groups() if g.get("non_freeze", False) for p in g["params"]
              if p.grad is not None]
    ok = plan.prepare(opt, pairs, opt.updates + 1)
    if ok is None or not others:
        return ok
    return ok and opt._grads_finite(others)


class AdamStep:
    """OnebitAdam's fused compression step over a reducer's buckets: their tables (built once) and
    the step.

    In the native backend, the step's first phase (``prepare``: every bucket folded and encoded,
    nothing sent) can run before the ranks agree that the gradients are finite, the agreement reading
    its verdict from the messages' scales instead of a pass over the gradients: a non-finite gradient
    makes its chunk's float64 sum of squares non-finite. With the momentum kept as a message
    (``MESSAGE``) the worker pass writes nothing but the new message (and the padded rests' 8 floats
    per chunk, handed to the step): ``abandon`` drops it. Over a float32 momentum buffer it overwrites
    the momentum, which ``abandon`` restores bitwise: after a fused compression step the momentum is
    exactly the decode of that step's gathered message, kept per bucket in ``last``. ``prepare``
    declines (None) where neither holds: before the first fused step, once anything else has written
    a momentum buffer (``flat._version``: a checkpoint's load, an unfused step), and in Triton (it
    would wait for the device)."""

    STEP, FUSED = "adam", adam
    KEEPS_MESSAGE = True  # the momentum kept as each bucket's last message between steps (see step)
    RECORD = False  # each bucket's gathered message in ``messages`` after a step (ZeroOneSync: its rest)

    def __init__(self, reducer) -> None:
        self.reducer = reducer
        device = reducer.device
        self.backend = backends.select(device, self.STEP).name
        self.tables = [self._table(b, device) for b in reducer.buckets]
        self.last: list = [None] * len(reducer.buckets)  # (gathered, layout, flat._version) per bucket
        self.ready: list | None = None  # the prepared messages, until step or abandon
        self.scratch: torch.Tensor | None = None  # a kept bucket's momentum decoded for its step
        self.staged = None  # the stage of every non-empty bucket (Triton): see _stage

    @property
    def MESSAGE(self) -> bool:  # noqa: N802  (read as the constant it was)
        """Whether the momentum is kept as messages: the step's kind, where the ``message`` route is on."""
        return self.KEEPS_MESSAGE and backends.route("message")

    def _table(self, bucket, device) -> Table:
        return self._table_for(list(bucket.offsets), list(bucket.numels), device)

    def _table_for(self, offsets: list[int], numels: list[int], device) -> Table:
        return self.FUSED.table(offsets, numels, device)

    def _fill(self, opt, pairs, t: int, bucket, table: Table) -> None:
        self._fill_items(opt, pairs, t, bucket.indices, table)

    def _fill_items(self, opt, pairs, t: int, indices, table: Table, constant: bool = False) -> None:
        """The table's addresses and scalar rows; ``constant``: the rows' learning-rate and bias-correction
        columns left constant (a capturable step writes them on the device: optimizers/_capture.py)."""
        items = [(i, *pairs[i]) for i in indices]
        table.fill({"grad": [p.grad for _, p, _ in items],
                    "var": [opt.state[p][opt.VARIANCE_STATE] for _, p, _ in items],
                    "param": [p for _, p, _ in items]},
                   [adam.rows(constant_group(g) if constant else g, t, opt.table_denominator(i, g))
                    for i, _, g in items], opt.floor_column(list(indices)))

    def _passes(self, table: Table, clip: float, msg=None, kept=None, n=None, tails=None, agreement=None):
        if self.backend == "native":
            return adam.NativePasses(table, clip, msg, kept=kept, n=n, tails=tails)
        return adam.TritonPasses(table, clip, None if agreement is None else agreement.poison)

    def agrees_on_device(self) -> bool:
        """Whether this step can take the agreement on the device (optimizers/_device_agreement.py):
        Triton passes, every bucket's momentum kept as its message (a skipped step keeps it)."""
        return (self.backend == "triton" and self.MESSAGE
                and all(b.message is not None for b in self.reducer.buckets if b.numel))

    def forget(self) -> None:
        """The momentum was written elsewhere (the unfused step): no message restores it now."""
        self.last = [None] * len(self.reducer.buckets)

    def _restorable(self) -> bool:
        """Whether a prepared step can be dropped: every bucket's momentum kept as its message (the
        worker pass does not write it), or its buffer the decode of its last message."""
        return all((b.message is not None) if b.flat is None else
                   (last is not None and last[2] == b.flat._version)
                   for b, last in zip(self.reducer.buckets, self.last, strict=True) if b.numel)

    def _W(self) -> int:
        local = getattr(self.reducer.allreduce, "local_compute", False)  # True or the emulated W
        return int(local) if local else self.reducer.world_size

    def prepare(self, opt, pairs, t: int) -> bool | None:
        """Fold and encode every bucket for step ``t``; returns whether this rank's gradients are
        all finite, or None (nothing done) where the momentum could not be restored."""
        if self.backend != "native" or not self._restorable():
            return None
        W, ready, finite = self._W(), [], True
        self.ready = ready  # filled bucket by bucket: abandon undoes a prepare that raised halfway
        for b, table in zip(self.reducer.buckets, self.tables, strict=True):
            if not b.numel:
                ready.append(None)
                continue
            self._fill(opt, pairs, t, b, table)
            layout = layout_of(b.worker_error.numel(), W, None)
            msg = empty_message(layout, W, b.worker_error.device)
            passes = self._passes(table, 0.0, kept=b.message if b.flat is None else None, n=b.numel)
            e = b.worker_error if own_bfloat16(passes) else widen(b.worker_error)
            passes.worker(self._momentum(b), e, layout, msg)  # reads the error only
            scale = getattr(passes, "scale", None)  # the message's scale, known to the C passes' caller
            finite = finite and (math.isfinite(scale) if scale is not None
                                 else bool(torch.isfinite(message_scales(msg, layout)).all()))
            ready.append((msg, passes.tails))
        if finite:
            return True
        # a non-finite sum: a non-finite gradient, or finite ones whose fold overflowed (the
        # exact test decides, as the unfused check's does)
        return all(bool(torch.isfinite(p.grad).all()) for p, _ in pairs if p.grad is not None)

    def abandon(self) -> None:
        """The ranks skip the prepared step: every momentum bucket back to what it was."""
        if self.ready is None:
            return
        self.ready = None
        for k, (b, last) in enumerate(zip(self.reducer.buckets, self.last, strict=True)):
            if b.numel and b.flat is not None:  # a kept message: the worker pass did not write it
                gathered, layout, _ = last
                adam.NativePasses.decode(gathered, layout, b.flat)
                self.last[k] = (gathered, layout, b.flat._version)

    def _momentum(self, b) -> torch.Tensor:
        """Bucket ``b``'s momentum as float32 for its step: its buffer, or (a kept message) in the C
        passes nothing (they decode the message as they read it), in Triton's per-bucket passes the
        message decoded into the scratch buffer (as large as the largest bucket, kept; the stage's
        passes decode it as they read it, ``_stage_step``)."""
        if b.message is None:
            return b.flat
        if self.backend == "native":
            return _NOTHING
        largest = max(x.numel for x in self.reducer.buckets)
        if self.scratch is None or self.scratch.numel() < largest:
            self.scratch = torch.empty(largest, dtype=torch.float32, device=self.reducer.device)
        return self.reducer.decoded(b, self.scratch[: b.numel])

    def _stages(self) -> bool:
        """Whether this step runs every bucket's passes in one launch each (kernels/fused/stage.py): the
        Triton passes, each bucket's momentum a float32 buffer or kept as its message, the errors all
        float32 or all bfloat16."""
        if not (backends.route("stage") and self.backend == "triton"):
            return False
        live = [b for b in self.reducer.buckets if b.numel]
        dtypes = {e.dtype for b in live for e in (b.worker_error, b.server_error)}
        held = all((b.message is not None and self.MESSAGE) or b.flat is not None for b in live)
        return bool(live) and len(dtypes) == 1 and held

    def _stage(self):
        """(buckets, their layouts, their :class:`Stage`, one table over their tensors), made once."""
        if self.staged is None:
            self.step_buffers = None  # a capturable step's messages (_stage_step)
            live = [b for b in self.reducer.buckets if b.numel]
            layouts = [Layout(b.worker_error.numel(), self._W(), None) for b in live]
            offsets = [o for b in live for o in b.offsets]
            table = self._table_for(offsets, [c for b in live for c in b.numels], self.reducer.device)
            st = Stage(layouts, [b.numel for b in live], [(list(b.offsets), list(b.numels)) for b in live],
                       self.reducer.device)
            self.staged = (live, layouts, st, table)
        return self.staged

    def _stage_step(self, opt, pairs, t: int, clip: float, local, agreement) -> None:
        """Every bucket's step, one launch per pass (stage.StagePasses), around each bucket's collectives."""
        reducer = self.reducer
        live, layouts, st, table = self._stage()
        indices = [i for b in live for i in b.indices]
        counts = getattr(opt, "_counts", None)  # a capturable step (optimizers/_capture.py)
        self._fill_items(opt, pairs, t, indices, table, constant=counts is not None)
        if counts is not None:  # lr and the bias correction from the device, the messages the same buffers
            key = [id(pairs[i][1]) for i in indices]
            if getattr(self, "scalars", (None, None))[0] != key:
                self.scalars = (key, Scalars([pairs[i][1] for i in indices], reducer.device))
            self.scalars[1].write(table.scal, counts.updates + 1)
            if self.step_buffers is None:
                self.step_buffers = stage_buffers(layouts, reducer.device)
        olds = [b.message if b.flat is None else None for b in live]
        buffers = [(b.flat if old is None else None, None if old is None else old[0], b.worker_error,
                    b.server_error) for b, old in zip(live, olds, strict=True)]
        passes = StagePasses(st, buffers, self._stage_launches(st, table, clip, agreement))
        with counting(reducer.traffic):
            gathered = compressed_allreduce_stage(layouts, reducer.group, passes, local=local,
                                                  buffers=None if counts is None else self.step_buffers)
        if self.MESSAGE:  # each gathered message copied into the bucket's kept one (its buffer for good),
            # not on a step skipped on the device (the kept message, the momentum, stays)
            flag = None if agreement is None else agreement.skipped.view(torch.uint8)
            for launch in keep_launches(st, flag):
                launch()
        for b, g, layout, old in zip(live, gathered, layouts, olds, strict=True):
            reducer.count_compressed(b)
            if self.RECORD:
                self.messages[next(k for k, x in enumerate(reducer.buckets) if x is b)] = (g, layout)
            if self.MESSAGE and old is None:  # (the first kept message: the gathered one's buffer; a
                # capturable step's gathered buffers are its own, the same every step)
                reducer.keep_as_message(b, g if counts is None else g.clone(), layout)

    def _stage_launches(self, st, table: Table, clip: float, agreement):
        poison = None if agreement is None else agreement.poison
        return lambda ebf16: adam.stage_launches(st, table, clip, ebf16, poison)

    def step(self, opt, pairs, t: int) -> None:
        """Every bucket's step (the worker pass already done where ``prepare`` ran). With ``MESSAGE``
        each bucket's momentum is then kept as the step's gathered message: after a compressed
        step the momentum is exactly that message's decode (sign times its chunk's scale), so the
        next step's passes decode it as they read it (C; Triton: into the scratch buffer), bitwise the
        run that keeps the float32 buffer (the buffer's 4 bytes per parameter become 1/8 + the
        scales)."""
        reducer, ready = self.reducer, self.ready
        self.ready = None
        # each bucket's gathered message, (gathered, layout) (None: an empty bucket), where RECORD
        self.messages: list = [None] * len(reducer.buckets)
        clip = math.inf if opt.update_clip is None else float(opt.update_clip)
        local = getattr(reducer.allreduce, "local_compute", False)  # True or the emulated W (benchmarks)
        agreement = getattr(opt, "_on_device", None)  # the step's agreement on the device, or None
        if ready is None and self._stages():
            self._stage_step(opt, pairs, t, clip, local, agreement)
            return
        for k, (b, table) in enumerate(zip(reducer.buckets, self.tables, strict=True)):
            if not b.numel:
                continue
            if ready is None:
                self._fill(opt, pairs, t, b, table)
            native_kept = self.backend == "native" and b.message is not None
            msg, tails = (None, None) if ready is None else ready[k]
            passes = self._passes(table, clip, msg, kept=b.message if native_kept else None, n=b.numel,
                                  tails=tails, agreement=agreement)
            old = b.message
            u = self._momentum(b)
            with counting(reducer.traffic):  # the call's seconds (telemetry), as compressed_mean_ counts them
                compressed_allreduce_passes(u, b.worker_error, b.server_error, reducer.group,
                                            passes, local=local)
            reducer.count_compressed(b)
            if self.RECORD:
                self.messages[k] = (passes.gathered, passes.layout)
            if agreement is not None and self.MESSAGE:  # a skipped step keeps the old message (the momentum)
                kept = agreement.keep(passes.gathered, passes.layout, old[0])
                reducer.keep_as_message(b, kept, passes.layout)
            elif self.MESSAGE:
                reducer.keep_as_message(b, passes.gathered, passes.layout)
            elif self.backend == "native":
                self.last[k] = (passes.gathered, passes.layout, b.flat._version)


class ZeroOneStep(AdamStep):
    """ZeroOneAdam's phase-1 fused compressed step (``prepare``, ``abandon``, ``step`` as
    :class:`AdamStep`'s: the worker pass writes no state, so nothing to restore but the
    accumulator's padded rests, which the C passes use)."""

    STEP, FUSED, SYNC = "zoa", zero_one, False
    KEEPS_MESSAGE = False  # the accumulator is not a momentum: it stays a float32 buffer

    def _table_for(self, offsets: list[int], numels: list[int], device) -> Table:
        return zero_one.table(offsets, numels, device, sync=self.SYNC)

    def _fill_items(self, opt, pairs, t: int, indices, table: Table, constant: bool = False) -> None:
        items = [(i, *pairs[i]) for i in indices]
        table.fill({"grad": [p.grad for _, p, _ in items],
                    "var": [opt.state[p][opt.VARIANCE_STATE] for _, p, _ in items],
                    "param": [p for _, p, _ in items],
                    "momentum": [opt.state[p]["exp_avg"] for _, p, _ in items]},
                   [zero_one.rows(g, opt.table_denominator(i, g)) for i, _, g in items],
                   opt.floor_column(list(indices)))

    def _passes(self, table: Table, clip: float, msg=None, kept=None, n=None, tails=None, agreement=None):
        if self.backend == "native":  # (agreement: on the device, Triton only)
            kind = zero_one.NativeSyncPasses if self.SYNC else zero_one.NativePasses
            return kind(table, clip, msg)
        poison, flag = (None, None) if agreement is None else (agreement.poison, agreement.flag())
        return zero_one.TritonPasses(table, clip, self.SYNC, poison, flag)

    def agrees_on_device(self) -> bool:
        """Phase 1's step and phase 2's synchronisation can take the agreement on the device in Triton:
        their worker pass writes no state, their decompress pass updates nothing where a gathered scale is
        not finite (the gate) and says so in the agreement's flag."""
        return self.backend == "triton"

    def _restorable(self) -> bool:
        return True  # the worker pass writes no state

    def _stage_launches(self, st, table: Table, clip: float, agreement):
        poison, flag = (None, None) if agreement is None else (agreement.poison, agreement.flag())
        return lambda ebf16: zero_one.stage_launches(st, table, clip, ebf16, self.SYNC, poison=poison,
                                                     flag=flag)

    def prepare(self, opt, pairs, t: int) -> bool | None:
        self.reducer.materialise()  # a released accumulator (phase 2 frees it between steps) made again
        return super().prepare(opt, pairs, t)

    def step(self, opt, pairs, t: int) -> None:
        self.reducer.materialise()
        super().step(opt, pairs, t)

    def abandon(self) -> None:
        if self.ready is None:
            return
        self.ready = None
        for b in self.reducer.buckets:
            b.flat.zero_()  # the padded rests' x (the accumulator is zero in phase 1)


class ZeroOneSync(ZeroOneStep):
    """Phase 2's synchronisation (ZeroOneAdam._sync, preconditioned) in the same two passes: the
    worker encodes ``x = p - sync_params``; the decompress pass updates the error from ``x + e``, sets
    ``m = mean d / nl`` (``nl = -lrs``), ``sync_params += mean`` and ``p = sync_params`` (the unfused
    step's operations: bitwise)."""

    SYNC = True
    RECORD = True  # ZeroOneAdam keeps the sync's messages at rest (ZeroOneAdam._rest)

    def _fill_items(self, opt, pairs, t: int, indices, table: Table, constant: bool = False) -> None:
        index = {id(g): i for i, g in enumerate(opt._own_groups())}
        items = [(i, *pairs[i]) for i in indices]
        table.fill({"sync_params": [opt.state[p]["sync_params"] for _, p, _ in items],
                    "var": [opt.state[p][opt.VARIANCE_STATE] for _, p, _ in items],
                    "param": [p for _, p, _ in items],
                    "momentum": [opt.state[p]["exp_avg"] for _, p, _ in items]},
                   [zero_one.sync_rows(-opt.lrs[index[id(g)]], opt.table_denominator(i, g))
                    for i, _, g in items], opt.floor_column(list(indices)))


def wake(opt, reducer, pairs, kept: dict) -> bool:
    """ZeroOneAdam's wake (``ZeroOneAdam._wake``) in one launch over every bucket where its last
    synchronisation ran in the Triton stage (kernels/fused/zero_one.py ``_stage_zoa_wake_kernel``):
    the momentum and ``sync_params`` made new, then written from the kept messages, bitwise the
    per-tensor ops. False: nothing done (the caller's per-tensor path)."""
    plan = getattr(opt, "_zos_cache", None)
    if (plan is None or plan.reducer is not reducer or plan.backend != "triton" or not backends.route("stage")
            or not opt.preconditioned or not pairs or not _tensors_ok(opt, pairs)
            or any(g.get("eps_inside_sqrt", False) for _, g in pairs)):
        return False
    live, layouts, st, table = plan._stage()
    messages = [m for b, m in zip(reducer.buckets, kept["messages"], strict=True) if b.numel]
    if any(m is None or m[1] != layout for m, layout in zip(messages, layouts, strict=True)):
        return False
    index = {id(g): i for i, g in enumerate(opt._own_groups())}
    for p, _ in pairs:
        state = opt.state[p]
        state["exp_avg"] = torch.empty_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        state["sync_params"] = torch.empty_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
    items = [(i, *pairs[i]) for b in live for i in b.indices]
    table.fill({"sync_params": [opt.state[p]["sync_params"] for _, p, _ in items],
                "var": [opt.state[p][opt.VARIANCE_STATE] for _, p, _ in items],
                "param": [p for _, p, _ in items],
                "momentum": [opt.state[p]["exp_avg"] for _, p, _ in items]},
               [zero_one.sync_rows(kept["nl"][index[id(g)]], opt.table_denominator(i, g))
                for i, _, g in items], opt.floor_column([i for i, _, _ in items]))
    st.fill([(0, 0, 0, 0, m[0].data_ptr(), 0, 0, 0) for m in messages])
    for launch in zero_one.wake_launches(st, table):
        launch()
    return True


def local_applies(opt, pairs, masks) -> bool:
    """Whether ``opt``'s phase-2 local step can run as one launch (the ``local`` step's backend is
    ``triton``): the default maths, no dead-coordinate masks, no ``eps_inside_sqrt``, float32 contiguous
    parameters, momenta, gradients and variances on one device, fewer than 2^31 elements in all."""
    if not pairs or opt._reference_maths() or any(d is not None for d in masks):
        return False
    if any(g.get("eps_inside_sqrt", False) for _, g in pairs):
        return False
    if backends.select(pairs[0][0].device, "local").name != "triton":
        return False
    return _tensors_ok(opt, pairs, ("exp_avg",)) and sum(p.numel() for p, _ in pairs) < 2**31


def end_to_end(sizes: list[int]) -> list[int]:
    """The offsets of tensors of ``sizes`` elements laid end to end."""
    offsets = [0]
    for s in sizes[:-1]:
        offsets.append(offsets[-1] + s)
    return offsets


class LocalStep:
    """Phase 2's local step as one launch over every parameter (laid end to end). Its table is
    rebuilt where the tensors' sizes change; its addresses and scalars where they do."""

    def __init__(self) -> None:
        self.table: Table | None = None
        self._sizes: list[int] | None = None

    def step(self, opt, pairs, stale: bool = False) -> None:
        """The local step of every parameter; ``stale``: the stale step alone (phase 1's variance step:
        no gradient folded, the momentum as it is)."""
        params = [p for p, _ in pairs]
        sizes = [p.numel() for p in params]
        if sizes != self._sizes:
            self.table, self._sizes = zero_one.table(end_to_end(sizes), sizes, params[0].device), sizes
        rows = zero_one.stale_rows if stale else zero_one.rows
        self.table.fill({"grad": [None] * len(params) if stale else [p.grad for p in params],
                         "var": [opt.state[p][opt.VARIANCE_STATE] for p in params],
                         "param": params, "momentum": [opt.state[p]["exp_avg"] for p in params]},
                        [rows(g, opt.table_denominator(k, g)) for k, (_, g) in enumerate(pairs)],
                        opt.floor_column(list(range(len(pairs)))))
        clip = math.inf if opt.update_clip is None else float(opt.update_clip)
        agreement = getattr(opt, "_on_device", None)  # the step's agreement on the device (its gate)
        zero_one.local_step(self.table, sum(sizes), clip, None if agreement is None else agreement.poison)


def variance_applies(opt, reducer, pairs) -> bool:
    """Whether ``opt``'s (a ZeroOneAdam's) phase-1 variance step runs in Triton (the ``variance`` step's
    backend is ``triton``): the default maths, no ``eps_inside_sqrt``, float32 contiguous parameters,
    gradients, momenta, variances and accumulators on the reducer's device, every bucket of fewer than
    2^31 elements, fewer than 2^31 elements in all."""
    if not pairs or opt._reference_maths() or any(g.get("eps_inside_sqrt", False) for _, g in pairs):
        return False
    if backends.select(reducer.device, "variance").name != "triton" or not int32_indexable(reducer):
        return False
    if pairs[0][0].device != reducer.device or sum(p.numel() for p, _ in pairs) >= 2**31:
        return False
    if any(b.flat is not None and not plain(b.flat) for b in reducer.buckets):  # (None: released, zero)
        return False
    return _tensors_ok(opt, pairs, ("exp_avg", "exp_avg_sq"))


class VarianceStep:
    """ZeroOneAdam's phase-1 variance step in Triton (:mod:`onebit.kernels.fused.zero_one`): each bucket's
    gradient averaged in full precision into its accumulator (zero in phase 1, nothing else to keep: no
    scratch buffer), then the moments of every parameter in one launch (``moments``: the accumulators
    zeroed as they are read) and, the variance changed, the stale step of every parameter in one launch
    (``stale``: the local step's kernel, no gradient folded): two launches whatever the bucket count. Both
    gated by the step's agreement on the device, where it has one."""

    STEP = "variance"

    def __init__(self, reducer) -> None:
        self.reducer = reducer
        self.backend = backends.select(reducer.device, self.STEP).name
        self.table: Table | None = None
        self._sizes: list[int] | None = None
        self.stale_step = LocalStep()

    def moments(self, opt, pairs) -> None:
        """Every bucket's gradient averaged into its accumulator, then every parameter's moments."""
        reducer = self.reducer
        views = reducer.views  # (the accumulators made again where released)
        for b in reducer.buckets:
            reducer.average(b, [pairs[i][0].grad for i in b.indices], opt._communicate_average(), out=b.flat)
        sizes = [p.numel() for p, _ in pairs]
        if sizes != self._sizes:
            self.table, self._sizes = zero_one.moments_table(end_to_end(sizes), sizes, reducer.device), sizes
        self.table.fill({"grad": list(views), "sq": [opt.state[p]["exp_avg_sq"] for p, _ in pairs],
                         "momentum": [opt.state[p]["exp_avg"] for p, _ in pairs]},
                        [zero_one.moments_rows(g) for _, g in pairs])
        agreement = getattr(opt, "_on_device", None)
        zero_one.moments(self.table, sum(sizes), None if agreement is None else agreement.poison)

    def stale(self, opt, pairs) -> None:
        """The stale step of every parameter, from the changed variance (its floors on the device)."""
        self.stale_step.step(opt, pairs, stale=True)


def warmup_applies(opt, reducer, pairs) -> bool:
    """Whether ``opt`` (an OnebitAdam in its warm-up) can take each bucket's update in one launch (the
    ``warmup`` step's backend is ``triton``): no ``eps_inside_sqrt``, float32 contiguous parameters and
    variances on the reducer's device, every bucket a float32 buffer of fewer than 2^31 elements."""
    if not pairs or opt.compressing or any(g.get("eps_inside_sqrt", False) for _, g in pairs):
        return False
    if backends.select(reducer.device, "warmup").name != "triton" or not int32_indexable(reducer):
        return False
    if any(b.numel and (b.flat is None or not plain(b.flat)) for b in reducer.buckets):
        return False
    return _tensors_ok(opt, pairs)


class WarmupStep:
    """OnebitAdam's warm-up update, one launch per bucket (:mod:`onebit.kernels.fused.warmup`) on its
    averaged gradient; the tables made once per bucket, filled where their tensors or scalars change."""

    STEP = "warmup"

    def __init__(self, reducer) -> None:
        self.reducer = reducer
        self.backend = backends.select(reducer.device, self.STEP).name
        self.tables = [warmup.table(list(b.offsets), list(b.numels), reducer.device) for b in reducer.buckets]

    def update(self, opt, pairs, k: int, avg: torch.Tensor, t: int) -> None:
        """Bucket ``k``'s update at step ``t`` from its averaged gradient ``avg`` (gated by the step's
        agreement on the device, where it has one)."""
        b, table = self.reducer.buckets[k], self.tables[k]
        items = [pairs[i] for i in b.indices]
        table.fill({"sq": [opt.state[p]["exp_avg_sq"] for p, _ in items], "param": [p for p, _ in items]},
                   [warmup.rows(g, t) for _, g in items])
        agreement = getattr(opt, "_on_device", None)
        warmup.update(avg, b.flat[: b.numel], table, None if agreement is None else agreement.poison)


def plan(opt, attr: str, reducer, kind):
    """The fused step ``kind(reducer)`` kept in ``opt``'s attribute ``attr`` while the reducer lives
    and its step's backend stays the one it was built for."""
    cached = getattr(opt, attr, None)
    backend = backends.select(reducer.device, kind.STEP).name
    if cached is None or cached.reducer is not reducer or cached.backend != backend:
        cached = kind(reducer)
        setattr(opt, attr, cached)
    return cached
