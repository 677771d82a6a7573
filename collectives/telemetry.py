"""Where onebit's collectives spend their time: compute and communication, per call.

Every ``compressed_allreduce`` times its compute stages (encode, server reduce, decode:
``codec``) and its two collectives (all-to-all, all-gather: ``comm``); the full-precision
averaging of the optimizers and hooks times its all-reduce (``full``), their agreement
all-reduces (non-finite check, freeze vote) theirs (``control``). CPU: host timers
(``time.perf_counter``) around each stage, the collectives' waiting included; asynchronous
calls count from a collective's launch to its completion callback. CUDA: a pair of events per
stage on the stream current when the call began, folded into seconds when read (no host
synchronisation before), or, in a counter that holds more than ``wire.PENDING_BOUND`` of them
unread, as soon as they have completed (``Event.query``: no wait); a stage that follows another
directly (``stage(kind, follows=True)``) starts at the other's end event, so a compressed call
records 6 events, not 10. About 3 us per
compressed call on the CPU (five stages; measured): always on.

The seconds go to onebit's per-process counter (:data:`onebit.collectives.traffic`) and to
every counter a caller registered for the calls it makes (:func:`counting`; the optimizers
and hooks do, so their ``stats()`` report their own).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

from .wire import Traffic, traffic

__all__ = ["CallTimer", "counting"]

_local = threading.local()


@contextlib.contextmanager
def counting(counter: Traffic) -> Iterator[None]:
    """Calls made in this thread inside the block also add their seconds to ``counter``."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(counter)
    try:
        yield
    finally:
        stack.pop()


def _sinks() -> list[Traffic]:
    stack = getattr(_local, "stack", None)
    return [traffic, *stack] if stack else [traffic]


class CallTimer:
    """Times the stages of one call on ``device`` into the counters active where it was made
    (the global one, those of :func:`counting` and ``extra``), captured at construction so
    that callbacks on other threads add to the same ones."""

    def __init__(self, device: torch.device, extra: Traffic | None = None) -> None:
        self.sinks = _sinks()
        if extra is not None and not any(sink is extra for sink in self.sinks):
            self.sinks.append(extra)
        self.cuda = device.type == "cuda"
        # no timing while a CUDA graph is captured (events would be the graph's: telemetry stays outside)
        self.off = self.cuda and torch.cuda.is_current_stream_capturing()
        # the stream, looked up once (a lookup per event cost more than the event on a GPU host)
        self._stream = torch.cuda.current_stream(device) if self.cuda else None
        self._t0 = 0.0
        self._event: torch.cuda.Event | None = None
        self._stop: torch.cuda.Event | None = None  # the last stage's end
        self._kind = ""
        self._follows = False

    def begin(self) -> None:
        """Start a stage (CPU: now; CUDA: an event on the call's stream, or the previous stage's
        end event when this stage follows it directly)."""
        if self.off:
            return
        if self.cuda:
            if self._follows and self._stop is not None:
                self._event = self._stop
            else:
                self._event = torch.cuda.Event(enable_timing=True)
                self._event.record(self._stream)
        else:
            self._t0 = time.perf_counter()

    def end(self, kind: str) -> None:
        """End the stage begun last and add its duration to ``kind`` ("codec", "comm", "full",
        "control")."""
        if self.off:
            return
        if self.cuda:
            stop = self._stop = torch.cuda.Event(enable_timing=True)
            stop.record(self._stream)
            for sink in self.sinks:
                sink.add_pending(kind, self._event, stop)
        else:
            seconds = time.perf_counter() - self._t0
            for sink in self.sinks:
                sink.add_seconds(kind, seconds)

    def stage(self, kind: str, follows: bool = False) -> CallTimer:
        """``with timer.stage(kind):`` times the block (not recorded when it raises).
        ``follows``: the block starts right where the previous stage ended (no device work
        enqueued in between), so its start is that stage's end event."""
        self._kind, self._follows = kind, follows
        return self

    def __enter__(self) -> None:
        self.begin()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.end(self._kind)

    def add(self, kind: str, seconds: float) -> None:
        """A duration measured by the caller (asynchronous collectives: launch to completion)."""
        for sink in self.sinks:
            sink.add_seconds(kind, seconds)
