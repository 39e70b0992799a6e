"""The house's layering, read from the source: kernels are leaves, engine never imports the run schema,
the stages or the pipeline, stages read the run schema and never the orchestrator, and no import circle
exists among the project's modules (imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "engine", "schema", "stages", "pipeline")  # each may import the ones before it


def import_graph() -> dict[str, set[str]]:
    mods = {}
    for path in REPO.rglob("*.py"):
        rel = path.relative_to(REPO)
        if rel.parts[0] in LAYERS:
            name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
            mods[name] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].add(name)
    return graph


def test_no_module_imports_a_layer_above_it():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    up = sorted(
        (m, n) for m, deps in import_graph().items() for n in deps if rank[n.split(".")[0]] > rank[m.split(".")[0]]
    )
    assert not up, up


def test_no_import_circles():
    graph, seen, cycles = import_graph(), {}, []

    def visit(mod: str, path: list[str]) -> None:  # depth first; a grey node met again closes a circle
        seen[mod] = "grey"
        for dep in sorted(graph[mod]):
            if seen.get(dep) == "grey":
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep not in seen:
                visit(dep, path + [dep])
        seen[mod] = "black"

    for mod in sorted(graph):
        if mod not in seen:
            visit(mod, [mod])
    assert not cycles, cycles
