"""The soak of bench/bench_soak.py: 2,000 compressed_allreduce calls on W = 4 gloo ranks with
random sizes, dtypes, groups, check mode and injected NaNs. Bitwise-identical results on
every member, resident memory flat after warm-up (growth <= 16 MB; measured 5 to 8 MB, see
bench/RESULTS.md), the same thread and process-group counts after the calls as before."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow


def test_soak_2000_calls_world_size_4(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_soak.py"), "--calls", "2000", "--world-size", "4",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["mismatched_calls"] == 0
    assert min(summary["calls_per_rank"]) > 1000 and min(summary["nan_calls_per_rank"]) > 5
    assert max(summary["rss_growth_mb"]) <= 16.0
    assert all(a == b for a, b in summary["threads_before_after"])
    assert all(a == b for a, b in summary["process_groups_before_after"])
