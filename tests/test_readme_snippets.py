"""README "Using onebit with DDP / FSDP2 / your own optimizer": every snippet runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT

SECTION = "## Using onebit with DDP / FSDP2 / your own optimizer"


def _snippets() -> list[str]:
    text = (ROOT / "README.md").read_text()
    body = text[text.index(SECTION):]
    body = body[: body.index("\n## ", len(SECTION))]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def _run(code: str, cwd) -> str:
    script = cwd / "snippet.py"
    script.write_text(code)
    # each rank's stdout to a file of its own (printed together, the ranks' lines interleave)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "--log-dir", str(cwd / "logs"), "--redirects", "1", str(script)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    return "\n".join(p.read_text() for p in sorted((cwd / "logs").rglob("stdout.log")))


def test_the_section_has_three_snippets():
    assert len(_snippets()) == 3


@pytest.mark.parametrize("which", ["ddp", "overlap", "fsdp2"])
def test_readme_snippet_runs(which, tmp_path):
    code = _snippets()[["ddp", "overlap", "fsdp2"].index(which)]
    out = _run(code, tmp_path)
    lines = [line for line in out.splitlines() if re.match(r"^[0-3] \{", line)]
    assert sorted(line[0] for line in lines) == ["0", "1", "2", "3"], out
    for line in lines:
        if which == "overlap":
            assert "'stage': 'compression'" in line and "'skipped_steps': 0" in line, line
        else:
            sent = [int(n) for n in re.findall(r"'bytes_compressed': (\d+)", line)]
            assert sent and all(n > 0 for n in sent), line
    if which == "ddp":
        saved = sorted(p.name for p in tmp_path.glob("hook-rank*.pt"))
        assert saved == [f"hook-rank{r}.pt" for r in range(4)]
