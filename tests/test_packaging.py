"""The distribution installs `onebit` only: no bare `kernels`, `collectives`, `optimizers`."""

from __future__ import annotations

import subprocess
import sys
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
                   "onebit/optimizers/__init__.py"):
        assert module in names, module
    assert not any(n.startswith(("onebit/tests", "onebit/bench", "onebit/examples")) for n in names)


def test_bare_names_are_not_importable_from_elsewhere(tmp_path):
    code = (
        "import importlib.util, onebit.kernels, onebit.collectives, onebit.optimizers\n"
        "for name in ('kernels', 'collectives', 'optimizers'):\n"
        "    spec = importlib.util.find_spec(name)\n"
        f"    assert spec is None or not str(spec.origin).startswith({str(ROOT)!r}), spec\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
