"""The README's demo runs end to end (tiny settings, 2 local ranks; once through torchrun)."""

from __future__ import annotations

import os

import pytest
from helpers import ROOT, TINY, demo_fingerprint
from zygote import launch


def _demo(*args: str, real: bool = False) -> str:
    # 2 ranks started as torchrun starts them (tests/zygote.py), or by torchrun itself (``real``:
    # the README's command line)
    run = launch(ROOT / "examples" / "train_lm.py", *TINY, *args, nproc=2, cwd=ROOT,
                 env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300, real=real)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "validation loss" in run.stdout and "bytes sent per rank" in run.stdout, run.stdout
    return run.stdout


@pytest.mark.parametrize("optimizer", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_train_lm_demo_runs(optimizer):
    out = _demo("--optimizer", optimizer, "--steps", "6", real=optimizer == "onebit_adam")
    # what the run would cost on real links (issue 24): one line per link speed
    assert "projected per step on real links" in out, out
    for link in ("100 Mbit/s", "1 Gbit/s", "10 Gbit/s"):
        assert f"{link}: float32 all-reduce" in out, out


def test_train_lm_demo_on_a_mesh_of_nodes():
    out = _demo("--optimizer", "onebit_adam", "--steps", "6", "--per-node", "1")  # 2 nodes x 1 rank
    assert "on 2 nodes x 1: the 1-bit bytes cross between nodes" in out, out


# the demo's checkpoints (onebit.checkpoint) are the same code for every optimizer; each optimizer's
# own exact resume: tests/test_optimizer_state.py, test_hierarchical.py, test_rank_failure.py
@pytest.mark.parametrize("optimizer", ["onebit_adam"])
def test_train_lm_resume_is_bitwise(optimizer, tmp_path):
    straight = _demo("--optimizer", optimizer, "--steps", "8", "--checkpoint-every", "4",
                     "--checkpoint-dir", str(tmp_path / "a"))
    _demo("--optimizer", optimizer, "--steps", "4", "--checkpoint-every", "4",
          "--checkpoint-dir", str(tmp_path / "b"))
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step000000004"]
    files = sorted(p.name for p in (tmp_path / "b" / "step000000004").iterdir())
    assert files == ["rank00000.pt", "rank00001.pt"]
    resumed = _demo("--optimizer", optimizer, "--steps", "8", "--resume",
                    "--checkpoint-dir", str(tmp_path / "b"))
    assert "resumed from step 4" in resumed
    assert demo_fingerprint(resumed) == demo_fingerprint(straight)
