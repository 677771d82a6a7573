"""The package's shape: one-way layers (kernels -> collectives -> optimizers -> the top level:
checkpoint, integrations, advise) and no import cycle, function-level imports included
(onebit/__init__.py's docstring maps the layers)."""

from __future__ import annotations

import ast

from helpers import ROOT

LAYERS = {"kernels": 0, "collectives": 1, "optimizers": 2}  # everything else under onebit: 3
FOLDERS = {name: ROOT / name for name in LAYERS}  # the layer folders live at the repository root


def _modules() -> dict[str, object]:
    """onebit module name -> its file."""
    found = {}
    for package, folder in [("onebit", ROOT / "onebit")] + [(f"onebit.{k}", v) for k, v in FOLDERS.items()]:
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _is_package(name: str, modules) -> bool:
    return modules[name].name == "__init__.py"


def _imports(name: str, modules) -> set[str]:
    """Every onebit module ``name`` imports, at any depth of its code."""
    tree = ast.parse(modules[name].read_text())
    base = name.split(".") if _is_package(name, modules) else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                origin = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [origin] + [f"{origin}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target.startswith("onebit"):
                out.add(target)
    # a module's own packages are initialised before it runs: not a dependency
    return {t for t in out if t != name and not (name.startswith(t + ".") and _is_package(t, modules))}


def _layer(name: str) -> int:
    parts = name.split(".")
    return LAYERS.get(parts[1], 3) if len(parts) > 1 else 3


def test_no_import_from_a_higher_layer():
    modules = _modules()
    wrong = [f"{m} imports {t}" for m in modules for t in _imports(m, modules) if _layer(t) > _layer(m)]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycle():
    modules = _modules()
    graph = {m: _imports(m, modules) for m in modules}
    cycles, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_the_checker_sees_the_layers():
    modules = _modules()
    assert {"onebit.kernels.layout", "onebit.collectives.allreduce", "onebit.optimizers._base",
            "onebit.integrations.torchtitan", "onebit.checkpoint"} <= set(modules)
    assert "onebit.kernels.layout" in _imports("onebit.collectives.wire", modules)
    assert "onebit.optimizers._base" in _imports("onebit.optimizers.onebit_adam", modules)
