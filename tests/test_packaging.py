"""The distribution installs `onebit` only: no bare `kernels`, `collectives`, `optimizers`; no
`onebit.tests` / `onebit.bench`, even from an editable install; the sdist ships no tests. The native
CPU passes' C files are package data: an installed wheel builds them and runs the C path on 2 ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ("onebit/kernels/native/native.h", "onebit/kernels/native/codec.c",
          "onebit/kernels/native/rounding.c", "onebit/kernels/native/build.py",
          "onebit/kernels/fused/adam.c", "onebit/kernels/fused/zero_one.c", "onebit/kernels/fused/hook.c")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(out)],
        check=True, cwd=out,
    )
    (found,) = out.glob("onebit-*.whl")
    return found


def test_wheel_contains_only_the_onebit_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"onebit", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    for module in ("onebit/__init__.py", "onebit/kernels/triton_kernels.py",
                   "onebit/kernels/torch_kernels.py", "onebit/kernels/reference.py",
                   "onebit/collectives/allreduce.py", "onebit/checkpoint.py",
                   "onebit/optimizers/__init__.py", "onebit/py.typed", "onebit/advise/__main__.py",
                   *NATIVE):
        assert module in names, module
    # the advisor's console script (python -m onebit.advise under another name)
    (entry,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "onebit-advise = onebit.advise.__main__:main" in zipfile.ZipFile(wheel).read(entry).decode()
    assert not any(n.startswith(("onebit/tests", "onebit/bench", "onebit/examples")) for n in names)


_RANK = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    import onebit
    from onebit.collectives import compressed_allreduce, padded_numel
    from onebit.kernels import cpu_simd
    from onebit.kernels.native import build
    from onebit.kernels.reference import reference_allreduce

    target = sys.argv[3]
    assert onebit.__file__.startswith(target) and str(build.SOURCES[0]).startswith(target), onebit.__file__
    rank, W, n = int(sys.argv[1]), 2, (1 << 20) + 13
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=W)
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(W)]
    N = padded_numel(n, W)
    out = xs[rank].clone()
    compressed_allreduce(out, torch.zeros(N), torch.zeros(N // W))
    assert cpu_simd.available() and cpu_simd._state.get("lib") is not None  # the C passes ran
    ref = reference_allreduce(xs, [torch.zeros(N)] * W, [torch.zeros(N // W)] * W)
    torch.testing.assert_close(out, ref.output.float(), rtol=1e-5, atol=1e-6)
    dist.destroy_process_group()
    """)


def test_an_installed_wheel_builds_its_c_and_runs_it_on_two_ranks(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    str(wheel)], check=True, cwd=tmp_path)
    for path in NATIVE:
        assert (target / path).is_file(), path
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    env = dict(os.environ, PYTHONPATH=str(target), XDG_CACHE_HOME=str(tmp_path / "cache"),
               OMP_NUM_THREADS="1")
    env.pop("ONEBIT_BACKEND", None)
    args = [sys.executable, "-P", str(script)]
    ranks = [subprocess.Popen([*args, str(r), str(tmp_path / "store"), str(target)], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    for r in ranks:
        out, _ = r.communicate(timeout=300)
        assert r.returncode == 0, out[-3000:]
    assert list((tmp_path / "cache" / "onebit").glob("native-*.so"))  # built from the installed sources


def test_bare_names_are_not_importable_from_elsewhere(tmp_path):
    code = (
        "import importlib.util, onebit.kernels, onebit.collectives, onebit.optimizers\n"
        "for name in ('kernels', 'collectives', 'optimizers'):\n"
        "    spec = importlib.util.find_spec(name)\n"
        f"    assert spec is None or not str(spec.origin).startswith({str(ROOT)!r}), spec\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


def test_only_the_library_resolves_under_onebit(tmp_path):
    code = (
        "import importlib.util, onebit\n"
        "for name in ('onebit.kernels', 'onebit.collectives', 'onebit.optimizers', 'onebit.checkpoint'):\n"
        "    assert importlib.util.find_spec(name) is not None, name\n"
        "for name in ('onebit.tests', 'onebit.bench', 'onebit.examples', 'onebit.scripts', 'onebit.docs'):\n"
        "    assert importlib.util.find_spec(name) is None, name\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


def test_a_bare_import_from_the_root_fails_instead_of_loading_a_second_copy():
    for name in ("kernels", "collectives", "optimizers"):
        run = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True,
                             text=True)
        assert run.returncode != 0 and f"ImportError: {name}: this folder is the package onebit.{name}" \
            in run.stderr, (name, run.stderr[-500:])


def test_sdist_ships_the_library_and_its_spec_but_no_tests(tmp_path):
    code = (f"import sys; from setuptools import build_meta; "
            f"print(build_meta.build_sdist({str(tmp_path)!r}))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)
    (sdist,) = tmp_path.glob("onebit-*.tar.gz")
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    for path in ("onebit/__init__.py", "kernels/triton_kernels.py", "collectives/allreduce.py",
                 "optimizers/onebit_adam.py", "docs/ALGORITHMS.md", "README.md", "pyproject.toml"):
        assert path in names, path
    assert not any(n.startswith(("tests/", "bench/", "examples/")) for n in names), sorted(names)


def test_the_main_names_are_re_exported_from_onebit():
    import onebit
    import onebit.collectives
    import onebit.optimizers
    import onebit.teardown

    for name in onebit.__all__:
        obj = getattr(onebit, name)
        home = (getattr(onebit.optimizers, name, None) or getattr(onebit.collectives, name, None)
                or getattr(onebit.teardown, name, None))
        assert obj is home or name == "checkpoint", name
    assert onebit.OnebitAdam is onebit.optimizers.OnebitAdam
    assert onebit.onebit_compress_hook is onebit.collectives.onebit_compress_hook
