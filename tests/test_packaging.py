"""The distribution installs `onebit` only: no bare `kernels`, `collectives`, `optimizers`; no
`onebit.tests` / `onebit.bench`, even from an editable install; the sdist ships no tests."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_only_the_onebit_namespace(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path)],
        check=True, cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("onebit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"onebit", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    for module in ("onebit/__init__.py", "onebit/kernels/triton_kernels.py",
                   "onebit/kernels/torch_kernels.py", "onebit/kernels/reference.py",
                   "onebit/collectives/allreduce.py", "onebit/checkpoint.py",
                   "onebit/optimizers/__init__.py", "onebit/py.typed", "onebit/advise/__main__.py"):
        assert module in names, module
    # the advisor's console script (python -m onebit.advise under another name)
    (entry,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "onebit-advise = onebit.advise.__main__:main" in zipfile.ZipFile(wheel).read(entry).decode()
    assert not any(n.startswith(("onebit/tests", "onebit/bench", "onebit/examples")) for n in names)


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
