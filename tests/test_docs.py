"""The documentation: the MkDocs site builds with --strict (broken links, missing API pages
fail), its API reference lists every public name, and every complete script in the README
and in docs/ runs as written on 4 ranks started as torchrun starts them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT
from zygote import launch

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _scripts() -> list[tuple[str, int, str]]:
    """(page, index on the page, code) of every ```python block that is a complete
    distributed script (it calls init_process_group)."""
    found = []
    for page in PAGES:
        blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
        scripts = [b for b in blocks if "init_process_group(" in b]
        found += [(page.name, i, code) for i, code in enumerate(scripts)]
    return found


SCRIPTS = _scripts()


def test_the_readme_shows_three_scripts_and_stays_short():
    # the DDP hook, the 1-bit optimizer, DiLoCo; at most about 150 lines
    assert len([s for s in SCRIPTS if s[0] == "README.md"]) == 3
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


@pytest.mark.parametrize("page,index,code", SCRIPTS, ids=[f"{p}-{i}" for p, i, _ in SCRIPTS])
def test_script_runs(page, index, code, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(code)
    # 4 ranks started as torchrun starts them, forked from a process that imported torch once
    # (tests/zygote.py; the first script runs under torchrun itself)
    run = launch(script, nproc=4, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"),
                 timeout=300, real=(page, index) == SCRIPTS[0][:2])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compressed none" not in run.stderr, run.stderr[-3000:]  # every example compresses
    out = "\n".join(run.rank_stdout)
    lines = [line for line in out.splitlines() if re.match(r"^[0-3] ", line)]
    counts = [sum(line[0] == str(r) for line in lines) for r in range(4)]
    assert counts[0] > 0 and counts == [counts[0]] * 4, out  # every rank finished, alike
    for line in lines:
        if "'stage'" in line:  # a 1-bit optimizer: compressing by the end, nothing skipped
            assert "'stage': 'compression'" in line and "'skipped_steps': 0" in line, line
        for sent in re.findall(r"'bytes_compressed': (\d+)", line):  # a hook: it compressed
            assert int(sent) > 0, line
        for err in re.findall(r"relative error (\S+)", line):  # one 1-bit call: an estimate
            assert 0.0 < float(err) < 1.5, line
    if "hook-rank" in code:
        saved = sorted(p.name for p in tmp_path.glob("hook-rank*.pt"))
        assert saved == [f"hook-rank{r}.pt" for r in range(4)]


def test_mkdocs_builds_strict_with_every_public_name(tmp_path):
    site = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert run.returncode == 0, run.stderr[-5000:]
    html = (site / "api" / "index.html").read_text()
    import onebit.collectives
    import onebit.integrations.lightning
    import onebit.integrations.torchtitan
    import onebit.integrations.transformers
    import onebit.kernels
    import onebit.optimizers

    for module in (onebit.kernels, onebit.collectives, onebit.optimizers, onebit.integrations.transformers,
                   onebit.integrations.lightning, onebit.integrations.torchtitan):
        missing = [n for n in module.__all__ if f'id="{module.__name__}.{n}"' not in html]
        assert not missing, f"{module.__name__}: no API entry for {missing}"
    for page in ("optimizers", "migrating", "distributed", "speedup", "ALGORITHMS", "failures", "benchmarks",
                 "hf-trainer", "lightning", "sharded"):
        assert (site / page / "index.html").exists(), page
    assert (site / "bench" / "RESULTS" / "index.html").exists()
    # docstrings' Sphinx roles render as links or code, never as raw text (scripts/mkdocs_hooks.py)
    role = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>")
    raw = {str(p.relative_to(site)): len(role.findall(p.read_text())) for p in site.rglob("*.html")}
    assert not {k: v for k, v in raw.items() if v}, raw
    assert html.count('class="autorefs autorefs-internal"') >= 10  # the roles became links
    # the deprecated names come last, after every current one
    ids = re.findall(r'id="(onebit\.[\w.]+)"', html)
    deprecated = ["onebit.collectives.OnebitHookState", "onebit.collectives.onebit_hook",
                  "onebit.optimizers.onebit_comm_hook"]
    first = min(ids.index(d) for d in deprecated)
    after = [i for i in ids[first:] if not any(i == d or i.startswith(d + ".") for d in deprecated)]
    assert not after, after
