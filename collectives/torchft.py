"""1-bit pseudo-gradients inside torchft (docs/diloco.md, "torchft").

torchft's Manager averages with ``pg.allreduce([tensor], SUM)`` and then divides by the number
of participants; its DiLoCo sends each pseudo-gradient (or bucket of them) that way.
:class:`OnebitProcessGroupGloo` is torchft's reconfigurable gloo process group whose float
SUM all-reduce is onebit's 1-bit error-compensated all-reduce (times W, so that the Manager's
division leaves the 1-bit mean); every other operation is torchft's.

Error feedback needs each pseudo-gradient's own buffers from one sync to the next. torchft
sends them in a fixed order: fragment ``manager.current_step() % fragments``, its tensors in
``named_parameters`` order. A call's buffers are keyed by (fragment, position in the sync,
numel, dtype). They are dropped when the quorum changes (``configure``: other replicas, other
chunks) and for a fragment whose last sync was not committed (its step did not advance: the
message the buffers assumed delivered was discarded).

Needs ``pip install torchft`` (Linux); import this module only then.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions
from torchft.process_group import ProcessGroupGloo

from ..kernels._checks import check_int, check_number
from ..kernels.layout import check_block, padded_numel
from .allreduce import _compressed_allreduce
from .wire import Traffic, traffic

__all__ = ["OnebitProcessGroupGloo"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class _Done(dist._Work):
    """A completed Work whose future holds the reduced tensors."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class _Raw:
    """The two collectives on a process group torch.distributed does not know (torchft's)."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg = pg

    def all_to_all(self, recv: torch.Tensor, msg: torch.Tensor) -> None:
        self.pg.alltoall_base(recv, msg, [], [], AllToAllOptions()).wait()

    def all_gather(self, out: torch.Tensor, seg: torch.Tensor) -> None:
        self.pg._allgather_base(out, seg, AllgatherOptions()).wait()


class OnebitProcessGroupGloo(ProcessGroupGloo):
    """torchft's ``ProcessGroupGloo`` whose float SUM all-reduce is 1-bit error-compensated.

    ``pg = OnebitProcessGroupGloo(); manager = Manager(pg=pg, ...); pg.attach(manager,
    fragments=len(model_fragments))``, then torchft's ``DiLoCo(manager, model_fragments, ...)``
    as usual. ``block``: block scales of that many elements (None: one per chunk), as
    :func:`~onebit.collectives.compressed_allreduce`; ``error_decay``: the error buffers times
    this after a committed sync, as ``onebit.optimizers.DiLoCo``'s (docs/ALGORITHMS.md 10).
    Integer tensors and other reductions go to gloo unchanged. ``traffic`` counts the 1-bit
    bytes this replica sent; ``resets`` the times error buffers were dropped.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60), *, block: int | None = 128,
                 error_decay: float = 0.5) -> None:
        super().__init__(timeout=timeout)
        self.block = check_block(block)
        self.error_decay = check_number("error_decay", error_decay, 0.0)
        if self.error_decay > 1.0:
            raise ValueError(f"error_decay: expected a number in [0, 1], got {error_decay!r}")
        self.fragments = 1
        self.traffic = Traffic()
        self.resets = 0
        self._manager: Any = None
        self._errors: dict[tuple, list] = {}  # key -> [worker error, server error, step last used]
        self._layout: dict[int, list] = {}  # fragment -> (numel, dtype) of each call of its sync
        self._step: int | None = None
        self._position = 0

    def attach(self, manager: Any, fragments: int = 1) -> None:
        """The Manager whose step numbers the syncs, and torchft DiLoCo's fragment count."""
        if not hasattr(manager, "current_step"):
            raise TypeError(f"manager: expected a torchft Manager, got {type(manager).__name__}")
        self.fragments = check_int("fragments", fragments, low=1)
        self._manager = manager

    def configure(self, *args: Any, **kwargs: Any) -> None:
        super().configure(*args, **kwargs)
        if self._errors:
            self.resets += 1
        self._errors.clear()  # a new quorum: other replicas, other chunks

    def allreduce(self, tensors: list[torch.Tensor], opts: object) -> dist.Work:
        op = opts if isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)) else opts.reduceOp
        if op != dist.ReduceOp.SUM or any(t.dtype not in _FLOATS for t in tensors):
            return super().allreduce(tensors, opts)
        if self._manager is None:
            raise RuntimeError("OnebitProcessGroupGloo: call pg.attach(manager, fragments=...) before "
                               "training (the Manager's step tells the syncs apart)")
        W = self.size()
        step = self._manager.current_step()
        if step != self._step:
            self._step, self._position = step, 0
        with self._run_context():
            for t in tensors:
                self._one(t, step, W)
        return _Done(tensors)

    @torch.no_grad()
    def _one(self, t: torch.Tensor, step: int, W: int) -> None:
        fragment, what = step % self.fragments, (t.numel(), t.dtype)
        key = (fragment, self._position, *what)
        seen = self._layout.setdefault(fragment, [])
        if self._position < len(seen) and seen[self._position] != what:
            raise ValueError(f"fragments: call {self._position} of fragment {fragment}'s sync has "
                             f"{what[0]} elements of {what[1]}, {seen[self._position][0]} of "
                             f"{seen[self._position][1]} the last time; attach(manager, fragments=...) "
                             f"must be given torchft DiLoCo's number of model fragments ({self.fragments} "
                             "given)")
        if self._position == len(seen):
            seen.append(what)
        self._position += 1
        if W == 1 or t.numel() == 0:
            return
        N = padded_numel(t.numel(), W, self.block)
        entry = self._errors.get(key)
        if entry is None or entry[2] == step:  # new, or its last sync was not committed
            if entry is not None:
                self.resets += 1
            entry = [torch.zeros(N, device=t.device), torch.zeros(N // W, device=t.device), step]
            self._errors[key] = entry
        elif self.error_decay != 1.0:  # the last sync was committed: its residual, decayed
            entry[0].mul_(self.error_decay)
            entry[1].mul_(self.error_decay)
        entry[2] = step
        raw = _Raw(self.parent)
        scales = _compressed_allreduce(t, entry[0], entry[1], None, W, self.block, transport=raw)
        for counter in (traffic, self.traffic):
            counter.add_compressed(N, W, self.block)
        if not bool(torch.isfinite(scales).all()):  # the same on every replica; buffers unchanged
            raise FloatingPointError("OnebitProcessGroupGloo: a replica's pseudo-gradient was not finite; "
                                     "the Manager skips this sync on every replica")
        t.mul_(W)  # SUM: the Manager divides by the participants
