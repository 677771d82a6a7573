"""Compressed all-reduces started from backward, bucket by bucket (``overlap=True``).

OnebitAdam's compression stage folds each rank's local gradient into the momentum and
all-reduces the momentum buckets; ZeroOneAdam's phase-1 gradient steps copy the gradients
into the accumulator and all-reduce that. Neither needs the whole backward: a bucket can go
as soon as every parameter in it has its gradient. A post-accumulate-grad hook on each parameter
counts them; a bucket whose count is complete is folded and its
``compressed_allreduce(..., async_op=True)`` started while backward goes on. ``step()``
starts what backward did not (parameters without a gradient on this rank), waits, and
updates.

Order: every rank must issue the collectives of one group in the same order. Buckets are
launched in a fixed order (the last bucket first, the order backward usually produces them);
a bucket that completes early waits for the ones before it in that order, and the rest are
launched by ``step()`` before its own collectives. So a rank where some parameter got no
gradient issues the same sequence, only later.

Skipping: a non-finite gradient on any rank makes every rank skip the step and change no
state. Here the momentum was folded and all-reduced before ``step()`` could agree on that,
so each launched bucket's momentum is copied first (4 bytes per element per step, kept
only while ``nonfinite`` is not None) and restored on a skip; compressed_allreduce leaves
the error buffers untouched when any input is non-finite.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..collectives.bucket import BucketedReducer
from ..collectives.telemetry import counting

__all__ = ["BackwardOverlap"]


class BackwardOverlap:
    """Launches ``reducer``'s buckets from post-accumulate-grad hooks on ``params``.

    ``wanted()`` says whether the coming step compresses (otherwise the hooks do nothing);
    ``fill(k)`` writes parameter k's contribution into its bucket view before the launch.
    """

    def __init__(self, reducer: BucketedReducer, params: list[torch.Tensor], wanted: Callable[[], bool],
                 fill: Callable[[int], None], backup: Callable[[], bool]) -> None:
        self.reducer, self.wanted, self.fill, self.backup = reducer, wanted, fill, backup
        buckets = reducer.buckets
        self.order = list(reversed(range(len(buckets))))
        self.bucket_of = {}
        for b, bucket in enumerate(buckets):
            for i in bucket.indices:
                self.bucket_of[i] = b
        self.copies: list[torch.Tensor | None] = [None] * len(buckets)
        self.paused = 0
        self._reset()
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(k)) for k, p in enumerate(params)]

    def _reset(self) -> None:
        n = len(self.reducer.buckets)
        self.missing = [len(b.indices) for b in self.reducer.buckets]
        self.seen: set[int] = set()
        self.futures: list[torch.futures.Future | None] = [None] * n
        self.saved = [False] * n
        self.next = 0  # position in self.order of the next bucket to launch

    @property
    def launched(self) -> int:
        return self.next

    def _hook(self, k: int):
        def on_grad(p: torch.Tensor) -> None:
            if self.paused or not self.wanted():
                return
            b = self.bucket_of[k]
            if self.futures[b] is not None or k in self.seen:
                raise RuntimeError(
                    "backward: a gradient was accumulated after its bucket's compressed all-reduce "
                    "started (overlap=True); run the accumulation passes under `with opt.no_sync():` "
                    "and call step() after the last backward")
            self.seen.add(k)
            self.missing[b] -= 1
            self._launch_ready()

        return on_grad

    def _launch_ready(self) -> None:
        while self.next < len(self.order) and self.missing[self.order[self.next]] == 0:
            self._launch(self.order[self.next])

    def _launch(self, b: int) -> None:
        bucket = self.reducer.buckets[b]
        if self.backup():
            if self.copies[b] is None:
                self.copies[b] = torch.empty_like(bucket.flat)
            self.copies[b].copy_(bucket.flat)
            self.saved[b] = True
        for i in bucket.indices:
            self.fill(i)
        reducer = self.reducer
        block = {} if reducer.block is None else {"block": reducer.block}  # as compressed_mean_ calls it
        with counting(reducer.traffic):  # the call's seconds (telemetry) go to the optimizer's counter
            self.futures[b] = reducer.allreduce(bucket.flat, bucket.worker_error, bucket.server_error,
                                                reducer.compress_group, async_op=True, **block)
        self.reducer.count_compressed(bucket)
        self.next += 1

    def launch_rest(self) -> None:
        """Launch, in order, every bucket backward did not (a collective on every rank)."""
        while self.next < len(self.order):
            self._launch(self.order[self.next])

    def wait(self) -> None:
        """Wait for every launched bucket (launch_rest first); then ready for the next backward."""
        try:
            for fut in self.futures:
                if fut is not None:
                    fut.wait()
        finally:
            self.futures = [None] * len(self.futures)

    def restore(self) -> None:
        """Put back the momentum of every launched bucket (the step is skipped)."""
        for b, bucket in enumerate(self.reducer.buckets):
            if self.saved[b]:
                bucket.flat.copy_(self.copies[b])

    def done(self) -> None:
        self._reset()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
