"""A CUDA graph's replay, emulated on the CPU (issue 57's capturable step): what a captured step would
do on every replay, checked without a GPU.

A CUDA graph records a stream's device work once and replays it: the same kernels with the same
arguments (addresses and scalars baked at capture), the same collectives on the same buffers, the same
copies; allocations made during the capture keep their addresses. The Python that issued the work does
not run again: a value the host computed at capture (a step count, a learning rate read as a float, a
buffer chosen by the host) is the value of every replay. :class:`Recorder` records one run of a callable
the same way, at the grain the device sees:

- every aten op through a dispatch mode (a view's output kept as the alias it is; an allocation kept, its
  memory the capture's; a functional op's result copied into the tensor it returned at capture, as a
  kernel writing its graph-owned output; an in-place op run again on the same tensors);
- every collective (``c10d`` ops dispatch the same way; each replayed call waits for its work);
- every Triton launch under the interpreter (``TRITON_INTERPRET=1``), with its arguments as given.

:meth:`Recorder.replay` runs the recorded work again in order. What the host would have to see
(``item``, ``bool`` and the like: a synchronisation, which capture forbids) is listed in ``reads``; Python
data made into a tensor during the run (``torch.tensor(...)``: on a GPU a copy from pageable memory, also
forbidden) in ``fresh``. A step whose replays match its eager runs bitwise, with nothing in ``reads`` and
``fresh``, is capturable by construction save for CUDA's own rules (pinned memory, events, NCCL), which
``scripts/gpu_check.sh`` tests with ``torch.cuda.graph`` on a GPU.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_READS = {"_local_scalar_dense", "is_nonzero", "equal"}  # a value into Python: a synchronisation
_FRESH = {"lift_fresh", "lift_fresh_copy"}  # Python data into a tensor
_ALLOCS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _kind(func) -> str:
    """``view`` (output aliases an input, nothing written), ``inplace`` (writes an argument: run again on
    it), ``alloc`` (memory only: kept), or ``functional`` (a new result: copied into the recorded one)."""
    schema = func._schema
    if func.namespace == "c10d":  # a collective writes its output argument
        return "inplace"
    if func.__name__.split(".")[0] in _ALLOCS:
        return "alloc"
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "inplace"
    if any(r.alias_info is not None for r in schema.returns):
        return "view"
    return "functional"


class _Mode(TorchDispatchMode):
    def __init__(self, rec: Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.rec.paused:
            return out
        base = func.__name__.split(".")[0]
        if base in _READS:
            self.rec.reads.append(str(func))
        if base in _FRESH:
            self.rec.fresh.append(tuple(out.shape))
        self.rec.ops.append(("aten", (func, _kind(func), args, kwargs, out)))
        return out


class Recorder:
    """Records one run of the device work inside its block; :meth:`replay` runs it again (module
    docstring)."""

    def __init__(self) -> None:
        self.ops: list = []
        self.reads: list[str] = []
        self.fresh: list = []
        self.paused = False
        self.launches = 0

    @contextlib.contextmanager
    def record(self):
        import triton.runtime.interpreter as interp

        run = interp.InterpretedFunction.run
        rec = self

        def recorded(fn, *args, grid, warmup, **kwargs):
            if rec.paused or warmup:
                return run(fn, *args, grid=grid, warmup=warmup, **kwargs)
            rec.ops.append(("triton", (fn, args, dict(kwargs, grid=grid))))
            rec.launches += 1
            rec.paused = True  # the interpreter's own copies are not the device's work
            try:
                return run(fn, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                rec.paused = False

        interp.InterpretedFunction.run = recorded
        self._run = run
        try:
            with _Mode(self):
                yield self
        finally:
            interp.InterpretedFunction.run = run

    def replay(self) -> None:
        """The recorded work again, in order, on the same tensors."""
        for what, item in self.ops:
            if what == "triton":
                fn, args, kwargs = item
                self._run(fn, *args, warmup=False, **kwargs)
                continue
            func, kind, args, kwargs, out = item
            if kind in ("alloc", "view"):
                continue
            new = func(*args, **kwargs)
            for x in tree_flatten(new)[0]:  # a collective's work: waited for here
                if hasattr(x, "wait") and not isinstance(x, torch.Tensor):
                    x.wait()
            if kind == "functional":
                for o, n in zip(tree_flatten(out)[0], tree_flatten(new)[0], strict=True):
                    if isinstance(o, torch.Tensor):
                        o.copy_(n)
