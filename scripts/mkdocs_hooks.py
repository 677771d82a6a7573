"""MkDocs hook: the package tree as installed, for mkdocstrings.

The repository keeps ``onebit.kernels``, ``onebit.collectives`` and ``onebit.optimizers`` in
the top-level folders ``kernels/``, ``collectives/`` and ``optimizers/`` (pyproject.toml's
package-dir), which mkdocstrings' static loader cannot map. Before every build this hook
makes ``build/api-src/onebit`` out of symbolic links (``onebit/*.py`` and the three folders),
the tree an installation has; mkdocs.yml points the Python handler at it. The tree is made
when MkDocs loads this file, before any plugin reads its configuration (mkdocstrings drops
search paths that do not exist yet).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "api-src" / "onebit"
SUBPACKAGES = ("kernels", "collectives", "optimizers")


def make_tree() -> None:
    TREE.mkdir(parents=True, exist_ok=True)
    wanted = {p.name: p for p in (ROOT / "onebit").glob("*.py")}
    wanted.update({name: ROOT / name for name in SUBPACKAGES})
    wanted["integrations"] = ROOT / "onebit" / "integrations"  # a folder of onebit/ itself
    for entry in TREE.iterdir():
        if entry.name not in wanted:
            entry.unlink()
    for name, target in wanted.items():
        link = TREE / name
        relative = os.path.relpath(target, TREE)  # relative links: the tree stays valid if the clone moves
        if link.is_symlink() and os.readlink(link) == relative:
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(relative, target_is_directory=target.is_dir())


make_tree()


def on_files(files, config):
    """Publish bench/RESULTS.md (today's numbers), bench/HISTORY.md (the dated record),
    bench/TRAFFIC.md (the memory-traffic model) and their
    plots as they are (pages link to ``bench/RESULTS.md``, ``bench/HISTORY.md`` and
    ``bench/results/...png``): the measured record stays next to the scripts that wrote it."""
    from mkdocs.structure.files import File

    pages = [ROOT / "bench" / name for name in ("RESULTS.md", "HISTORY.md", "TRAFFIC.md")]
    for path in [*pages, *sorted((ROOT / "bench" / "results").rglob("*.png"))]:
        files.append(File.generated(config, path.relative_to(ROOT).as_posix(), abs_src_path=str(path)))
    return files
