"""Faults in a running W = 4 gloo training job (the demo, examples/train_lm.py).

A rank SIGKILLed mid-step: every survivor stops with CollectiveError within the bounded
time, and a restart from the newest complete checkpoint ends bitwise where an uninterrupted
run ends. A rank that hangs (SIGSTOP): the survivors give up after --timeout. A replica
nudged by one weight: the periodic fingerprint check stops every rank, naming the weight.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, TINY, demo_fingerprint
from zygote import launch

pytestmark = pytest.mark.slow

W = 4
SCRIPT = str(ROOT / "examples" / "train_lm.py")
COMMON = [*TINY, "--optimizer", "onebit_adam", "--steps", "12", "--checkpoint-every", "3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: list[str]) -> list[subprocess.Popen]:
    """W ranks as plain processes (torchrun would kill the survivors itself)."""
    port = _free_port()
    procs = []
    for r in range(W):
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(W),
                   LOCAL_WORLD_SIZE=str(W), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, SCRIPT, *args], env=env, cwd=ROOT, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def _torchrun(args: list[str], expect_ok: bool = True):
    """W ranks started as torchrun starts them (tests/zygote.py: forked, torch imported once);
    as with torchrun, the first rank that fails stops the others."""
    run = launch(SCRIPT, *args, nproc=W, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    if expect_ok:
        assert run.returncode == 0, run.stderr[-3000:]
    return run


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] == "T"


def _wait_for_fault(victim: subprocess.Popen, fault: str, deadline: float) -> float:
    while time.monotonic() < deadline:
        if (fault == "kill" and victim.poll() is not None) or (fault == "hang" and _stopped(victim.pid)):
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError(f"the {fault} fault did not happen")


def _survivors_stop(procs, victim: int, fault: str, timeout: float) -> list[str]:
    t_fault = _wait_for_fault(procs[victim], fault, time.monotonic() + 120)
    bound = timeout + 10.0  # the collective's timeout plus process exit
    errors = []
    try:
        for r, p in enumerate(procs):
            if r == victim:
                continue
            _, err = p.communicate(timeout=max(1.0, t_fault + bound - time.monotonic()))
            elapsed = time.monotonic() - t_fault
            assert p.returncode == 3, f"rank {r} exited with {p.returncode}: {err[-2000:]}"
            assert elapsed < bound, f"rank {r} took {elapsed:.1f} s"
            errors.append(err)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    if fault == "kill":
        assert procs[victim].returncode == -signal.SIGKILL
    return errors


def test_killed_rank_stops_survivors_and_restart_is_bitwise(tmp_path: Path):
    straight = _torchrun([*COMMON, "--checkpoint-dir", str(tmp_path / "straight")])
    ckpt = str(tmp_path / "faulty")
    procs = _launch([*COMMON, "--checkpoint-dir", ckpt, "--timeout", "20", "--fault", "kill",
                     "--fault-rank", "2", "--fault-step", "8"])
    for err in _survivors_stop(procs, 2, "kill", 20.0):
        assert "CollectiveError: " in err and "a peer rank exited" in err, err[-2000:]
        assert "restart all ranks with --resume" in err
    resumed = _torchrun([*COMMON, "--checkpoint-dir", ckpt, "--resume"])
    assert "resumed from step 6" in resumed.stdout
    assert demo_fingerprint(resumed.stdout) == demo_fingerprint(straight.stdout)


def test_hung_rank_stops_survivors_after_the_timeout(tmp_path: Path):
    procs = _launch([*COMMON, "--checkpoint-dir", str(tmp_path), "--timeout", "4", "--fault", "hang",
                     "--fault-rank", "1", "--fault-step", "4"])
    errors = _survivors_stop(procs, 1, "hang", 4.0)
    # The first survivor to time out exits, and a survivor still waiting then sees that peer
    # close its connection (seen on a loaded machine): every survivor stops with a
    # CollectiveError, at least one of them because of the timeout.
    for err in errors:
        assert "CollectiveError: " in err, err[-2000:]
        assert "restart all ranks with --resume" in err
    assert any("Timed out" in err for err in errors), [err[-500:] for err in errors]


def test_diverged_replica_is_caught_by_the_periodic_check(tmp_path: Path):
    run = _torchrun([*COMMON, "--checkpoint-dir", str(tmp_path), "--verify-every", "4", "--fault", "diverge",
                     "--fault-rank", "3", "--fault-step", "6"], expect_ok=False)
    assert run.returncode != 0
    assert "ReplicaMismatchError: verify_replicas: 'tok.weight' differs between replicas: group rank(s) [3]" \
        in run.stderr, run.stderr[-3000:]
    assert "validation loss" not in run.stdout
