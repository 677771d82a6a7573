"""onebit.finish(): the end of a script without interpreter finalisation, losing nothing that
the script wrote or registered (docs/failures.md, "A rank that aborts at exit")."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import atexit, sys
import onebit
log = open(sys.argv[1], "w")
log.write("x" * 100000)          # buffered, never closed
atexit.register(lambda: print("atexit ran", flush=True))
print("before", end="")          # no newline, no flush
sys.stderr.write("to stderr")
onebit.finish(int(sys.argv[2]))
print("after finish")            # never reached
"""


@pytest.mark.parametrize("code", [0, 3])
def test_finish_flushes_runs_atexit_and_exits_with_the_code(tmp_path, code):
    script, log = tmp_path / "s.py", tmp_path / "log.txt"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(log), str(code)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == code, run.stderr[-2000:]
    assert run.stdout.startswith("before") and "atexit ran" in run.stdout and "after finish" not in run.stdout
    assert "to stderr" in run.stderr
    assert log.read_text() == "x" * 100000


def test_finish_refuses_a_code_that_is_not_an_int():
    import onebit

    with pytest.raises(TypeError, match="code: expected an int"):
        onebit.finish("0")


def test_the_flush_of_open_files_steps_over_dead_weak_proxies(tmp_path):
    # torch._dynamo keeps weakref.proxy objects; isinstance() on one whose referent is gone raises
    # ReferenceError, which made finish() fail on ranks that had used the compiled CPU codec
    import gc
    import weakref

    from onebit.teardown import _flush_open_files

    class Thing:
        pass

    thing = Thing()
    proxy = weakref.proxy(thing)
    del thing
    gc.collect()
    assert any(type(o) is weakref.ProxyType for o in gc.get_objects())  # the dead proxy is there
    with pytest.raises(ReferenceError):
        isinstance(proxy, str)  # what the flush used to do
    with open(tmp_path / "out.txt", "w") as fh:
        fh.write("kept")
        _flush_open_files()
        assert (tmp_path / "out.txt").read_text() == "kept"  # and it still flushes the files
