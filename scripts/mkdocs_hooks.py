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
import re
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


# Sphinx roles in docstrings (``:class:`Name```, ``:func:`~onebit.x.name```), which
# mkdocstrings renders as text followed by the code span: each becomes a cross-reference that
# autorefs resolves to the documented object (it fixes the links up after every page is
# rendered), or the plain code span where nothing documented carries that name.
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)([\w.]+)</code>")
_ANCHOR = re.compile(r'id="(onebit(?:\.\w+)+)"')


def _documented(html: str) -> dict[str, str | None]:
    """Each documented object's full name, and its last component (None where ambiguous)."""
    found: dict[str, str | None] = {}
    for full in set(_ANCHOR.findall(html)):
        found[full] = full
        short = full.rpartition(".")[2]
        found[short] = None if short in found and found[short] != full else full
    return found


def on_page_content(html, page, config, files):
    if ":<code>" not in html:
        return html
    documented = _documented(html)

    def link(match: re.Match) -> str:
        tilde, name = match.groups()
        shown = name.rpartition(".")[2] if tilde else name
        target = documented.get(name) or documented.get(name.rpartition(".")[2] if "." in name else "")
        if name.startswith("onebit.") and name not in documented:
            target = None  # a private or undocumented object: no guess by its last component
        if target is None:
            return f"<code>{shown}</code>"
        return f'<autoref identifier="{target}" optional><code>{shown}</code></autoref>'

    return _ROLE.sub(link, html)
