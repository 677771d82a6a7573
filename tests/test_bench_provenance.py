"""A benchmark row names the commit of the onebit code that ran (bench/_common.py ``git_commit``):
this checkout's, or where onebit is imported from elsewhere, that place, never this checkout's commit."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _common():
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "bench" / "_common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_onebit_from_this_checkout_names_its_commit(monkeypatch):
    common = _common()
    monkeypatch.setattr(common, "_onebit_root", lambda: str(ROOT))
    got = common.git_commit()
    if not (ROOT / ".git").exists():  # (a copy without git: nothing to name)
        assert got == ""
        return
    assert got.removesuffix("+dirty") == _git(ROOT, "rev-parse", "--short", "HEAD")


def test_onebit_from_another_checkout_names_that_one(monkeypatch, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "init", "-q", str(other)], check=True, env=env)
    (other / "f").write_text("1")
    subprocess.run(["git", "-C", str(other), "add", "f"], check=True, env=env)
    subprocess.run(["git", "-C", str(other), "commit", "-q", "-m", "x"], check=True, env=env)
    common = _common()
    monkeypatch.setattr(common, "_onebit_root", lambda: str(other))
    head = _git(other, "rev-parse", "--short", "HEAD")
    assert common.git_commit() == f"{head} (onebit at {other})"
    (other / "f").write_text("2")
    assert common.git_commit() == f"{head}+dirty (onebit at {other})"


def test_an_installed_package_inside_a_checkout_is_not_that_checkout(monkeypatch, tmp_path):
    """A wheel's folder under a checkout (a venv inside it) is not the checkout's code."""
    inside = ROOT / "bench"  # a folder of this checkout that is not its root
    common = _common()
    monkeypatch.setattr(common, "_onebit_root", lambda: str(inside))
    got = common.git_commit()
    assert got.startswith("onebit ") and got.endswith(f" at {inside}"), got
    outside = tmp_path / "site-packages" / "onebit"
    outside.mkdir(parents=True)
    monkeypatch.setattr(common, "_onebit_root", lambda: str(outside))
    got = common.git_commit()
    assert got.startswith("onebit ") and got.endswith(f" at {outside}"), got
