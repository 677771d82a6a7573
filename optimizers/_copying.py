"""Copies and pickles of a 1-bit optimizer that go on stepping (issue 58). torch's
``Optimizer.__getstate__`` keeps ``defaults``, ``state`` and ``param_groups`` only; a 1-bit optimizer's
configuration, counters, reducer (buckets, error buffers, kept messages) and stage live in other
attributes, so its copy needs them all. A mixin of
:class:`~onebit.optimizers._base.OnebitOptimizerBase`.

- ``copy.deepcopy(opt)``: every attribute copied (the parameters too, as torch's deepcopy of an optimizer
  does), the process groups and meshes shared (a group cannot be copied; the copy runs its collectives
  on the same ranks). The copy continues bitwise as the original would.
- ``pickle`` and ``torch.save(opt)``: the same attributes; the process group must be the default one
  (``group=None``): a ``ProcessGroup`` cannot be pickled (TypeError naming it). Unpickled in another
  process it uses that process's default group.
- Neither with ``overlap=True``: its backward hooks on the parameters hold this optimizer (TypeError).

The fused steps' plans (``*_cache``: address tables of this optimizer's tensors) are not copied; the copy
makes its own at its first step.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ._memory import _LEAVES, _children


def _handles(root) -> list:
    """The process groups and device meshes reachable from ``root`` (shared, never copied)."""
    from torch.distributed.device_mesh import DeviceMesh

    found, seen, stack = [], set(), [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (*_LEAVES, torch.Tensor)):
            continue
        seen.add(id(o))
        if isinstance(o, (dist.ProcessGroup, DeviceMesh)):
            found.append(o)
            continue
        stack.extend(_children(o))
    return found


class Copying:
    """``__getstate__`` / ``__deepcopy__`` for the 1-bit optimizers (module docstring)."""

    def _copyable_state(self, how: str) -> dict:
        if getattr(self, "_overlap", None) is not None:
            raise TypeError(f"{how}: an optimizer built with overlap=True cannot be copied (its backward "
                            f"hooks on the parameters hold it); build a new one and "
                            f"load_state_dict(state_dict())")
        self._resolve_device_agreement()  # (its event and pinned flag are not copied)
        return {k: v for k, v in self.__dict__.items() if not k.endswith("_cache")}

    def __getstate__(self) -> dict:
        state = self._copyable_state("pickle")
        handles = _handles(state)
        if handles:
            raise TypeError(f"pickle: the optimizer holds a {type(handles[0]).__name__} (group= or a mesh), "
                            f"which cannot be pickled; copy.deepcopy shares it, or save state_dict() instead")
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        reducer = self.__dict__.get("_reducer")
        if reducer is None:
            return
        # the reducer made its views again over its buffers (BucketedReducer.__setstate__: plain pickle
        # gives each view a storage of its own); the flat state is pointed at them, as _bind_state does
        (flat_name,) = self.FLAT_STATE
        pairs = self.compressed_params()
        for b in reducer.buckets:
            if b.flat is None:  # kept as its message, or released: no view
                continue
            for i, view in zip(b.indices, b.views, strict=True):
                entry = self.state[pairs[i][0]]
                if flat_name in entry:
                    entry[flat_name] = view

    def __deepcopy__(self, memo: dict):
        state = self._copyable_state("deepcopy")
        for handle in _handles(state):
            memo[id(handle)] = handle
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(state, memo))
        return new
