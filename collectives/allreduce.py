"""compressed_allreduce: error-compensated 1-bit all-reduce over torch.distributed.

Per call, two collective launches (with block scales on CPU, two per slice: _pipeline): an
all-to-all of the worker messages (sign bits of
chunk j plus the worker scale, to rank j) and an all-gather of the server segments (sign
bits of chunk j plus the server scale). See docs/ALGORITHMS.md section 2 for the maths.

The worker error update is deferred into the final decompress pass and applied only when
every server scale is finite, which is the case exactly when every rank's input was: a
non-finite value on any rank then leaves the error buffers of every rank unchanged and
gives a NaN output on every rank, with no host synchronisation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels import Layout, message_scales
from ..kernels._checks import check_buffer, check_instance, check_int, check_tensor
from ..kernels.layout import check_block, layout_of, pad_unit, padded_numel
from ..kernels.rounding import ERROR_DTYPES, check_error_dtype
from . import _async, _pipeline
from ._failure import guard
from ._group import all_gather_single, group_size, verify_agreement
from ._stages import Stages, flat_target
from .hierarchical import hierarchical_allreduce, shard_numel, validate_hierarchical
from .mesh import hierarchy, is_mesh
from .telemetry import CallTimer
from .wire import compressed_bytes, traffic

__all__ = ["compressed_allreduce", "compressed_allreduce_passes", "error_buffers"]


def validate(tensor, worker_error, server_error, W: int, block: int | None = None) -> int:
    """Check compressed_allreduce's arguments for a group of W ranks; returns N."""
    check_tensor("tensor", tensor)
    if any(st == 0 and sz > 1 for st, sz in zip(tensor.stride(), tensor.shape, strict=True)):
        raise ValueError("tensor: expected a tensor without overlapping elements (stride 0)")
    n = tensor.numel()
    device = tensor.device
    unit = pad_unit(W, block)
    per = "8" if block is None else "block"
    check_buffer(
        "worker_error", worker_error, device, ERROR_DTYPES, at_least=n, multiple_of=unit,
        what=f"float32 or bfloat16 of length N >= numel ({n}) with N % ({per} * world_size) == 0 "
             f"({unit})",
    )
    N = worker_error.numel()
    check_buffer(
        "server_error", server_error, device, ERROR_DTYPES, length=N // W,
        what=f"float32 or bfloat16 of length N / world_size = {N // W}",
    )
    return N


@torch.no_grad()
def compressed_allreduce(
    tensor: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    check: bool = False,
    raise_on_nonfinite: bool = False,
    async_op: bool = False,
    block: int | None = None,
) -> torch.Tensor | torch.futures.Future:
    """Replace ``tensor`` in place by the 1-bit estimate of its mean over ``group``.

    Args:
        tensor: float32, bfloat16 or float16, any shape, ``n`` elements. Afterwards it holds
            the same values (bitwise) on every rank of the group. Returned.
        worker_error: float32 or bfloat16 ``[N]``, ``N >= n`` and ``N % (8 * W) == 0``
            (``padded_numel(n, W)`` is the smallest); this rank's error feedback, in place.
            bfloat16: updated in float32 and stored with stochastic rounding
            (:mod:`onebit.kernels.rounding`, docs/ALGORITHMS.md 12): half the memory.
        server_error: float32 or bfloat16 ``[N / W]``: the error feedback of the chunk this rank
            serves.
        group: process group (default: the world). ``W == 1`` (or no initialised process
            group) is the identity and leaves the errors untouched. A 2-D DeviceMesh (nodes x
            ranks per node, as ``init_device_mesh(device, (nodes, per_node))`` or
            :func:`~onebit.collectives.node_mesh` builds it): full precision inside each node,
            1-bit between nodes on this rank's shard (:mod:`onebit.collectives.hierarchical`;
            error buffers from :func:`error_buffers`); ``async_op`` then completes before
            returning. A 1-D mesh is its process group.
        check: first verify that every rank passes the same ``n``, ``N`` and dtype, so a
            mismatch raises ``ValueError`` on every rank instead of hanging (one small
            extra collective and a host synchronisation).
        raise_on_nonfinite: raise ``FloatingPointError`` (on every rank) when some rank's
            input was not finite. Without it, such a call gives NaN on every rank with the
            error buffers unchanged, and never synchronises with the host.
        async_op: return at once a ``torch.futures.Future`` whose value is ``tensor`` (bitwise
            the synchronous result) instead of ``tensor``; ``fut.wait()`` waits for it. The
            stages are chained without blocking the caller (gloo: from the transport's
            threads, all-gathers on a second process group made on the first such call; CUDA:
            all enqueued on the current stream, no host synchronisation; see
            :mod:`onebit.collectives._async`). Several calls may be in flight, each with its
            own tensor and error buffers (a buffer still in flight raises ``ValueError``);
            every rank must start them in the same order. Not with ``raise_on_nonfinite``.
        block: ``None`` (default): one scale per chunk, the reference's wire format. An int
            (a multiple of 8): one scale per ``block`` elements on both stages, which keeps
            the compression a contraction for heavy-tailed or sparse inputs (docs/ALGORITHMS.md
            section 7); then ``N % (block * W) == 0`` (``padded_numel(n, W, block)``) and each
            rank sends ``4 / block`` more bytes per element. Every rank must pass the same.

    Bad arguments raise ``TypeError``/``ValueError`` naming the argument, before any buffer
    is touched or any data moves.
    """
    if is_mesh(group):  # a 2-D mesh: the hierarchical all-reduce; a 1-D mesh: its group
        h = hierarchy(group)
        if h is not None:
            return _on_mesh(tensor, worker_error, server_error, h, check, raise_on_nonfinite, async_op, block)
        group = group.get_group()
    W = group_size(group)
    block = check_block(block)
    N = validate(tensor, worker_error, server_error, W, block)
    _check_modes(async_op, raise_on_nonfinite)
    if check:
        verify_agreement(tensor, N, group, block)
    if W == 1 or tensor.numel() == 0:
        return _done(tensor) if async_op else tensor
    if async_op and not tensor.is_cuda:
        return _async.start(tensor, flat_target(tensor), worker_error, server_error, group, W, N, block)
    scales = _compressed_allreduce(tensor, worker_error, server_error, group, W, block)
    traffic.compressed += compressed_bytes(N, W, block)
    traffic.compressed_calls += 1
    if raise_on_nonfinite and not bool(torch.isfinite(scales).all()):
        raise FloatingPointError(
            "tensor: a rank's input was not finite; error buffers were left unchanged"
        )
    return _done(tensor) if async_op else tensor  # CUDA: every stage is queued on the stream


def _check_modes(async_op: bool, raise_on_nonfinite: bool) -> None:
    check_instance("async_op", async_op, bool, "a bool")
    if async_op and raise_on_nonfinite:
        raise ValueError("raise_on_nonfinite: expected False with async_op=True (raising needs a host "
                         "synchronisation; test torch.isfinite on the result instead)")


def _on_mesh(tensor, worker_error, server_error, h, check: bool, raise_on_nonfinite: bool, async_op: bool,
             block: int | None):
    """compressed_allreduce on a 2-D mesh (see onebit.collectives.hierarchical). ``async_op``:
    the call completes before returning (a finished future)."""
    check_tensor("tensor", tensor)
    block = check_block(block)
    N = validate_hierarchical(tensor, worker_error, server_error, h, block)
    _check_modes(async_op, raise_on_nonfinite)
    if check:
        verify_agreement(tensor, N, h.flat, block)
    hierarchical_allreduce(tensor, worker_error, server_error, h, block, compressed_allreduce)
    if raise_on_nonfinite and not bool(torch.isfinite(tensor).all()):
        raise FloatingPointError("tensor: a rank's input was not finite; error buffers were left unchanged")
    return _done(tensor) if async_op else tensor


def error_buffer_numel(numel: int, group=None, block: int | None = None) -> int:
    """N, the length of the worker error buffer for ``numel`` elements on ``group`` (a process
    group or a mesh; see :func:`error_buffers`); the server's is N over the ranks serving."""
    if is_mesh(group):
        h = hierarchy(group)
        if h is not None:
            return padded_numel(shard_numel(numel, h.per_node), h.nodes, block)
        group = group.get_group()
    return padded_numel(numel, group_size(group), block)


def error_buffers(numel: int, group=None, *, block: int | None = None,
                  device: torch.device | str | None = None,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(worker_error, server_error)`` for ``compressed_allreduce`` of ``numel`` elements on
    ``group`` (a ProcessGroup, None for the default group, or a 1-D or 2-D DeviceMesh), zeros
    of ``dtype`` (float32 or bfloat16) on ``device`` (default: the CPU). With W ranks:
    ``padded_numel(numel, W, block)`` and that over W; on a 2-D mesh of M nodes x L ranks, for this
    rank's shard: ``padded_numel(ceil(numel / L), M, block)`` and that over M."""
    numel = check_int("numel", numel, low=0)
    block = check_block(block)
    dtype = check_error_dtype(dtype)
    N = error_buffer_numel(numel, group, block)
    if is_mesh(group) and hierarchy(group) is not None:
        servers = hierarchy(group).nodes
    else:
        servers = group_size(group.get_group() if is_mesh(group) else group)
    return (torch.zeros(N, dtype=dtype, device=device), torch.zeros(N // servers, dtype=dtype, device=device))


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    fut = torch.futures.Future(devices=[tensor.device] if tensor.is_cuda else None)
    fut.set_result(tensor)
    return fut


def compressed_allreduce_passes(tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                                group, passes, *, local: bool | int = False, block: int | None = None,
                                async_op: bool = False):
    """``compressed_allreduce(tensor, ...)`` (a flat contiguous float32 ``tensor``) whose worker
    and decompress passes the caller runs with its own maths fused in: ``passes.worker(flat,
    worker_error, layout, msg)`` writes the worker message (``worker_compress(update_error=False)``'s
    contract) and ``passes.finish(gathered, layout, flat, worker_error, msg)`` does at least
    ``decompress``'s (the passes of onebit.kernels.fused's steps). The all-to-all,
    the server and the all-gather are the collective's. ``local``: one rank's whole compute with
    the two collectives as copies (:class:`LocalCopies`): True for a one-rank group, an int W for
    rank 0 of W (the benchmarks; block None, validated arguments, buffers sized for that W).
    ``async_op`` (a CPU tensor, a process group of W > 1; arguments validated here): the future
    of :func:`compressed_allreduce`'s ``async_op``, with ``block``."""
    if async_op:
        W = group_size(group)
        block = check_block(block)
        N = validate(tensor, worker_error, server_error, W, block)
        if W == 1 or tensor.numel() == 0 or tensor.is_cuda:
            raise ValueError("compressed_allreduce_passes: async_op needs a CPU tensor and a group of W > 1")
        return _async.start(tensor, tensor, worker_error, server_error, group, W, N, block, passes)
    W = int(local) if local else group_size(group)
    transport = LocalCopies(W) if local else None
    _compressed_allreduce(tensor, worker_error, server_error, group, W, block, transport, passes)
    traffic.compressed += compressed_bytes(worker_error.numel(), W, block)
    traffic.compressed_calls += 1


def _slices(buf: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    out, a = [], 0
    for size in sizes:
        out.append(buf[a : a + size])
        a += size
    return out


def _message_buffer(sizes: list[int], layouts: list[Layout], device) -> list[torch.Tensor]:
    """One buffer of ``sum(sizes)`` bytes cut into a message per layout; zero where a layout pads its
    segments (the padding is never read; zero, the bytes on the wire are every run's)."""
    buf = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    if any(lay.scale_offset != lay.chunk_bytes for lay in layouts):
        buf.zero_()
    return _slices(buf, sizes)


def stage_buffers(layouts: list[Layout], device) -> tuple[list, list, list, list]:
    """:func:`compressed_allreduce_stage`'s messages for ``layouts`` (each kind one allocation cut per
    layout): the worker's, the received, the served segments, the gathered."""
    sizes = [lay.message_bytes for lay in layouts]
    return (_message_buffer(sizes, layouts, device),
            _slices(torch.empty(sum(sizes), dtype=torch.uint8, device=device), sizes),
            _message_buffer([lay.segment_bytes for lay in layouts], layouts, device),
            _slices(torch.empty(sum(sizes), dtype=torch.uint8, device=device), sizes))


def compressed_allreduce_stage(layouts: list[Layout], group, passes, *, local: bool | int = False,
                               buffers: tuple | None = None) -> list:
    """:func:`compressed_allreduce_passes` for several buffers at once (the buckets of a fused step's
    stage, one W, no block scales, arguments validated by the caller), their compute in launches that
    take every buffer at once: ``passes.worker(msgs, received, segments, gathered)`` (the call's
    messages, one per buffer and kind, allocated first so that the passes' tables are written once)
    writes each one's message, then the all-to-all per buffer, ``passes.serve()``, the all-gather per
    buffer and ``passes.finish()``. Each buffer's messages are its own (slices of one allocation per
    kind), so the bytes on the wire are the per-buffer calls'. Returns the gathered messages.
    ``local``: as for :func:`compressed_allreduce_passes`. ``buffers``: the messages
    (:func:`stage_buffers`), the same every call (a capturable step's); None: allocated per call."""
    W = int(local) if local else group_size(group)
    transport = LocalCopies(W) if local else None
    timer = CallTimer(passes.device)
    with timer.stage("codec"):
        msgs, received, segments, gathered = buffers or stage_buffers(layouts, passes.device)
        passes.worker(msgs, received, segments, gathered)
    with timer.stage("comm", follows=True), guard("compressed_allreduce (all_to_all)", group):
        for recv, msg in zip(received, msgs, strict=True):
            if transport is None:
                dist.all_to_all_single(recv, msg, group=group)
            else:
                transport.all_to_all(recv, msg)
    with timer.stage("codec", follows=True):
        passes.serve()
    with timer.stage("comm", follows=True), guard("compressed_allreduce (all_gather)", group):
        for out, seg in zip(gathered, segments, strict=True):
            if transport is None:
                all_gather_single(out, seg, group)
            else:
                transport.all_gather(out, seg)
    with timer.stage("codec", follows=True):
        passes.finish()
    for lay in layouts:
        traffic.compressed += compressed_bytes(lay.N, W, None)
        traffic.compressed_calls += 1
    return gathered


class LocalCopies:
    """The two collectives as rank 0 of a W-rank group would see them, with every rank's data
    its own, as copies: the all-to-all hands the server its W chunks' messages (this rank's own
    message), the all-gather W copies of its segment. The rank's whole compute with the wire
    excluded: the worker and decompress passes over all n elements, the server over its n / W
    from W messages (W = 1: a one-rank group without the identity shortcut)."""

    def __init__(self, W: int = 1) -> None:
        if W < 1:
            raise ValueError(f"LocalCopies: expected W >= 1, got {W}")
        self.W = W

    def all_to_all(self, recv: torch.Tensor, msg: torch.Tensor) -> None:
        recv.copy_(msg)

    def all_gather(self, out: torch.Tensor, seg: torch.Tensor) -> None:
        out.view(self.W, -1).copy_(seg.view(1, -1).expand(self.W, -1))


def _compressed_allreduce(tensor, worker_error, server_error, group, W: int, block=None,
                          transport=None, passes=None) -> torch.Tensor:
    """The algorithm on validated arguments, W > 1; returns the server scales (a view; a copy
    where the call was sliced, :mod:`onebit.collectives._pipeline`).
    (:func:`onebit.collectives.local.local_compressed_allreduce` is the same compute for
    all ranks in one process.) ``transport``: None (torch.distributed over ``group``) or an
    object with ``all_to_all(recv, msg)`` and ``all_gather(out, seg)`` that complete before
    returning (a process group torch.distributed does not know: onebit.collectives.torchft)."""
    layout = layout_of(worker_error.numel(), W, block)
    if transport is None and passes is None and not tensor.is_cuda \
            and _pipeline.takes(worker_error, server_error, layout):
        K = _pipeline.slices(layout)  # block scales on CPU: in slices whose compute overlaps the wire
        # (float32 errors, or bfloat16 ones the native codec stores itself: taken as they are)
        if K > 1:
            flat = flat_target(tensor)
            scales = _pipeline.allreduce(flat, worker_error, server_error, group, layout, K)
            if not tensor.is_contiguous():
                tensor.copy_(flat.view(tensor.shape))
            return scales
    timer = CallTimer(tensor.device)  # compute ("codec") and collectives ("comm"), see telemetry
    stages = Stages(tensor, worker_error, server_error, layout, passes)
    with timer.stage("codec"):
        msg = stages.encode()
        recv = torch.empty_like(msg)
    with timer.stage("comm", follows=True), guard("compressed_allreduce (all_to_all)", group):
        if transport is None:
            dist.all_to_all_single(recv, msg, group=group)
        else:
            transport.all_to_all(recv, msg)
    with timer.stage("codec", follows=True):
        seg = stages.serve(recv)
        gathered = torch.empty_like(msg)  # fully overwritten by the all-gather
    with timer.stage("comm", follows=True), guard("compressed_allreduce (all_gather)", group):
        if transport is None:
            all_gather_single(gathered, seg, group)
        else:
            transport.all_gather(gathered, seg)
    with timer.stage("codec", follows=True):
        stages.decode(gathered)
    return message_scales(gathered, layout)
