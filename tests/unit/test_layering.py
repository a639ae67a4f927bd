"""House rules on what imports what.

- The scheduler and the KV layer import no torch and no model code.
- The model's spec and family registry are torch-free (the KV side reads per-layer facts
  from them without importing a model).
- ``kvserve plan`` (server/plan.py) imports no torch and no model code.
- No import cycles anywhere in engine/, server/ or loadtest/: every import counts, at
  module level, inside functions and under ``TYPE_CHECKING`` alike (a cycle hidden in a
  function or a type annotation is still a cycle in the design). The graph is read from
  the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "server", "loadtest")
# Cycles tolerated for now, each to be broken by its module's owner; none may grow. Empty:
# the last ones were broken by moving the shared piece down -- engine.logprobs (under
# engine.request and engine.outputs), server.responses.state (under the routes' context
# and the Responses jobs), server.cli_flags (under server.cli and server.plan).
KNOWN_CYCLES: tuple[tuple[str, ...], ...] = ()


def test_scheduler_and_kv_layer_import_no_torch_or_model_code() -> None:
    probe = (
        "import sys, engine.scheduler, engine.kv.manager, engine.kv.stats, engine.kv.budget,"
        " engine.kv.block_map;"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'engine.model',"
        " 'engine.runner', 'transformers'))];"
        "print(','.join(bad))"
    )
    assert _loaded_by(probe) == ""


def test_model_spec_and_registry_import_no_torch() -> None:
    probe = (
        "import sys, engine.model.spec, engine.model.registry;"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'transformers',"
        " 'engine.model.layers', 'engine.model.kernels', 'engine.model.families'))];"
        "print(','.join(bad))"
    )
    assert _loaded_by(probe) == ""


def test_plan_command_imports_no_torch() -> None:
    """``kvserve plan`` sizes a deployment on a machine without torch's weight: of the
    model code it reads only the torch-free byte layout of quantized weights."""
    probe = (
        "import sys, server.plan;"
        "allowed = ('engine.model', 'engine.model.weight_format');"
        "bad = [m for m in sys.modules if m not in allowed and (m == 'torch' or m.startswith("
        "('torch.', 'engine.model', 'engine.builder', 'transformers')))];"
        "print(','.join(bad))"
    )
    assert _loaded_by(probe) == ""


def test_no_import_cycles() -> None:
    graph = import_graph(ROOT, PACKAGES)
    for module in ("engine.model.layers.decoder", "server.cli", "loadtest.report"):
        assert module in graph  # the walk found each package's modules
    cycles = [
        component
        for component in strongly_connected(graph)
        if len(component) > 1 and tuple(component) not in KNOWN_CYCLES
    ]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_sees_imports_in_functions_and_type_checking(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
    )
    (package / "b.py").write_text("def f():\n    from pkg import c\n")
    (package / "c.py").write_text("from . import a\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert [sorted(c) for c in strongly_connected(graph) if len(c) > 1] == [
        ["pkg.a", "pkg.b", "pkg.c"]
    ]


def _loaded_by(probe: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return result.stdout.strip()


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports anywhere in its source."""
    paths = {
        _module_name(path, root): path
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
    }
    return {name: _imports(name, path, set(paths)) for name, path in paths.items()}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, is_package, node.module, node.level)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else base)
    return {module for module in found if module in known and module != name}


def _absolute(name: str, is_package: bool, module: str | None, level: int) -> str:
    """The absolute name of ``from <level dots><module> import ...`` inside ``name``."""
    if level == 0:
        return module or ""
    parts = name.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (level - 1)]
    return ".".join([*anchor, module] if module else anchor)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative); a component of two or more
    modules is an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components
