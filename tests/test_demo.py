"""The README's demo runs end to end (tiny settings, 2 local ranks through torchrun)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("optimizer", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_train_lm_demo_runs(optimizer):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_lm.py"), "--optimizer", optimizer, "--steps", "6",
           "--freeze-step", "2", "--context", "16", "--d-model", "32", "--layers", "1", "--heads", "2",
           "--batch", "4", "--eval-batches", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "validation loss" in run.stdout and "bytes sent per rank" in run.stdout, run.stdout
