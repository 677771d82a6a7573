"""python -m onebit.advise: the model (exact maths), the command line (exit codes, bad
arguments), a run under torchrun on loopback, and the prediction on a shaped link against
an independent timing (bench/bench_advise.py; needs root and tc, as the CI machine has)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from zygote import launch

from onebit.advise.model import Affine, LinkModel, verdict
from onebit.collectives import padded_numel
from onebit.collectives.wire import compressed_bytes

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("seed", range(5))
def test_affine_fit_recovers_a_line_exactly(seed):
    rng = random.Random(seed)
    a, b = rng.uniform(1e-5, 1e-2), rng.uniform(1e-10, 1e-6)
    xs = [4**k for k in range(5, 5 + rng.randint(2, 8))]
    f = Affine.fit(xs, [a + b * x for x in xs])
    assert f.latency == pytest.approx(a, rel=1e-6) and f.per_unit == pytest.approx(b, rel=1e-9)


def test_affine_fit_keeps_coefficients_non_negative():
    # times that fall with size (noise on a latency-bound link): no negative slope
    f = Affine.fit([1, 10, 100], [3.0, 2.0, 1.0])
    assert f.per_unit == 0.0 and 1.0 < f.latency < 3.0
    # times below proportional: no negative latency
    g = Affine.fit([1e3, 1e6], [1e-9, 1e-3])
    assert g.latency == 0.0 and g.per_unit > 0
    assert Affine.fit([0], [0.5]) == Affine(0.5, 0.0)  # one point at zero: all latency
    with pytest.raises(ValueError, match="ts: expected at least one positive"):
        Affine.fit([1, 2], [0.0, float("nan")])


def _model(W=4, block=64, dense=(1e-3, 1e-9), codec=(1e-4, 2e-9), comm=(2e-3, 1e-9)) -> LinkModel:
    return LinkModel(W, block, Affine(*dense), Affine(*codec), Affine(*comm))


@pytest.mark.parametrize(("W", "block", "n"), [(4, 64, 1 << 22), (3, None, 1_000_003), (5, 16, 17)])
def test_link_model_is_the_documented_formula(W, block, n):
    m = _model(W, block)
    wire = compressed_bytes(padded_numel(n, W, block), W, block)
    assert m.wire(n) == wire
    assert m.float32_seconds(n) == pytest.approx(1e-3 + 1e-9 * 4 * n)
    assert m.onebit_seconds(n) == pytest.approx(1e-4 + 2e-9 * n + 2e-3 + 1e-9 * wire)
    dense, onebit = m.step_seconds(n, compute=0.05, overlap=0.25)
    assert dense == pytest.approx(0.05 + 0.75 * m.float32_seconds(n))
    assert onebit == pytest.approx(0.05 + m.codec(n) + 0.75 * m.comm(wire))


def test_break_even_is_where_the_speedup_crosses_one():
    m = _model()
    n = m.break_even()
    assert n is not None and m.speedup(n) >= 1.0 and m.speedup(int(n / 1.02)) < 1.0
    # compute dearer than the bytes saved: never faster
    assert _model(codec=(0.0, 1e-8)).break_even() is None
    # free compute, cheaper latency: faster from the first element
    assert _model(codec=(0.0, 0.0), comm=(1e-4, 1e-9)).break_even() == 1


def test_verdict_says_what_and_why():
    v, why = verdict(3.2, "the gradient all-reduce", "detail")
    assert v == "compress" and "3.20x faster" in why and "detail" in why
    v, why = verdict(0.5, "the training step", "detail")
    assert v == "do not compress" and "2.00x slower" in why
    assert verdict(1.04, "x", "d")[0] == "compress" and "small gain" in verdict(1.04, "x", "d")[1]
    assert verdict(0.96, "x", "d")[0] == "do not compress" and "break-even" in verdict(0.96, "x", "d")[1]


def _advise(*args: str, nproc: int | None = 4, timeout: int = 600):
    """``python -m onebit.advise`` alone, or on ``nproc`` ranks started as torchrun starts them
    (tests/zygote.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    if nproc:
        return launch("-monebit.advise", *args, nproc=nproc, cwd=ROOT, env=env, timeout=timeout)
    return subprocess.run([sys.executable, "-m", "onebit.advise", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize(("args", "message"), [
    (("--overlap", "1.5"), "--overlap: expected a fraction in [0, 1]"),
    (("--block", "12"), "--block: expected a positive multiple of 8 or 'none'"),
    (("--params", "0"), "--params: expected a positive count"),
    (("--step-ms", "5", "--measure-step", "x.py"), "not allowed with argument"),
])
def test_bad_arguments_exit_2_with_the_argument_named(args, message, capsys):
    # the command line's own parser, in this process (python -m onebit.advise runs main():
    # test_without_torchrun_it_says_how_to_start_it_and_exits_3 starts it so)
    from onebit.advise.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(list(args))
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and message in stderr, stderr


def test_without_torchrun_it_says_how_to_start_it_and_exits_3():
    run = _advise("--params", "1000", nproc=None)
    assert run.returncode == 3 and "start it with torchrun" in run.stderr


# beside the parallel tests: every assertion holds whatever the timings (the verdict follows
# the numbers the report shows)
def test_a_run_on_loopback_reports_and_decides(tmp_path):
    step = tmp_path / "step.py"
    step.write_text("import torch\nm = torch.nn.Linear(256, 256)\n\ndef step():\n"
                    "    m(torch.randn(64, 256)).sum().backward()\n")
    run = _advise("--params", "65536", "--per-node", "2", "--measure-step", str(step), "--overlap", "0.5",
                  "--json", "--exit-code", "--repeats", "2")
    assert run.returncode in (0, 1), run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["verdict"] in ("compress", "do not compress")
    assert run.returncode == (0 if report["verdict"] == "compress" else 1)  # --exit-code
    assert set(report["links"]) == {"flat", "intra", "inter"} and report["hierarchical"]["per_node"] == 2
    assert report["hierarchical"]["measured"] and report["hierarchical"]["seconds"] > 0  # timed at P
    flat = report["links"]["flat"]
    assert [r["n"] for r in flat["rows"]] == [1024, 4096, 16384, 65536]
    assert all(r["float32"] > 0 and r["onebit"] > 0 and r["encode"] > 0 for r in flat["rows"])
    at_p = flat["rows"][-1]
    assert report["predicted_speedup"] == pytest.approx(at_p["float32"] / at_p["onebit"])  # measured at P
    step_s = report["step"]
    assert step_s["compute_s"] > 0 and step_s["overlap"] == 0.5
    assert (report["verdict"] == "compress") == (report["predicted_step_speedup"] >= 1.0)
    # the table a person reads: the same numbers, in nccl-tests' columns
    text = _advise("--params", "4096", "--repeats", "1", "--quiet")
    assert text.returncode == 0, text.stderr[-3000:]
    assert "algbw" in text.stdout and "busbw" in text.stdout and "\nverdict: " in text.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="emulating a link needs root (network namespaces and tc)")
@pytest.mark.serial  # timings: alone, not beside the parallel tests
def test_the_prediction_holds_on_an_emulated_1_gbit_link():
    # the acceptance on one shaped link: W = 4, P = 2^22, within 35% of an independent
    # timing of dist.all_reduce against compressed_allreduce, and the verdict that timing implies
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_advise import TOLERANCE, validate

    r = validate("1gbit", 4, 1 << 22, "64", 3, shaped=True)
    assert r["relative_error"] <= TOLERANCE, r
    assert r["verdict"] == "compress" and r["measured_speedup"] > 1.1, r
