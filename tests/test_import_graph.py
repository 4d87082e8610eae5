"""agentkv's import graph, as a contract: no cycles, nothing imported upward, no private module reached from outside,
no private attribute of another module's object reached, no import hook installed.

Every ``import`` and ``from … import`` in ``agentkv/`` counts, the ones inside functions and under ``TYPE_CHECKING``
included: a lazy import is still a dependency. A unit is ``agentkv.X`` (a top-level module or package), or a module
of a package that LAYERS names on its own (the helpers of ``agentkv.http`` and ``agentkv._support``, and
``agentkv.providers.kinds``, the table ``agentkv.backends`` reads below the strategies that read backends).
"""

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "agentkv"

# Top to bottom: a unit may import only units in lower layers (or its own layer's... none: same-layer units are
# independent). A new unit must be placed here.
LAYERS = [
    ["agentkv.cli"],
    ["agentkv.demo"],
    ["agentkv.gateway", "agentkv.testing"],
    ["agentkv.integrations"],
    ["agentkv.decorator", "agentkv.conversations"],
    ["agentkv._session"],
    ["agentkv.react", "agentkv.vllm_plugin", "agentkv.vllm_launch"],
    ["agentkv.handoff", "agentkv.warm", "agentkv.discovery"],
    ["agentkv.providers"],
    ["agentkv.embedded", "agentkv.cache_ledger", "agentkv.protocols", "agentkv.wire", "agentkv.state", "agentkv.report"],
    ["agentkv.tokens", "agentkv.routing", "agentkv.tenancy", "agentkv.fleet", "agentkv.stats", "agentkv.retry", "agentkv.prefix",
     "agentkv.toolschema"],
    ["agentkv.backends", "agentkv.overflow", "agentkv.telemetry", "agentkv.http"],
    ["agentkv._support.effects"],
    ["agentkv._support.jobs"],
    ["agentkv.http.transport", "agentkv.events", "agentkv.providers.kinds"],
    ["agentkv.http.deadline", "agentkv._support", "agentkv._support.defaults", "agentkv._support.env",
     "agentkv._support.lazy", "agentkv._support.build", "agentkv.errors"],
]
LAYERED = {name for names in LAYERS for name in names}
HELPERS = "agentkv._support"  # private to agentkv, not to a package of it


def modules():
    """Every module of the package by dotted name (a package by its own name), with its file."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(name, path, known):
    """The agentkv modules ``name`` imports (the most specific known module each import names)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for target in names:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target.startswith("agentkv") and target != name:
                targets.add(target)
    return targets


def graph():
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def unit(module):
    """``agentkv.X``, or ``agentkv.X.Y`` where LAYERS names that module of a helpers' package on its own."""
    parts = module.split(".")
    return ".".join(parts[:3]) if ".".join(parts[:3]) in LAYERED else ".".join(parts[:2])


def cycles(edges):
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_in_a_cycle():
    """No two modules of agentkv import each other, directly or through others."""
    assert cycles(graph()) == []


def test_no_unit_imports_in_a_cycle_and_none_imports_upward():
    """The units (agentkv.X) form no cycle, and each imports only units of the layers below its own."""
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    edges = {}
    for module, targets in graph().items():
        for target in targets:
            a, b = unit(module), unit(target)
            if a != b and "agentkv" not in (a, b):
                edges.setdefault(a, set()).add(b)
    units = {unit(m) for m in modules()} - {"agentkv"}
    assert units <= set(layer), f"place these units in LAYERS: {sorted(units - set(layer))}"
    assert cycles(edges) == []
    upward = sorted(f"{a} -> {b}" for a, bs in edges.items() for b in bs if layer[b] <= layer[a])
    assert upward == []


def test_no_private_module_is_imported_from_outside_its_package():
    """A private module (``_name``) is imported only inside the package that holds it, and a private package's
    submodules only inside that package (from outside, through its ``__init__``). ``agentkv._support`` holds
    agentkv's own helpers, one a module: every module of agentkv may import them."""
    reached = []
    for module, targets in graph().items():
        for target in targets:
            parts = target.split(".")
            for depth in range(1, len(parts)):
                private = parts[depth].startswith("_") and not parts[depth].startswith("__")
                owner = ".".join(parts[:depth])  # the package holding the private part
                inside = ".".join(parts[:depth + 1])
                if private and depth + 1 < len(parts) and not module.startswith(inside) and inside != HELPERS:
                    reached.append(f"{module} -> {target}")  # a submodule of a private package
                elif private and depth + 1 == len(parts) and not module.startswith(owner + ".") and owner != "agentkv":
                    reached.append(f"{module} -> {target}")  # a private module of another package
    assert sorted(set(reached)) == []


def test_docs_and_examples_import_only_public_names():
    """No example, doc page or README snippet imports a private module of agentkv."""
    texts = [*ROOT.joinpath("examples").glob("*.py"), *ROOT.joinpath("docs").glob("*.md"), ROOT / "README.md"]
    private = re.compile(r"\bagentkv(\.\w+)*\._[a-z]\w*")
    found = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in texts for m in private.finditer(path.read_text())]
    assert found == []


def test_importing_agentkv_installs_no_import_hook():
    """``import agentkv`` leaves ``sys.meta_path`` as it found it, and a module name no release had does not import."""
    code = textwrap.dedent('''
        import importlib.util, sys
        before = list(sys.meta_path)
        import agentkv, agentkv.embedded, agentkv.handoff, agentkv.vllm_plugin
        print(sys.meta_path == before, importlib.util.find_spec("agentkv.local"), importlib.util.find_spec("agentkv.vllm"))
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["True", "None", "None"]


# The only reads of another module's private attributes: tiktoken's tables, which its public API does not expose.
ALLOWED_REACHES = {
    ("agentkv/embedded/engine/codec.py", "_special_tokens"),
    ("agentkv/embedded/engine/codec.py", "_mergeable_ranks"),
    ("agentkv/embedded/engine/grammar.py", "_special_tokens"),
    ("agentkv/embedded/engine/grammar.py", "_mergeable_ranks"),
}


def defined_names(tree):
    """The names a module defines: its functions and classes, every name and attribute it assigns, its parameters
    and keyword arguments (a ``_name`` among them belongs to the module's own objects)."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            own.add(node.arg)
    return own


def private_reaches(path):
    """Each ``x._name`` (read or written, ``x`` not ``self``/``cls``) in ``path`` whose ``_name`` the module does not
    define: ``(line, name)``."""
    tree = ast.parse(path.read_text())
    own = defined_names(tree)
    return [(node.lineno, node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and node.attr not in own and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]


def test_no_module_reaches_a_private_attribute_it_does_not_define():
    """No module of agentkv reads or sets a private attribute (``x._name``) of an object another module defined;
    the allow-list (tiktoken's tables) is exact: an entry no longer used must go."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, name in private_reaches(path):
            found.setdefault((rel, name), []).append(line)
    reaches = sorted(f"{rel}:{lines[0]} .{name}" for (rel, name), lines in found.items() if (rel, name) not in ALLOWED_REACHES)
    assert reaches == []
    assert sorted(ALLOWED_REACHES - set(found)) == []


def test_the_private_reach_finder_sees_reads_and_writes(tmp_path):
    """The finder counts a read of another object's ``_name``, and not ``self._name``, a dunder, or a ``_name`` the
    module defines (a method, a class, or a name or attribute it assigns anywhere)."""
    module = tmp_path / "m.py"
    module.write_text(textwrap.dedent('''
        class A:
            def __init__(self):
                self._mine = 1
            def f(self, other):
                other._mine = other._theirs + self._x
                return other.__dict__, other._written
        def g(b):
            b._written = 2
    '''))
    assert sorted(private_reaches(module)) == [(6, "_theirs")]
