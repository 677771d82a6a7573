"""compressed_allreduce(..., async_op=True): the same stages, chained without blocking the caller.

CUDA (NCCL): the caller enqueues every stage on its current stream (kernels and NCCL
collectives never block the host), so the returned future is complete at once in the CUDA
sense: its value is ready for work queued on that stream afterwards, as with any CUDA op.

Other backends (gloo): the caller compresses and starts the all-to-all; when it completes,
a callback (on the transport's thread) runs the server reduction and starts the all-gather;
when that completes, another callback decompresses and completes the future. Gloo pairs the
collectives of one process group by the order in which each rank issues them, so every rank
must issue them in the same order. All-to-alls are issued by the caller, in call order; the
all-gathers would be issued by callbacks, whose timing differs between ranks, in between
later all-to-alls. So the all-gathers go to a second process group over the same ranks (made
once per group, on the first asynchronous call), and a sequencer issues them in call order
even when a later call's all-to-all completes first. Each rank then issues the same sequence
on each group, whatever the timing.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from ..kernels.layout import Layout
from ._failure import CollectiveError, guard
from ._group import all_gather_single, members_group
from ._stages import Stages
from .telemetry import CallTimer
from .wire import compressed_bytes, traffic

__all__ = ["start"]


class _Sequencer:
    """Runs the ``issue`` functions of one group's calls in call order, whatever order they
    become ready in (an all-to-all may complete before an earlier call's)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.taken = 0  # tickets handed out (call order)
        self.next = 0  # next ticket whose issue may run
        self.pending: dict[int, object] = {}

    def ticket(self) -> int:
        with self.lock:
            self.taken += 1
            return self.taken - 1

    def ready(self, ticket: int, issue) -> None:
        """``issue`` (a callable, or None to give the slot up) may run once all earlier
        tickets have run theirs; runs every issue that is now due, in order, under the lock."""
        with self.lock:
            self.pending[ticket] = issue
            while self.next in self.pending:
                fn = self.pending.pop(self.next)
                self.next += 1
                if fn is not None:
                    fn()


class _Companion:
    """The all-gather group and sequencer of one process group (see the module docstring)."""

    def __init__(self, group) -> None:
        ranks = dist.get_process_group_ranks(group)
        # On the whole world every rank makes this call: a counter-named group. A part of the
        # world makes it alone, and its members first agree on the group's name (members_group).
        if sorted(ranks) == list(range(dist.get_world_size())):
            self.group = dist.new_group(ranks)
        else:
            self.group = members_group(ranks, [group])
        self.sequencer = _Sequencer()


_COMPANIONS: dict[object, _Companion] = {}
_IN_FLIGHT: set[int] = set()  # data pointers of error buffers that calls in flight own
_LOCK = threading.Lock()


def _companion(group) -> _Companion:
    key = group if group is not None else dist.group.WORLD
    with _LOCK:
        found = _COMPANIONS.get(key)
    if found is None:  # every rank makes its first async call on `group` at the same point
        found = _Companion(key)
        with _LOCK:
            _COMPANIONS[key] = found
    return found


def _claim(tensors: dict[str, torch.Tensor]) -> list[int]:
    """Mark the buffers as owned by a call in flight; ValueError if one already is."""
    ptrs = {name: t.data_ptr() for name, t in tensors.items()}
    with _LOCK:
        for name, ptr in ptrs.items():
            if ptr in _IN_FLIGHT:
                raise ValueError(f"{name}: expected a buffer that no call still in flight uses; wait for "
                                 "that call's future first (each call in flight needs its own tensor and "
                                 "error buffers)")
        _IN_FLIGHT.update(ptrs.values())
    return list(ptrs.values())


def _release(ptrs: list[int]) -> None:
    with _LOCK:
        _IN_FLIGHT.difference_update(ptrs)


def _failure(operation: str, group, exc: BaseException) -> BaseException:
    if isinstance(exc, CollectiveError):
        return exc
    try:
        with guard(operation, group):
            raise exc
    except BaseException as wrapped:  # noqa: BLE001 - the guard's translation, returned
        return wrapped
    return exc  # pragma: no cover


def start(tensor, flat, worker_error, server_error, group, W: int, N: int,
          block: int | None = None, passes=None) -> torch.futures.Future:
    """Start the call on validated CPU arguments (W > 1); the future's value is ``tensor``.
    (CUDA tensors take the synchronous path, which never blocks the host; see allreduce.)
    ``passes``: the worker and decompress passes with the caller's maths inside, as
    :func:`onebit.collectives.allreduce.compressed_allreduce_passes` takes them."""
    ptrs = _claim({"tensor": tensor, "worker_error": worker_error, "server_error": server_error})
    timer = CallTimer(tensor.device)  # the counters active here, also from the callbacks' threads
    launched = [0.0]  # when the collective in flight was launched (perf_counter)
    try:
        companion = _companion(group)
        stages = Stages(tensor, worker_error, server_error, Layout(N, W, block), passes, flat=flat)
        with timer.stage("codec"):
            msg = stages.encode()
        recv = torch.empty_like(msg)
        ticket = companion.sequencer.ticket()
    except BaseException:
        _release(ptrs)
        raise
    result: torch.futures.Future = torch.futures.Future()

    def fail(operation: str, exc: BaseException) -> None:
        _release(ptrs)
        result.set_exception(_failure(operation, group, exc))

    def after_all_gather(fut, gathered) -> None:
        timer.add("comm", time.perf_counter() - launched[0])
        try:
            fut.value()
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            fail("compressed_allreduce (all_gather)", exc)
            return
        with torch.no_grad(), timer.stage("codec"):
            stages.decode(gathered)
        traffic.compressed += compressed_bytes(N, W, block)
        traffic.compressed_calls += 1
        _release(ptrs)
        result.set_result(tensor)

    def after_all_to_all(fut) -> None:
        timer.add("comm", time.perf_counter() - launched[0])
        try:
            fut.value()
            with torch.no_grad(), timer.stage("codec"):
                seg = stages.serve(recv)
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            companion.sequencer.ready(ticket, None)
            fail("compressed_allreduce (all_to_all)", exc)
            return
        gathered = torch.empty_like(msg)

        def issue() -> None:
            launched[0] = time.perf_counter()
            try:
                work = all_gather_single(gathered, seg, companion.group, async_op=True)
            except BaseException as exc:  # noqa: BLE001
                fail("compressed_allreduce (all_gather)", exc)
                return
            work.get_future().then(lambda f: after_all_gather(f, gathered))

        companion.sequencer.ready(ticket, issue)

    try:
        launched[0] = time.perf_counter()
        with guard("compressed_allreduce (all_to_all)", group):
            work = dist.all_to_all_single(recv, msg, group=group, async_op=True)
    except BaseException:
        companion.sequencer.ready(ticket, None)
        _release(ptrs)
        raise
    work.get_future().then(after_all_to_all)
    return result
