"""What forces a backend: the ``use_backend`` blocks of this thread and ``ONEBIT_BACKEND``. Kept apart
from :mod:`onebit.kernels.backends` (which builds on it) so that the native bindings can read the
instruction-set cap without importing the selection that imports them."""

from __future__ import annotations

import os
import threading

ENV = "ONEBIT_BACKEND"
NAMES = ("plain", "native", "triton")
ISA_LEVELS = {"c": 0, "avx2": 1, "avx512": 2}  # native's variants: the instruction set its C may use
_local = threading.local()


def check(name: object, what: str) -> str:
    """``name`` as given (``native:avx2`` included) where it names a backend, else a ValueError."""
    base, _, variant = name.partition(":") if isinstance(name, str) else (None, "", "")
    if base not in NAMES or (variant and (base != "native" or variant not in ISA_LEVELS)):
        raise ValueError(f"{what}: expected one of {', '.join(NAMES)} (or native:{'|'.join(ISA_LEVELS)}), "
                         f"got {name!r}")
    return name


def stack() -> list:
    """This thread's ``use_backend`` blocks, innermost last: ``(name, steps or None)``."""
    return _local.__dict__.setdefault("stack", [])


def env() -> str | None:
    """``ONEBIT_BACKEND``, checked, or None where it is unset."""
    value = os.environ.get(ENV, "").strip()
    return check(value, ENV) if value else None


def native_isa() -> int:
    """The highest ISA level the native C may use (2: AVX-512, 1: AVX2 + FMA, 0: portable C): a
    ``native:<isa>`` forced by the innermost ``use_backend`` that names one, else by
    ``ONEBIT_BACKEND``, else 2 (the C then takes the best this CPU has)."""
    for name, _ in reversed(stack()):
        if ":" in name:
            return ISA_LEVELS[name.partition(":")[2]]
    value = env()
    return ISA_LEVELS[value.partition(":")[2]] if value and ":" in value else 2
