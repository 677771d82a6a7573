"""The suite's launcher (tests/zygote.py) behaves as torchrun does where the tests rely on it:
torchrun's variables, the script as __main__ in its folder and working directory, the exit
steps of an interpreter, a failing rank stopping the others, a timeout killing the launch."""

from __future__ import annotations

import subprocess
import textwrap

import pytest
from zygote import launch

SCRIPT = """
import atexit, json, os, sys, threading, time, weakref
import torch.distributed as dist

dist.init_process_group("gloo")
r = dist.get_rank()
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "MINE"]
print(json.dumps({"env": {k: os.environ.get(k) for k in names}, "argv": sys.argv[1:], "cwd": os.getcwd(),
                  "path0": sys.path[0], "name": __name__, "world": dist.get_world_size()}))
class Live:  # what only the script's globals hold: alive when the atexit handlers run, as in an
    pass      # interpreter's exit (the handler itself holds a weak reference and not the globals)


live = Live()
atexit.register(eval, "print('atexit', r, ref() is not None, file=sys.stderr, flush=True)",
                {"ref": weakref.ref(live), "r": r, "sys": sys})
threading.Thread(target=lambda: (time.sleep(0.3), print(f"thread {r} done", flush=True))).start()
dist.barrier()
dist.destroy_process_group()
if len(sys.argv) > 2 and int(sys.argv[2]) == r:  # `status rank`: that rank exits with that status
    sys.exit(int(sys.argv[1]))
if len(sys.argv) > 1 and sys.argv[1] == "hang":
    time.sleep(600)
"""


def _write(tmp_path, code: str):
    script = tmp_path / "sub" / "script.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(code))
    return script


def test_ranks_get_torchruns_variables_and_an_interpreters_exit(tmp_path):
    import json
    import os

    script = _write(tmp_path, SCRIPT)
    run = launch(script, "a b", nproc=3, cwd=tmp_path, env=dict(os.environ, MINE="x"), timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    for r, out in enumerate(run.rank_stdout):
        lines = out.splitlines()
        got = json.loads(lines[0])
        assert got["env"] == {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3",
                              "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "zygote",
                              "MINE": "x"}
        assert got["argv"] == ["a b"] and got["world"] == 3 and got["name"] == "__main__"
        assert got["cwd"] == str(tmp_path) and got["path0"] == str(script.parent)
        assert f"thread {r} done" in lines  # non-daemon threads joined before the exit
        assert f"atexit {r} True" in run.stderr  # the handlers ran, the script's objects alive


def test_a_failing_rank_stops_the_others_with_status_1(tmp_path):
    script = _write(tmp_path, SCRIPT)
    run = launch(script, "7", "1", nproc=3, cwd=tmp_path, timeout=120)  # rank 1 exits 7, the others end 0
    assert run.returncode == 1 and "rank 1 exited with status 7" in run.stderr, run.stderr[-3000:]


def test_a_launch_past_its_timeout_is_killed(tmp_path):
    script = _write(tmp_path, SCRIPT)
    with pytest.raises(subprocess.TimeoutExpired):
        launch(script, "hang", nproc=2, cwd=tmp_path, timeout=5)
    run = launch(script, nproc=2, cwd=tmp_path, timeout=120)  # the launcher still serves
    assert run.returncode == 0, run.stderr[-3000:]


def test_a_python_error_is_a_failed_rank_with_its_traceback(tmp_path):
    script = _write(tmp_path, "import os\nif os.environ['RANK'] == '0':\n    raise ValueError('boom')\n")
    run = launch(script, nproc=2, cwd=tmp_path, timeout=60)
    assert run.returncode == 1 and "ValueError: boom" in run.stderr, run.stderr[-3000:]
