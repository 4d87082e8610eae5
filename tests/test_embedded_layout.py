"""agentkv.embedded shows its two halves: an engine that knows nothing of HTTP, a server over it, and no import cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import agentkv

ROOT = Path(agentkv.__file__).parent
LOCAL = ROOT / "embedded"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in LOCAL.rglob("*.py")}


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Every agentkv.embedded module ``path`` imports anywhere (top level, functions, TYPE_CHECKING blocks)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & set(known)
            found |= submodules or {node.module}  # `from pkg import submodule` names the submodule
    return {name for name in found if name in known and name.startswith("agentkv.embedded")}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle once, as the path that closes it (depth-first over the module graph)."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(edges.get(node, ())):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = "done"

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    return found


def test_local_is_an_engine_a_server_and_the_family():
    """Every module of agentkv.embedded lives in engine/, server/ or family/ (the package file aside)."""
    loose = sorted(p.name for p in LOCAL.glob("*.py") if p.name != "__init__.py")
    assert loose == [] and {p.name for p in LOCAL.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "engine", "server", "family"}


def test_the_engine_never_imports_the_server():
    """Nothing under embedded/engine imports embedded/server: the engine runs without HTTP."""
    edges = graph()
    leaks = {m: sorted(t for t in targets if t.startswith("agentkv.embedded.server"))
             for m, targets in edges.items() if m.startswith("agentkv.embedded.engine")}
    assert {m: t for m, t in leaks.items() if t} == {}


def test_agentkv_local_has_no_import_cycles():
    """No cycle among agentkv.embedded's modules, counting imports inside functions and TYPE_CHECKING blocks."""
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    """The check above can fail: a two-module loop and a three-module loop are both reported."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}}) == [["a", "b", "a"],
                                                                                    ["c", "d", "e", "c"]]
