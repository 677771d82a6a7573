"""Test configuration: Triton interpreter on CPU-only machines, hypothesis profile, poisoning."""

from __future__ import annotations

import os

import pytest
import torch

# Must happen before anything imports onebit.kernels.triton_kernels (the decorator reads it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ranks():
    """``ranks(W)``: the session's pool of W gloo ranks (see dist_pool.RankPool)."""
    from dist_pool import RankPool

    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        pool = pools.get(world_size)
        if pool is None or not all(p.is_alive() for p in pool._procs):
            pool = pools[world_size] = RankPool(world_size)
        return pool

    yield get
    for pool in pools.values():
        pool.close()
