"""The test suite's launcher: starts the W ranks of a script the way ``torchrun --standalone``
does (RANK, WORLD_SIZE, MASTER_ADDR/PORT, the TORCHELASTIC_* variables), but by fork from a
process that has already imported torch, onebit and the frameworks. A launch then costs
milliseconds instead of W + 1 interpreters importing torch (2 s of CPU each, 6-8 s with the
Hugging Face Trainer or Lightning): on the 2-core CI machine most of a short script's time.

The scripts run as written: ``runpy`` as ``__main__`` with the script's folder first on sys.path,
in their own working directory and environment, and at their end the interpreter's exit steps
(non-daemon threads joined, atexit handlers, streams flushed). What differs from torchrun is the
launcher only: the first failing rank stops the others (SIGTERM, then SIGKILL after 5 s) and the
launch reports exit status 1. ``launch(..., real=True)`` runs torchrun itself (the README's first
script, the demo's command line); the killed and hung ranks of test_rank_failure stay plain
processes, since a launcher would stop the survivors itself.

Run as a script, this file is the forking server: one JSON request per stdin line, two JSON
replies on stdout (the launch's process group, then its exit status)."""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# What every launched script imports anyway (ImportError: an optional package not installed);
# importing starts no thread, so the forks stay safe
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "numpy", "onebit",
           "onebit.integrations.transformers", "transformers", "accelerate", "pytorch_lightning",
           "onebit.integrations.lightning")
# Read by the packages at import time: the zygote imports them under the values every test uses.
IMPORT_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


@dataclass
class Launch:
    returncode: int
    stdout: str  # the ranks' stdout, rank 0 first
    stderr: str  # the ranks' stderr, rank 0 first, then the launcher's own lines
    rank_stdout: list[str]


# -- the client, in the pytest process ---------------------------------------------------------
class _Client:
    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(IMPORT_ENV)
        self.dir = tempfile.mkdtemp(prefix="onebit-zygote-")
        # started outside the repository (transformers probes for a top-level `kernels` folder)
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=self.dir)
        self._read(300)  # {"ready": ...}

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0.0))
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the test launcher's zygote exited (status {self.proc.poll()})")
        return json.loads(line)

    def launch(self, request: dict, timeout: float) -> int:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        group = self._read(60)["group"]
        try:
            return self._read(timeout)["rc"]
        except TimeoutError:
            os.killpg(group, signal.SIGKILL)
            self._read(60)
            raise subprocess.TimeoutExpired(request["argv"], timeout) from None

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)  # every launch's rank logs


_client: _Client | None = None


def run_ranks(script, *args: str, nproc: int, cwd, env: dict | None = None, timeout: float = 600) -> Launch:
    """Run ``script args`` on ``nproc`` local ranks as torchrun --standalone would; wait for all.
    ``script`` "-mNAME" runs the module NAME as ``python -m NAME`` does."""
    global _client
    if _client is None or _client.proc.poll() is not None:
        _client = _Client()
        atexit.register(_client.close)
    logs = Path(tempfile.mkdtemp(prefix="ranks-", dir=_client.dir))
    env = dict(os.environ if env is None else env)
    env.pop("TRITON_INTERPRET", None)
    request = dict(argv=[str(script), *map(str, args)], nproc=nproc, cwd=str(cwd), env=env, logs=str(logs))
    rc = _client.launch(request, timeout)
    # (a rank the launcher stopped before it started, after another failed, wrote no log)
    outs = [_text(logs / f"{r}.out") for r in range(nproc)]
    errs = [_text(logs / f"{r}.err") for r in range(nproc)]
    agent = logs / "agent.err"
    errs.append(agent.read_text() if agent.exists() else "")
    shutil.rmtree(logs, ignore_errors=True)
    return Launch(rc, "".join(outs), "".join(errs), outs)


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def launch(script, *args: str, nproc: int, cwd, env: dict | None = None, timeout: float = 600,
           real: bool = False) -> Launch:
    """:func:`run_ranks`, or with ``real`` torchrun itself (each rank's stdout to a file of its
    own: printed together, the ranks' lines interleave)."""
    if not real:
        return run_ranks(script, *args, nproc=nproc, cwd=cwd, env=env, timeout=timeout)
    env = dict(os.environ if env is None else env)
    env.pop("TRITON_INTERPRET", None)
    with tempfile.TemporaryDirectory(prefix="torchrun-") as d:
        logs = Path(d)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "--log-dir", str(logs), "--redirects", "1", str(script), *map(str, args)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
        outs = [next(logs.rglob(f"attempt_0/{r}/stdout.log")).read_text() for r in range(nproc)]
    return Launch(run.returncode, run.stdout + "".join(outs), run.stderr, outs)


# -- the server ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(request: dict, rank: int, port: int) -> None:
    """The child for one rank: never returns."""
    import atexit as exits
    import runpy
    import traceback

    code = 1
    try:
        logs = request["logs"]
        for fd, name in ((1, f"{rank}.out"), (2, f"{rank}.err")):
            os.dup2(os.open(os.path.join(logs, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        n = request["nproc"]
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                          ROLE_NAME="default", WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                          GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="zygote",
                          TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                          TORCHELASTIC_USE_AGENT_STORE="False")
        os.chdir(request["cwd"])
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        # what the script's globals hold lives until the exit steps ran, as in an interpreter
        # (an atexit handler may look for live objects): its namespace, or the exception
        # whose traceback holds its frames
        keep = None
        try:
            if script.startswith("-m"):  # `python -m module`: the working directory first on sys.path
                sys.path[0] = os.getcwd()
                sys.argv[0] = script[2:]
                keep = runpy.run_module(script[2:], run_name="__main__", alter_sys=True)
            else:
                sys.path[0] = os.path.dirname(os.path.abspath(script))
                keep = runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stop:
            keep = stop
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
        except BaseException as exc:  # noqa: BLE001 - the rank's traceback, as the interpreter prints it
            keep = exc
            traceback.print_exc()
        threading._shutdown()  # what the interpreter does at exit: join non-daemon threads,
        exits._run_exitfuncs()  # then run the atexit handlers
        del keep
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - a closed stream: nothing left to flush
                pass
        os._exit(code)


def _agent(request: dict) -> int:
    """The child for one launch (its own process group): forks the ranks, waits for them."""
    err = open(os.path.join(request["logs"], "agent.err"), "w")  # noqa: SIM115
    port = _free_port()
    ranks = {}
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            _rank(request, rank, port)
        ranks[pid] = rank
    failed, stop_at = None, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if stop_at is not None and time.monotonic() > stop_at:
                for other in ranks:
                    os.kill(other, signal.SIGKILL)
                stop_at = None
            time.sleep(0.02)
            continue
        code = os.waitstatus_to_exitcode(status)
        rank = ranks.pop(pid)
        if code != 0 and failed is None:
            failed = rank
            print(f"zygote launch: rank {rank} exited with status {code}; stopping the others", file=err)
            for other in ranks:
                os.kill(other, signal.SIGTERM)
            stop_at = time.monotonic() + 5.0
    err.close()
    return 0 if failed is None else 1


def _serve() -> None:
    os.environ.update(IMPORT_ENV)
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    try:  # the native C library, built (or found in its cache) once here, loaded by every fork
        from onebit.kernels import cpu_simd

        cpu_simd.available()
    except Exception:  # noqa: BLE001 - no compiler: each rank finds out as it would alone
        pass
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    protocol = sys.stdout
    print(json.dumps({"ready": True, "threads": threads}), file=protocol, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1):  # the children never touch the protocol's pipes
                os.dup2(devnull, fd)
            code = 1
            try:
                code = _agent(request)
            finally:
                os._exit(code)
        print(json.dumps({"group": pid}), file=protocol, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=protocol, flush=True)


if __name__ == "__main__":
    _serve()
