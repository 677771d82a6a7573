"""onebit.checkpoint: atomic per-rank files, the newest step every rank has, no code on load."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist

from onebit import checkpoint
from onebit.checkpoint import CheckpointError, checkpoint_path, load, load_latest, save, steps_on_disk


class Payload:
    """Unpickling this runs code: it creates the file ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def test_round_trip_keeps_the_newest_two_steps(tmp_path):
    for step in (3, 6, 9):
        state = {"w": torch.full((4,), float(step)), "step": step, "name": "x", "nested": [1, (2.5, "y")]}
        save(state, tmp_path, step)
    assert steps_on_disk(tmp_path, 0) == [6, 9]
    assert not (tmp_path / "step000000003").exists()
    step, state = load_latest(tmp_path)
    assert step == 9 and torch.equal(state["w"], torch.full((4,), 9.0)) and state["nested"] == [1, (2.5, "y")]


def test_a_write_interrupted_before_the_rename_is_never_loaded(tmp_path):
    save({"w": torch.ones(2)}, tmp_path, 4)
    final = checkpoint_path(tmp_path, 8, 0)
    os.makedirs(os.path.dirname(final))
    with open(final + ".tmp-12345", "wb") as fh:  # what a rank killed mid-write leaves behind
        fh.write(b"PK\x03\x04 half a zip file")
    assert steps_on_disk(tmp_path, 0) == [4]
    step, state = load_latest(tmp_path)
    assert step == 4 and torch.equal(state["w"], torch.ones(2))


def test_no_checkpoint_gives_none(tmp_path):
    assert load_latest(tmp_path / "absent") is None


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("how", ["torch.save", "raw pickle"])
def test_a_pickle_payload_is_refused_and_never_runs(tmp_path, how):
    marker = str(tmp_path / "payload-ran")
    # the payload is real: plain unpickling runs it
    pickle.loads(pickle.dumps(Payload(marker)))
    assert os.path.exists(marker)
    os.remove(marker)
    path = checkpoint_path(tmp_path, 5, 0)
    os.makedirs(os.path.dirname(path))
    payload = {"onebit_checkpoint": 1, "step": 5, "rank": 0, "world_size": 1, "state": {"x": Payload(marker)}}
    if how == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as fh:
            pickle.dump(payload, fh)
    with pytest.raises(CheckpointError, match="^path: refused .*not a weights-only checkpoint"):
        load(path)
    with pytest.raises(CheckpointError, match="^path: refused"):
        load_latest(tmp_path)
    assert not os.path.exists(marker)


def test_foreign_files_are_refused(tmp_path):
    path = checkpoint_path(tmp_path, 2, 0)
    os.makedirs(os.path.dirname(path))
    torch.save({"model": torch.ones(1)}, path)  # plain data, but not written by save()
    with pytest.raises(CheckpointError, match="not a checkpoint written by onebit.checkpoint.save"):
        load(path)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(state=[1], step=1), "^state: expected a dict"),
        (dict(state={}, step=-1), "^step: expected an int"),
        (dict(state={}, step=1.0), "^step: expected an int"),
        (dict(state={}, step=1, keep=1), "^keep: expected an int >= 2"),
    ],
)
def test_bad_arguments_to_save(tmp_path, kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        save(directory=tmp_path, **kwargs)
    assert list(tmp_path.iterdir()) == []


def _body_latest(directory, lagging_rank):
    r = dist.get_rank()
    for step in (3, 6):
        if step == 6 and r == lagging_rank:  # killed while writing step 6
            path = checkpoint_path(directory, step, r)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path + ".tmp-1", "wb").close()
            continue
        save({"rank": r, "step": step}, directory, step)
    found = load_latest(directory)
    return found[0], found[1]


def test_ranks_agree_on_the_newest_step_all_of_them_have(ranks, tmp_path):
    got = ranks(3).run(_body_latest, str(tmp_path), 2)
    assert got == [(3, {"rank": r, "step": 3}) for r in range(3)]
    # rank 2's own older files were kept: keep=2 covers one lagging rank
    assert checkpoint.steps_on_disk(tmp_path, 0) == [3, 6]


def _body_empty(directory):
    return load_latest(directory)


def test_no_common_step_gives_none_on_every_rank(ranks, tmp_path):
    save({"x": 1}, tmp_path, 1)  # single-process file: rank 0 only
    assert ranks(3).run(_body_empty, str(tmp_path)) == [None, None, None]


def _body_step(directory, lagging_rank):
    r = dist.get_rank()
    for step in (3, 6):
        if not (step == 6 and r == lagging_rank):
            save({"rank": r, "step": step}, directory, step, keep=3)
    return [checkpoint.load_step(directory, s) for s in (3, 6, 9)]


def test_load_step_loads_a_named_step_only_where_every_rank_has_it(ranks, tmp_path):
    # a framework resuming from checkpoint-3 while step 6 is on disk too (load_latest would take 6)
    got = ranks(3).run(_body_step, str(tmp_path), -1)
    assert got == [[{"rank": r, "step": 3}, {"rank": r, "step": 6}, None] for r in range(3)]
    got = ranks(3).run(_body_step, str(tmp_path / "lag"), 1)  # rank 1 never wrote step 6
    assert got == [[{"rank": r, "step": 3}, None, None] for r in range(3)]
