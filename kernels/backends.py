"""Which backend runs a call: one table of backends and one selection function.

Three backends:

- ``plain``: torch ops, on any device; the reference every other backend is tested against.
- ``native``: the C library (``onebit/kernels/native``, ``onebit/kernels/fused``) on CPU tensors;
  AVX-512, AVX2 + FMA or portable C, chosen inside C at run time.
- ``triton``: the Triton kernels on CUDA (and ROCm) tensors; on CPU tensors only when forced and
  ``TRITON_INTERPRET=1`` (the tests run the kernels so).

Each layer asks :func:`select` once per call, for its device and the step it is about to run,
and runs that backend's implementation of the whole step, or its plain path where the answer is
``plain``. The steps (what a backend implements beyond the codec):

============ ==============================================================================
``codec``    worker compress, server reduce, decompress (``onebit.kernels.api``)
``adam``     OnebitAdam's compression step in the codec's passes (``kernels/fused/adam.py``)
``zoa``      ZeroOneAdam's phase-1 step and phase-2 synchronisation in the codec's passes
``local``    ZeroOneAdam's phase-2 local step over every parameter at once
``variance`` ZeroOneAdam's phase-1 variance step: the moments over each bucket, the stale step over all
``warmup``   OnebitAdam's warm-up update over a bucket (``kernels/fused/warmup.py``)
``hook``     the DDP / FSDP hooks' ``freeze_step`` passes before and after the collective
``tensor``   the optimizers' per-tensor element-wise passes (``onebit.kernels.cpu_fused``)
``sketch``   OnebitLamb's count sketch with its hashed index (``onebit.kernels.sketch``)
``clip``     the hooks' count sketch of a bucket for the clip's norm (the same index, sums in any order)
============ ==============================================================================

Forcing one: ``with use_backend("plain"):`` (this thread, inside the block), or the environment
variable ``ONEBIT_BACKEND=plain|native|triton`` (the process). ``use_backend(name, steps=...)``
forces it for those steps alone (the tests' "unfused step, default codec"). ``native:avx2`` (or
``native:c``, ``native:avx512``) forces native and caps the instruction set its C uses below what the
CPU has: what a CPU without AVX-512 (or without AVX2) runs, on one with it (:func:`native_isa`). A
forced backend must be usable on the call's device (else :class:`RuntimeError` naming what forced
it), and a step it does not implement runs plain. ``ONEBIT_CPU_CODEC=torch`` and
``ONEBIT_CPU_SIMD=off``, the former switches, still keep CPU tensors off the native backend, with a
``FutureWarning``.

Inside a backend a step may have routes that give the same bits (:data:`ROUTES`, each on by default);
``with use_routes(stage=False):`` turns one off in the process inside the block (the tests compare
the routes so; no module or class switch), :func:`route` reads it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from ._forcing import ENV, ISA_LEVELS, check, env, native_isa, stack
from ._warn import warn_user

__all__ = ["BACKENDS", "ENV", "ISA_LEVELS", "ROUTES", "STEPS", "Backend", "forced", "native_isa", "route",
           "select", "use_backend", "use_routes"]

STEPS = ("codec", "adam", "zoa", "local", "variance", "warmup", "hook", "tensor", "sketch", "clip")
_OLD_ENV = (("ONEBIT_CPU_CODEC", "torch"), ("ONEBIT_CPU_SIMD", "off"))
ROUTES = {  # a route inside a backend, on by default: what turning it off runs instead
    "stage": "Triton: a fused step's buckets one launch per pass (off: one launch per bucket and pass)",
    "message": "the 1-bit optimizers' momentum kept as its last 1-bit message (off: a float32 buffer)",
    "own_step": "the hook's AdamW step made by its pre-hook (off: torch's step on a prepared state)",
    "errors_in_pass": "fused passes read and store bfloat16 errors themselves (off: widened per call)",
}
_routes: dict[str, bool] = {}  # the routes turned off or on by use_routes (the process's)


def _native_available(device: torch.device) -> bool:
    if device.type != "cpu" or _switched_off():
        return False
    from . import cpu_simd

    return cpu_simd.available()


def _triton_available(device: torch.device) -> bool:
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if device.type not in ("cpu", "cuda"):
        return False
    try:
        import triton  # noqa: F401  (may be missing on a CPU machine)
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Backend:
    """One backend: its name, the steps it implements, whether it is usable for a device here, and
    what it is (for messages). The devices it takes by default: :data:`ORDER`."""

    name: str
    steps: frozenset[str]
    usable: Callable[[torch.device], bool]
    what: str

    def implements(self, step: str) -> bool:
        return step in self.steps


BACKENDS: dict[str, Backend] = {
    "plain": Backend("plain", frozenset(STEPS), lambda device: True,
                     "torch ops on any device (the reference; every step unfused)"),
    "native": Backend("native", frozenset(("codec", "adam", "zoa", "hook", "tensor", "sketch", "clip")),
                      _native_available,
                      "the C library on CPU tensors (AVX-512, AVX2 + FMA or portable C)"),
    "triton": Backend("triton", frozenset(("codec", "adam", "zoa", "local", "variance", "warmup", "hook",
                                           "clip")),
                      _triton_available,
                      "the Triton kernels on CUDA tensors (CPU tensors: forced, under TRITON_INTERPRET=1)"),
}
ORDER = {"cpu": ("native", "plain"), "cuda": ("triton", "plain")}  # the default, best first

_warned: set[str] = set()


def _switched_off() -> bool:
    """The former switches that kept CPU tensors on the plain path (warned once each)."""
    off = False
    for name, value in _OLD_ENV:
        if os.environ.get(name, "") == value:
            off = True
            if name not in _warned:
                _warned.add(name)
                warn_user(f"onebit: {name}={value} is deprecated: set {ENV}=plain (every step plain) "
                          f"instead; it still keeps CPU tensors off the native backend", FutureWarning)
    return off


def forced(step: str = "codec") -> tuple[str, str] | None:
    """``(name, what forced it)`` for ``step``: the innermost ``use_backend`` covering it, else
    ``ONEBIT_BACKEND``, else None (``name`` without its ``native:<isa>`` variant)."""
    for name, steps in reversed(stack()):
        if steps is None or step in steps:
            return name.partition(":")[0], f"use_backend({name!r})"
    value = env()
    return (value.partition(":")[0], f"{ENV}={value}") if value else None


@contextlib.contextmanager
def use_backend(name: str, steps: Iterable[str] | None = None) -> Iterator[None]:
    """Force backend ``name`` in this thread inside the block: for every step, or for ``steps``
    alone (names from :data:`STEPS`); ``native:avx2`` (``native:c``, ``native:avx512``) also caps
    the native C's instruction set."""
    check(name, "name")
    chosen = None if steps is None else frozenset(steps)
    for step in chosen or ():
        if step not in STEPS:
            raise ValueError(f"steps: expected names from {', '.join(STEPS)}, got {step!r}")
    blocks = stack()
    blocks.append((name, chosen))
    try:
        yield
    finally:
        blocks.pop()


@contextlib.contextmanager
def use_routes(**on: bool) -> Iterator[None]:
    """Turn routes of :data:`ROUTES` on or off inside the block, in the whole process (the passes of a
    collective may run on the transport's threads): ``use_routes(stage=False, message=False)``."""
    for name, value in on.items():
        if name not in ROUTES:
            raise ValueError(f"{name}: expected a route from {', '.join(ROUTES)}")
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {value!r}")
    before = dict(_routes)
    _routes.update(on)
    try:
        yield
    finally:
        _routes.clear()
        _routes.update(before)


def route(name: str) -> bool:
    """Whether route ``name`` (:data:`ROUTES`) is on (the default) or turned off by :func:`use_routes`."""
    if name not in ROUTES:
        raise ValueError(f"name: expected a route from {', '.join(ROUTES)}, got {name!r}")
    return _routes.get(name, True)


def select(device: torch.device | str, step: str = "codec") -> Backend:
    """The backend that runs ``step`` for tensors on ``device``: the forced one (raises where it
    cannot run on that device; ``plain`` where it does not implement the step), else the first in
    :data:`ORDER` that is usable and implements it, else ``plain``."""
    device = torch.device(device)
    if step not in STEPS:
        raise ValueError(f"step: expected one of {', '.join(STEPS)}, got {step!r}")
    force = forced(step)
    if force is not None:
        backend = BACKENDS[force[0]]
        if not backend.usable(device):
            raise RuntimeError(f"{force[1]}: the {backend.name} backend ({backend.what}) cannot run on "
                               f"{device.type} tensors here")
        return backend if backend.implements(step) else BACKENDS["plain"]
    for name in ORDER.get(device.type, ()):
        backend = BACKENDS[name]
        if backend.implements(step) and backend.usable(device):
            return backend
    return BACKENDS["plain"]

