"""The one selection of a backend (onebit.kernels.backends): the default order per device, forcing
by context and by environment (per step too), what a forced backend cannot do, and that no module
switch of the former kind is left for a test to set."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from helpers import ROOT

from onebit.kernels import backends, cpu_simd
from onebit.kernels.backends import STEPS, select, use_backend

needs_c = pytest.mark.skipif("not cpu_simd.available()", reason="no C library here")


@pytest.fixture(autouse=True)
def _unforced(monkeypatch):
    """These tests read the selection as it is without a forcing variable: a run of the suite with
    ONEBIT_BACKEND set (the C capped at AVX2, say) leaves it out here (the tests that set it, set it)."""
    monkeypatch.delenv("ONEBIT_BACKEND", raising=False)


def test_every_backend_says_what_it_implements():
    assert set(backends.BACKENDS) == {"plain", "native", "triton"}
    assert backends.BACKENDS["plain"].steps == frozenset(STEPS)  # every step has a plain path
    for b in backends.BACKENDS.values():
        assert b.steps <= frozenset(STEPS) and "codec" in b.steps and b.what
    assert not backends.BACKENDS["native"].implements("local")  # ZeroOneAdam's one-launch local step
    assert not backends.BACKENDS["triton"].implements("tensor")


@needs_c
def test_the_default_on_cpu_is_native_for_what_it_implements():
    for step in STEPS:
        want = "native" if backends.BACKENDS["native"].implements(step) else "plain"
        assert select("cpu", step).name == want, step
    assert select("meta").name == "plain"  # a device no backend takes by default


def test_use_backend_forces_nests_and_restores():
    with use_backend("plain"):
        assert all(select("cpu", step).name == "plain" for step in STEPS)
        with use_backend("native", steps=["codec"]) if cpu_simd.available() else use_backend("plain"):
            assert select("cpu", "codec").name == ("native" if cpu_simd.available() else "plain")
            assert select("cpu", "adam").name == "plain"  # the outer block still covers it
        assert select("cpu", "codec").name == "plain"
    assert backends.forced() is None


def test_a_forced_backend_runs_plain_where_it_does_not_implement_the_step():
    with use_backend("triton"):  # the interpreter is on in the tests (conftest)
        assert select("cpu", "adam").name == "triton"
        assert select("cpu", "tensor").name == "plain"


def test_a_forced_backend_that_cannot_run_on_the_device_says_who_forced_it(monkeypatch):
    with use_backend("native"), pytest.raises(RuntimeError, match=r"use_backend\('native'\): the native "
                                                                   r"backend .* cannot run on cuda tensors"):
        select("cuda", "codec")
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("ONEBIT_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="ONEBIT_BACKEND=triton: the triton backend .* cpu tensors"):
        select("cpu", "codec")


def test_forcing_is_per_thread():
    seen = []
    with use_backend("plain"):
        t = threading.Thread(target=lambda: seen.append(backends.forced()))
        t.start()
        t.join()
    assert seen == [None]


def test_bad_names_name_the_argument():
    with pytest.raises(ValueError, match="name: expected one of plain, native, triton .*got 'gpu'"):
        with use_backend("gpu"):
            pass
    with pytest.raises(ValueError, match="steps: expected names from codec, adam"):
        with use_backend("plain", steps=["adamw"]):
            pass
    with pytest.raises(ValueError, match="step: expected one of codec"):
        select("cpu", "sgd")


def test_the_deprecated_switches_keep_cpu_tensors_plain_with_a_warning(monkeypatch):
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.setenv("ONEBIT_CPU_SIMD", "off")
    with pytest.warns(FutureWarning, match="ONEBIT_CPU_SIMD=off is deprecated: set ONEBIT_BACKEND=plain"):
        assert select("cpu", "codec").name == "plain"


def test_no_test_sets_a_module_switch():
    """Tests choose a backend with use_backend (or ONEBIT_BACKEND), never by setting a module's
    switch: the former switches are gone from the library and from the tests."""
    gone = re.compile(r"\b(_fused|_hook_fused|_hook_triton|_multi)\.(ENABLED|ON_CPU)\b|^(ENABLED|ON_CPU) = "
                      r"|\b(api|cpu_fused|cpu_compiled)\.MIN_NUMEL\s*=[^=]|ONEBIT_NATIVE_ISA"
                      r"|^OWN_STEP = ", re.M)
    # the routes inside a backend: chosen with use_routes, never by setting a class or module attribute
    routes = re.compile(r"\.(STAGE|MESSAGE|KEEP_MESSAGE|OWN_STEP|BFLOAT16_ERRORS)(, [\w.]+)* = "
                        r"|setattr\([\w.]+, \"(STAGE|MESSAGE|KEEP_MESSAGE|OWN_STEP|BFLOAT16_ERRORS)\"")
    for folder in ("kernels", "collectives", "optimizers", "tests", "bench", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            if path.name == "test_backends.py":
                continue
            assert not gone.search(text), f"{path}: {gone.search(text).group(0)}"
            if folder in ("tests", "bench", "scripts"):
                assert not routes.search(text), f"{path}: {routes.search(text).group(0)}"


def test_the_codec_follows_the_selection():
    from onebit.kernels import decompress, server_reduce, worker_compress  # noqa: F401
    from onebit.kernels.layout import Layout

    x = torch.randn(1000)
    e = torch.zeros(1008)
    with use_backend("plain"):
        plain = worker_compress(x, e.clone(), 3)
    ref = worker_compress(x, e.clone(), 3, backend="torch")
    assert torch.equal(plain, ref)
    assert Layout(1008, 3).message_bytes == plain.numel()


def test_use_routes_turns_a_route_off_inside_the_block_and_checks_its_names():
    from onebit.kernels.backends import ROUTES, route, use_routes

    assert all(route(name) for name in ROUTES)  # each on by default
    with use_routes(stage=False, message=False):
        assert not route("stage") and not route("message") and route("own_step")
        with use_routes(stage=True):
            assert route("stage") and not route("message")
        assert not route("stage")
    assert route("stage") and route("message")
    with pytest.raises(ValueError, match="stages: expected a route from stage"):
        with use_routes(stages=False):
            pass
    with pytest.raises(TypeError, match="message: expected a bool"):
        with use_routes(message=0):
            pass
    with pytest.raises(ValueError, match="name: expected a route"):
        route("fast")
    with pytest.raises(RuntimeError), use_routes(errors_in_pass=False):  # put back on the way out
        raise RuntimeError
    assert route("errors_in_pass")
