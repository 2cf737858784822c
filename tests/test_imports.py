"""The package's import graph has no cycle: every module can be imported on its own, and the
layers (the validation core at the bottom, backends and engine above, commands on top) stay
one-way. Imports inside functions and under TYPE_CHECKING count too: they only hide a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import tgis

ROOT = Path(tgis.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imported(tree: ast.AST, known: set[str]) -> set[str]:
    """The project modules one module imports: `from a.b import c` names a.b.c when that is
    a module, else a.b."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in known:
                    found.add(sub)
                elif node.module in known:
                    found.add(node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {
        name: imported(ast.parse(path.read_text()), known) - {name} for name, path in mods.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search with colors)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_in_tgis() -> None:
    graph = import_graph()
    assert len(graph) > 50 and "tgis.config.resolve" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_function_local_imports_count() -> None:
    tree = ast.parse("def f():\n    from tgis.config import flag\n    import tgis.errors\n")
    assert imported(tree, {"tgis.config", "tgis.errors", "tgis.hub"}) == {
        "tgis.config",
        "tgis.errors",
    }


def test_validation_core_imports_nothing_above_it() -> None:
    """tgis.config is the bottom layer: it may import tgis.errors and itself, nothing else."""
    graph = import_graph()
    for name, deps in graph.items():
        if name == "tgis.config" or name.startswith("tgis.config."):
            outside = {d for d in deps if not d.startswith("tgis.config") and d != "tgis.errors"}
            assert not outside, f"{name} imports {sorted(outside)}"
            assert "tgis.config" not in deps or name == "tgis.config", (
                f"{name} imports the package's __init__; import the part it needs"
            )


# tgis.server's packages: one per API family, one for the chat turn they share, one for the
# HTTP machinery; the app (http/app.py) is where they meet.
SERVER_APIS = ("tgi", "openai", "responses", "anthropic")
COMPOSITION_ROOT = "tgis.server.http.app"


def server_package(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["tgis", "server"] else None


def test_no_api_package_of_the_server_imports_another() -> None:
    """An API's package imports the machinery and the chat turn, never another API's; the
    chat turn and the machinery import no API (but the app, which composes them)."""
    graph = import_graph()
    for name, deps in graph.items():
        own = server_package(name)
        if own is None or name == COMPOSITION_ROOT:
            continue
        apis = {d for d in deps if server_package(d) in SERVER_APIS and server_package(d) != own}
        assert not apis, (
            f"{name} imports {sorted(apis)}: what two APIs share goes in chat/ or http/"
        )
    assert {server_package(d) for d in graph[COMPOSITION_ROOT]} >= set(SERVER_APIS)
