"""The bytes of state an object holds, counted from outside as a user's profiler would: every tensor
reachable from it (attributes, containers, the closures of its hooks), each storage counted once, the
parameters' and gradients' storages left out. The models reachable from it (``torch.nn.Module``) are
not its state and are not walked. Public as :mod:`onebit.memory`; here, below the optimizers, so
that their ``stats()`` counts with it.

    from onebit.memory import bytes_per_parameter
    bytes_per_parameter(opt)               # the optimizer's state per parameter
    bytes_per_parameter(opt, hook_state)   # AdamW behind the DDP hook: the optimizer's and the hook's
"""

from __future__ import annotations

import collections
import functools
import types
from collections.abc import Iterable

import torch

__all__ = ["bytes_per_parameter", "state_bytes"]

_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), type, types.ModuleType,
           torch.dtype, torch.device, torch.Size, torch.nn.Module)


def _storage(t: torch.Tensor) -> tuple[tuple, int] | None:
    """(key, bytes) of the storage behind ``t``, or None (no storage of its own: meta, a wrapper)."""
    local = getattr(t, "_local_tensor", None)  # a DTensor: its shard on this rank
    if local is not None:
        t = local
    if t.device.type == "meta":
        return None
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a subclass without a storage of its own
        return None
    return (s.data_ptr(), t.device), s.nbytes()


def _children(o) -> Iterable:
    if isinstance(o, dict):
        yield from o.keys()
        yield from o.values()
    elif isinstance(o, (list, tuple, set, frozenset, collections.deque)):
        yield from o
    elif isinstance(o, types.MethodType):
        yield o.__self__
        yield o.__func__
    elif isinstance(o, types.FunctionType):  # its closure's cells and defaults, not its module's globals
        for cell in o.__closure__ or ():
            try:
                yield cell.cell_contents
            except ValueError:  # an empty cell
                pass
        yield o.__defaults__
        yield o.__kwdefaults__
    elif isinstance(o, functools.partial):
        yield o.func
        yield o.args
        yield o.keywords
    else:
        d = getattr(o, "__dict__", None)
        if isinstance(d, dict):
            yield d
        for cls in type(o).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if isinstance(name, str) and hasattr(o, name):
                    yield getattr(o, name)


def state_bytes(*roots, exclude: Iterable[torch.Tensor] = ()) -> int:
    """The bytes of every storage reachable from ``roots``, each once, but those of ``exclude`` (and of
    their ``.grad``)."""
    skip = set()
    for t in exclude:
        for x in (t, t.grad):
            found = None if x is None else _storage(x)
            if found is not None:
                skip.add(found[0])
    seen, counted, stack = set(), {}, list(roots)
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _LEAVES):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found = _storage(o)
            if found is not None and found[0] not in skip:
                counted[found[0]] = max(counted.get(found[0], 0), found[1])
            continue
        stack.extend(_children(o))
    return sum(counted.values())


def bytes_per_parameter(optimizer: torch.optim.Optimizer, *others) -> float:
    """:func:`state_bytes` of ``optimizer`` (and ``others``: a hook's state) per element of the
    optimizer's parameters, the parameters and their gradients left out."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    n = sum(p.numel() for p in params)
    return state_bytes(optimizer, *others, exclude=params) / max(n, 1)
