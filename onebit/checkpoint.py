"""Per-rank training checkpoints that survive a rank dying at any moment.

The 1-bit optimizers keep per-rank state (error feedback), so every rank saves its own file:
``<directory>/step<step>/rank<rank>.pt``. A file is written under a temporary name, flushed
to disk (fsync) and renamed: a reader never sees a half-written file under the final name,
so a checkpoint interrupted mid-write is never loaded. ``load_latest`` agrees with the other
ranks on the newest step that EVERY rank has complete (a rank killed while saving step s
leaves the others with s and itself with the step before; the older ``keep - 1`` steps stay
on disk for exactly that case) and loads it with ``torch.load(weights_only=True)``, which
never executes code from the file: a file carrying a pickled object or payload is refused
with :class:`CheckpointError`.

Typical use (``save`` every K steps; on start, ``load_latest`` on every rank)::

    found = onebit.checkpoint.load_latest("ckpt")
    if found is not None:
        step, state = found
        model.load_state_dict(state["model"]); opt.load_state_dict(state["optimizer"])
    ...
    onebit.checkpoint.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                           "ckpt", step)
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any

import torch
import torch.distributed as dist

from .collectives._failure import guard
from .collectives._group import comm_device, group_size
from .kernels._checks import check_instance, check_int

__all__ = ["CheckpointError", "RankState", "checkpoint_path", "load", "load_latest", "load_step", "save",
           "steps_on_disk"]

_STEP = re.compile(r"^step(\d{9})$")
_FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint file was refused: not weights-only, not a onebit checkpoint, or another rank's."""


def _rank(group) -> tuple[int, int]:
    W = group_size(group)
    return (0, 1) if W == 1 and not dist.is_initialized() else (dist.get_rank(group), W)


def checkpoint_path(directory: str | os.PathLike, step: int, rank: int) -> str:
    return os.path.join(os.fspath(directory), f"step{step:09d}", f"rank{rank:05d}.pt")


def _check_step(step: object) -> int:
    return check_int("step", step, low=0, high=10**9)


def save(state: dict[str, Any], directory: str | os.PathLike, step: int, *, group=None, keep: int = 2) -> str:
    """Write this rank's ``state`` for ``step`` atomically; keep this rank's newest ``keep`` steps.

    ``state`` must hold tensors, numbers, strings, lists, tuples and dicts only (what
    ``torch.load(weights_only=True)`` reads back). ``keep >= 2``: a rank killed mid-save
    leaves the others one step ahead, and the step before must still be there for everyone.
    Returns the path written. Not a collective: every rank calls it for its own file.
    """
    check_instance("state", state, dict, "a dict")
    step = _check_step(step)
    check_int("keep", keep, low=2)  # a rank killed mid-save needs the step before
    rank, W = _rank(group)
    path = checkpoint_path(directory, step, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    payload = {"onebit_checkpoint": _FORMAT, "step": step, "rank": rank, "world_size": W, "state": state}
    try:
        with open(tmp, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync_dir(os.path.dirname(path))
    for old in steps_on_disk(directory, rank)[:-keep]:
        _remove_own(directory, old, rank)
    return path


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself reaches the disk
    finally:
        os.close(fd)


def _remove_own(directory, step: int, rank: int) -> None:
    path = checkpoint_path(directory, step, rank)
    os.remove(path)
    try:
        os.rmdir(os.path.dirname(path))  # the last rank out removes the folder
    except OSError:
        pass  # other ranks' files are still there (or another rank removed it first)


def steps_on_disk(directory: str | os.PathLike, rank: int) -> list[int]:
    """Steps (ascending) for which ``rank``'s file exists under its final name."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    steps = [int(m.group(1)) for n in names if (m := _STEP.match(n))]
    return sorted(s for s in steps if os.path.isfile(checkpoint_path(directory, s, rank)))


def load(path: str | os.PathLike, *, map_location: Any = "cpu") -> dict[str, Any]:
    """Read one checkpoint file written by :func:`save`; runs no code from it.

    Raises CheckpointError when the file holds anything but plain data (a pickled object,
    a code payload) or was not written by :func:`save`.
    """
    try:
        with open(path, "rb") as fh:
            payload = torch.load(fh, weights_only=True, map_location=map_location)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(
            f"path: refused {os.fspath(path)!r}: not a weights-only checkpoint (loading it could run "
            f"code from the file, or it is damaged): {str(exc).splitlines()[0] if str(exc) else exc!r}"
        ) from exc
    if not isinstance(payload, dict) or payload.get("onebit_checkpoint") != _FORMAT:
        raise CheckpointError(
            f"path: {os.fspath(path)!r} is not a checkpoint written by onebit.checkpoint.save"
        )
    return payload


def load_latest(
    directory: str | os.PathLike, *, group=None, map_location: Any = "cpu"
) -> tuple[int, dict[str, Any]] | None:
    """The newest step that every rank of ``group`` has on disk, and this rank's state for it.

    A collective: every rank of ``group`` must call it. Returns ``(step, state)``, or None on
    every rank when no step is complete on all ranks. Raises CheckpointError when the file
    was written by another rank or world size.
    """
    rank, W = _rank(group)
    have = steps_on_disk(directory, rank)
    step = _newest_common(have, group, W)
    if step is None:
        return None
    return step, _load_own(directory, step, rank, W, map_location)


def load_step(
    directory: str | os.PathLike, step: int, *, group=None, map_location: Any = "cpu"
) -> dict[str, Any] | None:
    """This rank's state for ``step``, or None on every rank unless every rank of ``group`` has
    that step on disk (a framework resuming from a named checkpoint, not the newest one).

    A collective: every rank of ``group`` must call it. Raises CheckpointError when the file
    was written by another rank or world size."""
    step = _check_step(step)
    rank, W = _rank(group)
    have = int(step in steps_on_disk(directory, rank))
    if W > 1:
        t = torch.tensor([have], dtype=torch.int64, device=comm_device(group))
        with guard("checkpoint step agreement", group):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        have = int(t[0])
    if not have:
        return None
    return _load_own(directory, step, rank, W, map_location)


def _load_own(directory, step: int, rank: int, W: int, map_location: Any) -> dict[str, Any]:
    """This rank's state for ``step``; CheckpointError if another rank or world size wrote it."""
    path = checkpoint_path(directory, step, rank)
    payload = load(path, map_location=map_location)
    if (payload["rank"], payload["world_size"], payload["step"]) != (rank, W, step):
        raise CheckpointError(
            f"path: {path!r} was written by rank {payload['rank']} of {payload['world_size']} at step "
            f"{payload['step']}; this is rank {rank} of {W} loading step {step}"
        )
    return payload["state"]


def _newest_common(have: list[int], group, W: int) -> int | None:
    """Largest step in every rank's list (collective; a few tiny all-reduces)."""
    if W == 1:
        return have[-1] if have else None
    device = comm_device(group)
    candidate = have[-1] if have else -1
    while True:
        t = torch.tensor([candidate], dtype=torch.int64, device=device)
        with guard("checkpoint step agreement", group):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        step = int(t[0])
        if step < 0:
            return None
        t = torch.tensor([int(step in have)], dtype=torch.int64, device=device)
        with guard("checkpoint step agreement", group):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        if int(t[0]):
            return step
        candidate = max((s for s in have if s < step), default=-1)


class RankState:
    """Each rank's own onebit state in a ``torch.distributed.checkpoint`` (DCP) checkpoint.

    DCP writes a tensor that every rank holds under the same key once (it counts as replicated),
    and torch's ``get_optimizer_state_dict`` keeps only ``state`` and ``param_groups``: both
    lose the per-rank error-feedback buffers and counters. ``RankState(opt, hooks, ...)`` is a
    DCP ``Stateful`` that files them under a key of this rank's own (``rank00003``), so every
    rank writes and reads its own. Objects: 1-bit optimizers (their ``rank_state()``), hooks and
    hook states (their ``state_dict()``), or a dict of them (``register_fsdp_hooks``'s)::

        state = {"model": model_sd, "optim": optim_sd, "onebit": onebit.checkpoint.RankState(opt)}
        dcp.save(state, checkpoint_id=path)      # and dcp.load(state, checkpoint_id=path), then
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    Loading applies the state at once; an optimizer loaded afterwards from a state without its
    ``"onebit"`` entry (``set_state_dict``) keeps it. Resuming needs the same world size and mesh.
    """

    def __init__(self, *objects: Any) -> None:
        if not objects:
            raise ValueError("objects: expected at least one optimizer, hook or dict of hooks")
        self.objects = objects

    def _named(self) -> list[tuple[str, Any]]:
        out = []
        for i, obj in enumerate(self.objects):
            items = obj.items() if isinstance(obj, dict) and not hasattr(obj, "rank_state") else [("", obj)]
            for name, item in items:
                if not (hasattr(item, "rank_state") or hasattr(item, "state_dict")):
                    raise TypeError(f"objects: {type(item).__name__} has neither rank_state() nor "
                                    "state_dict()")
                out.append((f"{i}.{name}" if name else str(i), item))
        return out

    @staticmethod
    def _key() -> str:
        return f"rank{dist.get_rank() if dist.is_initialized() else 0:05d}"

    def state_dict(self) -> dict[str, Any]:
        """``{"rank<r>": bytes}``: this rank's states, serialised (``torch.save``), so that the
        structure DCP plans with is the same before and after the states grow buffers."""
        payload = {name: item.rank_state() if hasattr(item, "rank_state") else item.state_dict()
                   for name, item in self._named()}
        buffer = io.BytesIO()
        torch.save({"format": _FORMAT, "states": payload}, buffer)
        return {self._key(): buffer.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        blob = state_dict.get(self._key())
        if blob is None:
            raise CheckpointError(f"state_dict: no entry {self._key()!r} (the checkpoint holds "
                                  f"{sorted(state_dict)}); resume at the world size that saved it")
        if isinstance(blob, io.BytesIO):
            blob = blob.getvalue()
        try:  # weights only: a checkpoint cannot run code here
            mine = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)["states"]
        except (pickle.UnpicklingError, RuntimeError, KeyError, TypeError) as e:
            raise CheckpointError(f"state_dict: the entry {self._key()!r} is not a onebit RankState "
                                  f"({e})") from e
        for name, item in self._named():
            if hasattr(item, "load_rank_state"):
                item.load_rank_state(mine[name])
            else:
                item.load_state_dict(mine[name])
