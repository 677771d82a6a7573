"""The end of a distributed script: :func:`finish`.

With torch 2.13 and gloo, a rank whose work is all done now and then dies at interpreter exit
with SIGABRT ("terminate called without an active exception"): objects that still hold a
process group (a DDP model, an optimizer, a hook state, a DeviceMesh) are destroyed during
interpreter finalisation while gloo's threads still run. It is torch's: a 4-rank DDP script
without onebit did it in 1 of 20 runs (docs/failures.md). :func:`finish` ends the script
without that finalisation, so the objects a script still holds need no ``del`` first.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys

import torch.distributed as dist

__all__ = ["finish"]


def _flush_open_files() -> None:
    """Flush every open, writable file object (their buffers would otherwise be lost)."""
    for obj in gc.get_objects():
        # the type, not isinstance: isinstance asks a weakref.proxy for its referent's class,
        # and a proxy whose referent is gone raises ReferenceError (torch._dynamo keeps such
        # proxies; a rank that used the compiled CPU codec failed in finish())
        if issubclass(type(obj), io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError):  # a broken pipe, a detached buffer: nothing to save
                pass


def finish(code: int = 0) -> None:
    """End a distributed run: the last line of a script (every rank calls it).

    In order: a barrier (no rank tears gloo down while a peer still finishes its last
    collective), ``destroy_process_group()``, the ``atexit`` handlers (onebit's end-of-run
    messages, logging, multiprocessing, ``weakref.finalize``), a flush of standard output,
    standard error and every open file, then ``os._exit(code)``: the interpreter's
    finalisation, where gloo can abort, is skipped. Does not return. Without an initialised
    process group it skips the first two steps.

    Objects' ``__del__`` methods that only finalisation would run are not run (flush or close
    what must be written before calling it; open files are flushed for you).
    """
    if not isinstance(code, int) or isinstance(code, bool):
        raise TypeError(f"code: expected an int exit status, got {type(code).__name__}")
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    _flush_open_files()
    os._exit(code)
