"""The house's layout as a rule: imports point down the layers and never go round in a circle.

The layers, from the bottom: ``variants`` (the attention variants, the oracle), ``integrations``
(where variants plug into other software), then ``experiments``' folders ``measure`` -> ``records`` ->
``report`` -> ``sweep``, then ``run.py``. A module may import its own folder and the layers below it;
every ``import`` statement counts, including those inside functions (a lazy import is still a
dependency). The graph is read from the source with :mod:`ast`, not by importing anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: layer of each top-level folder or experiments' sub-folder, bottom first
LAYERS = ["variants", "integrations", "experiments.measure", "experiments.records", "experiments.report"]
LAYERS += ["experiments.sweep", "run"]


def module_name(path: Path) -> str:
    """``experiments/measure/kernel.py`` -> ``experiments.measure.kernel`` (a package: its folder)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    """Every module of the layered code, by dotted name."""
    files = [ROOT / "run.py"]
    for top in ("variants", "integrations", "experiments"):
        files += sorted((ROOT / top).rglob("*.py"))
    return {module_name(f): f for f in files}


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` (at ``path``) imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            stem = ".".join([*base, *([node.module] if node.module else [])])
            # `from pkg import sub` names a module when pkg/sub.py exists, else a name inside pkg
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` depends on the deepest module that exists
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def layer(name: str) -> int:
    """The index in :data:`LAYERS` of the deepest layer ``name`` belongs to."""
    best = [i for i, lay in enumerate(LAYERS) if name == lay or name.startswith(lay + ".")]
    return max(best) if best else -1


def graph() -> dict[str, set[str]]:
    known = project_modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_graph_reads_every_kind_of_import():
    """The reader itself, on modules whose imports are known: a relative import, a lazy import inside a
    function, and ``from package import submodule``."""
    edges = graph()
    assert "experiments.measure.spec" in edges["experiments.measure.kernel"]  # from .spec import ...
    assert "experiments.measure.kernel" in edges["experiments.sweep.runner"]  # inside run_job
    assert "experiments.measure.pretrained.corpus" in edges["experiments.measure.pretrained.job"]  # from .
    assert "variants.registry" in edges["integrations.transformers_backend"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_climbs_back_up_a_layer():
    up = [
        f"{a} imports {b}"
        for a, targets in graph().items()
        for b in sorted(targets)
        if layer(b) > layer(a) and not (b == "experiments" or a == "experiments")
    ]
    assert not up, "imports that climb back up the layers " + " -> ".join(LAYERS) + ":\n" + "\n".join(up)


def test_no_import_circle():
    found = cycles(graph())
    assert not found, "import circles (every import counts, lazy ones too):\n" + "\n".join(
        " <-> ".join(c) for c in found
    )
