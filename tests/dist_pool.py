"""A pool of W gloo ranks that run test bodies on request.

The ranks are forked from a forkserver that imported torch and onebit once (Python 3.11's
forkserver preloads without the parent's ``sys.path``: the tests' own modules are imported by each
rank): a spawned rank would import them itself (3-5 s of CPU each), which made a pool that the LRU
bound in conftest.py closed and reopened cost seconds per test. Each world size's pool is
reused for the test session. Rendezvous through a ``file://`` in a fresh temp dir (no port).
A body is a module-level function ``fn(*args)`` run on every rank; its return values come
back as a list indexed by rank. An exception on any rank fails the call with that rank's
traceback; a rank silent for ``timeout`` seconds fails it too and the pool is torn down.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import shutil
import tempfile
import traceback

import torch.multiprocessing as mp

_CTX = mp.get_context("forkserver")
# (torch._dynamo: every optimizer's constructor imports it, 1 s of CPU per rank)
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "onebit"])


def _rank_main(rank: int, world_size: int, init_file: str, tasks, results) -> None:
    import fast_interpreter
    import torch
    import torch.distributed as dist

    fast_interpreter.install()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        while (item := tasks.get()) is not None:
            fn, args = pickle.loads(item)
            try:
                results.put((rank, True, pickle.dumps(fn(*args))))
            except BaseException:  # noqa: BLE001 - reported to the test, which fails
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int, timeout: float = 300.0) -> None:
        self.world_size, self.timeout = world_size, timeout
        ctx = _CTX
        self._dir = tempfile.mkdtemp(prefix="onebit-pool-")
        init_file = os.path.join(self._dir, "rendezvous")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_rank_main, args=(r, world_size, init_file, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args) -> list:
        payload = pickle.dumps((fn, args))
        for q in self._tasks:
            q.put(payload)
        out: list = [None] * self.world_size
        failures = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=self.timeout)
            except queue.Empty:
                self.close(kill=True)
                raise TimeoutError(
                    f"{fn.__name__}: a rank gave no answer within {self.timeout} s"
                ) from None
            if ok:
                out[rank] = pickle.loads(value)
            else:
                failures.append((rank, value))
        if failures:
            rank, tb = min(failures)
            raise AssertionError(f"{fn.__name__} failed on rank {rank}:\n{tb}")
        return out

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self._procs, self._tasks, strict=True):
            if kill:
                p.kill()
            elif p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self._dir, ignore_errors=True)
