"""The package's import graph, lazy imports inside functions included, has no cycle (config sits at the bottom),
and the imbalance spec is parsed once."""

from __future__ import annotations

import ast

import pytest

from conftest import REPO
from crossbow_mpi import Config, Trainer, imbalance, trainer
from crossbow_mpi.imbalance import parse_imbalance

PACKAGE = REPO / "crossbow_mpi"


def import_graph() -> dict[str, set[str]]:
    """Map each module of the package to the package modules it imports anywhere in its source."""
    modules = {".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): path
               for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: `from .x import y` in package p is p.x
                    parents = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parents + ([base] if base else []))
                imported |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                             for alias in node.names}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert "crossbow_mpi.config" in graph and graph["crossbow_mpi.imbalance"] == {"crossbow_mpi.config"}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(m == goal or (m not in seen and not seen.add(m) and reaches(m, goal, seen)) for m in graph[start])

    cycles = sorted(name for name in graph if reaches(name, name, set()))
    assert not cycles, f"modules in an import cycle: {cycles}"


@pytest.mark.mpi(min_size=1)
def test_the_imbalance_spec_is_parsed_once_where_the_job_size_is_known(comm, monkeypatch):
    calls = []

    def counting(spec, seed, world_size=None):
        calls.append(world_size)
        return parse_imbalance(spec, seed, world_size)

    monkeypatch.setattr(imbalance, "parse_imbalance", counting)
    monkeypatch.setattr(trainer, "parse_imbalance", counting)
    assert Trainer(Config(inject_imbalance="random:1"), comm).imbalance.milliseconds == 1.0
    assert calls == [comm.size]
