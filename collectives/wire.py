"""Bytes each rank sends: the models, and a counter the collectives keep.

``traffic`` counts, per process, the bytes this rank sent through onebit's collectives
(host-side integers: no synchronisation). ``compressed`` is what compressed_allreduce
sent; ``full`` what the full-precision averaging sent (ring all-reduce model). Each 1-bit
optimizer keeps a :class:`Traffic` of its own as well (``opt.traffic``; ``opt.stats()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..kernels.layout import layout_of


def compressed_bytes(padded_numel: int, world_size: int, block: int | None = None) -> int:
    """Bytes one rank sends in one compressed_allreduce of N elements (both collectives)."""
    if world_size == 1:
        return 0
    seg = layout_of(padded_numel, world_size, block).segment_bytes
    return 2 * (world_size - 1) * seg  # W-1 segments in the all-to-all, W-1 in the all-gather


def ring_allreduce_bytes(numel: int, world_size: int, element_size: int = 4) -> int:
    """Bytes one rank sends in a ring all-reduce (reduce-scatter + all-gather) of numel elements."""
    return 2 * (world_size - 1) * numel * element_size // world_size if world_size > 1 else 0


_SECONDS = {kind: f"{kind}_seconds" for kind in ("codec", "comm", "full", "control")}


PENDING_BOUND = 64  # CUDA stages a counter holds unread before it folds in the completed ones (6 per call)


@dataclass
class Traffic:
    """Bytes this process sent through onebit since the last ``reset()`` (the type of
    :data:`traffic`, and of a 1-bit optimizer's ``traffic``): ``compressed`` bytes in 1-bit
    calls, ``full`` bytes in full-precision averaging, ``control`` bytes in the small
    agreement all-reduces an optimizer makes every step (non-finite check, freeze vote), and
    the number of calls of each kind."""

    compressed: int = 0
    full: int = 0
    compressed_calls: int = 0
    full_calls: int = 0
    control: int = 0
    control_calls: int = 0
    intra: int = 0  # hierarchical all-reduce: full-precision bytes inside a node (not across nodes)
    codec_seconds: float = 0.0  # compressed calls: encode, server reduce, decode
    comm_seconds: float = 0.0  # compressed calls: all-to-all and all-gather, waiting included
    full_seconds: float = 0.0  # full-precision all-reduces
    control_seconds: float = 0.0  # agreement all-reduces (mostly latency)
    # CUDA: (kind, start event, end event) not yet folded into the seconds (see telemetry)
    _pending: list = field(default_factory=list, repr=False, compare=False)

    def reset(self) -> None:
        self.compressed = self.full = self.compressed_calls = self.full_calls = 0
        self.control = self.control_calls = self.intra = 0
        self.codec_seconds = self.comm_seconds = self.full_seconds = self.control_seconds = 0.0
        self._pending = []

    def add_seconds(self, kind: str, seconds: float) -> None:
        """Add a stage's duration: ``kind`` is "codec", "comm", "full" or "control"."""
        name = _SECONDS[kind]
        setattr(self, name, getattr(self, name) + seconds)

    def add_pending(self, kind: str, start, end) -> None:
        """A CUDA stage between two recorded events, folded in when read (:meth:`resolve`), or once
        more than ``PENDING_BOUND`` wait, as soon as its end event has completed (without waiting:
        a process that never reads its counters holds a bounded number of events)."""
        self._pending.append((kind, start, end))
        if len(self._pending) > PENDING_BOUND:
            self._fold_completed()

    def _fold_completed(self) -> None:
        """Fold in the oldest pending stages whose end event has completed (``query()``: no host
        synchronisation), in order, up to the first that has not."""
        done = 0
        for kind, start, end in self._pending:
            if not end.query():
                break
            self.add_seconds(kind, start.elapsed_time(end) / 1000.0)
            done += 1
        del self._pending[:done]

    def resolve(self) -> None:
        """Fold the pending CUDA stages into the seconds (waits for their end events)."""
        pending, self._pending = self._pending, []
        for kind, start, end in pending:
            end.synchronize()
            self.add_seconds(kind, start.elapsed_time(end) / 1000.0)

    def state(self) -> dict:
        """The counters as plain numbers (checkpoints; pending CUDA stages folded in)."""
        self.resolve()
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    def add_compressed(self, padded_numel: int, world_size: int, block: int | None = None) -> None:
        """Count one compressed_allreduce of ``padded_numel`` elements."""
        self.compressed += compressed_bytes(padded_numel, world_size, block)
        self.compressed_calls += 1

    def add_full(self, numel: int, world_size: int, element_size: int = 4, *, control: bool = False) -> None:
        """Count one full-precision all-reduce of ``numel`` elements (ring model); ``control``:
        an agreement all-reduce rather than data."""
        sent = ring_allreduce_bytes(numel, world_size, element_size)
        if control:
            self.control += sent
            self.control_calls += 1
        else:
            self.full += sent
            self.full_calls += 1


traffic = Traffic()
"""This process's byte counter (a :class:`Traffic`): every compressed_allreduce call and the
optimizers' full-precision averaging add what this rank sends; ``traffic.reset()`` starts
again from zero."""
