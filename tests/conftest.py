"""Test configuration: Triton interpreter on CPU-only machines, hypothesis profile, poisoning."""

from __future__ import annotations

import os

import pytest
import torch

# Must happen before anything imports onebit.kernels.triton_kernels (the decorator reads it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fast_interpreter  # noqa: E402

fast_interpreter.install()  # the interpreter without its repeated patching (the ranks: dist_pool.py)

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "onebit",
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile("ci", parent=settings.get_profile("onebit"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "onebit")


@pytest.fixture
def poison(monkeypatch):
    """Make torch.empty return garbage (NaN, or 0xA5 bytes) so an unwritten element shows up."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype == torch.uint8:
            t.fill_(0xA5)
        return t

    monkeypatch.setattr(torch, "empty", poisoned)
    yield


# Modules whose tests start processes of their own (torchrun, torchft replicas, the demo, the
# benchmarks) or several ranks: the full suite's tier. `scripts/test.sh --quick` runs the rest.
PROCESS_MODULES = {"test_advise", "test_bench_smoke", "test_compile_check", "test_demo", "test_docs",
                   "test_packaging", "test_rank_failure", "test_soak", "test_torchft", "test_trainers"}


def _starts_processes(item) -> bool:
    """The test's own code imports subprocess, spawns, or starts ranks (tests/zygote.py's
    ``launch``, a module's ``_torchrun`` helper): several ranks, torchrun, replicas."""
    import inspect

    try:
        source = inspect.getsource(item.function)
    except (OSError, TypeError):
        return False
    return any(word in source for word in ("subprocess", "spawn(", "launch(", "_torchrun("))


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    order = {}
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        ranks = "ranks" in getattr(item, "fixturenames", ())
        launches = module in PROCESS_MODULES or _starts_processes(item)
        if launches or ranks:
            item.add_marker(slow)  # several processes: not in the quick tier
        order[item.nodeid] = 0 if launches else 1 if ranks else 2
    # the tests that start processes (the longest) first, so that the two test processes of the
    # full run end together instead of one finishing a long launch alone
    items.sort(key=lambda item: order[item.nodeid])
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


MAX_POOLS = 3  # world sizes kept alive per test process; the least recently used closes first


@pytest.fixture(scope="session")
def ranks():
    """``ranks(W)``: the session's pool of W gloo ranks (see dist_pool.RankPool)."""
    from dist_pool import RankPool

    pools: dict[int, RankPool] = {}  # in order of last use

    def get(world_size: int) -> RankPool:
        pool = pools.pop(world_size, None)
        if pool is None or not all(p.is_alive() for p in pool._procs):
            pool = RankPool(world_size)
        pools[world_size] = pool
        while len(pools) > MAX_POOLS:  # bound the live ranks (two test processes share the memory)
            pools.pop(next(iter(pools))).close()
        return pool

    yield get
    for pool in pools.values():
        pool.close()
