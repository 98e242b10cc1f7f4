"""The library's import graph: no cycle, and no module imports a higher layer.

Layers, from the top: the command lines → training/ and control/ → algorithms/, transports/ and planner/ →
replicas/, comm/, parallel/ and runtime/ → data/, models and config. Every import counts, including those inside
functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "crossbow_mpi"
LAYERS = {
    4: ["train", "export", "report", "plan"],
    3: ["training", "control"],
    2: ["algorithms", "transports", "planner"],
    1: ["replicas", "comm", "parallel", "runtime"],
    0: ["data", "models", "config", "tensor_bytes"],
}
"""Each top-level module or folder of crossbow_mpi by layer: the folder list is the architecture."""


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules) -> set[str]:
    """Return the crossbow_mpi modules a file imports anywhere in it (`from P import m` imports module P.m)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from .x import y` in package p is p.x
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parents + ([base] if base else []))
            names = {f"{base}.{alias.name}" for alias in node.names}
            found |= (names & set(modules)) or {base}
    return {name for name in found if name.startswith("crossbow_mpi.")}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports(path, modules) if m in modules and m != name} for name, path in modules.items()}


def layer(module: str) -> int:
    if module == "crossbow_mpi":
        return max(LAYERS)  # the package's API re-exports the trainer
    top = module.split(".")[1]
    for level, names in LAYERS.items():
        if top in names:
            return level
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a, targets in graph().items()
        for b in targets
        if layer(b) > layer(a)
    ]
    assert not upward, upward


def test_the_import_graph_has_no_cycle():
    edges = graph()
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                raise AssertionError("import cycle: " + " → ".join([*path[path.index(target) :], target]))
            if target not in state:
                visit(target, [*path, target])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
