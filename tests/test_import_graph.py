"""agentkv's import graph, as a contract: no cycles, nothing imported upward, no private module reached from outside.

Every ``import`` and ``from … import`` in ``agentkv/`` counts, the ones inside functions and under ``TYPE_CHECKING``
included: a lazy import is still a dependency. A unit is ``agentkv.X`` (a top-level module or package).
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
    ["agentkv.gateway", "agentkv.testing", "agentkv.provider_fakes"],
    ["agentkv.integrations"],
    ["agentkv.decorator", "agentkv.conversations"],
    ["agentkv._session"],
    ["agentkv.react", "agentkv.vllm_plugin", "agentkv.vllm_launch"],
    ["agentkv.handoff", "agentkv.warm", "agentkv.discovery"],
    ["agentkv.costs"],
    ["agentkv.embedded", "agentkv.cache_ledger", "agentkv.protocols", "agentkv.wire", "agentkv.state", "agentkv.report"],
    ["agentkv.tokens", "agentkv.routing", "agentkv.tenancy", "agentkv.fleet", "agentkv.stats", "agentkv.retry", "agentkv.prefix",
     "agentkv.toolschema"],
    ["agentkv.backends", "agentkv.overflow", "agentkv.telemetry"],
    ["agentkv._http", "agentkv.events", "agentkv.providers"],
    ["agentkv._http_deadline", "agentkv._defaults", "agentkv._env", "agentkv._lazy", "agentkv._build", "agentkv._renamed",
     "agentkv.errors"],
]


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
    return ".".join(module.split(".")[:2])


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
    submodules only inside that package (from outside, through its ``__init__``)."""
    reached = []
    for module, targets in graph().items():
        for target in targets:
            parts = target.split(".")
            for depth in range(1, len(parts)):
                private = parts[depth].startswith("_") and not parts[depth].startswith("__")
                owner = ".".join(parts[:depth])  # the package holding the private part
                inside = ".".join(parts[:depth + 1])
                if private and depth + 1 < len(parts) and not module.startswith(inside):
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


def test_the_old_module_names_import_the_new_modules_with_a_warning():
    """Code and vLLM launch configs written before the renames keep working: an old name is the new module itself
    (no second copy), and importing it warns with the new name."""
    code = textwrap.dedent('''
        import importlib, warnings
        import agentkv.embedded.server, agentkv.wire.kv_transfer, agentkv.cache_ledger, agentkv.state.guards
        pairs = [("agentkv.local.server", agentkv.embedded.server), ("agentkv.vllm.params", agentkv.wire.kv_transfer),
                 ("agentkv.ledger", agentkv.cache_ledger), ("agentkv.warm.guards", agentkv.state.guards)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            same = [importlib.import_module(old) is new for old, new in pairs]
            from agentkv.local.server import LocalServer
            from agentkv.handoff.config import CalibrationConfig
        import agentkv.handoff.offline.config
        print(same, LocalServer is agentkv.embedded.server.LocalServer,
              CalibrationConfig is agentkv.handoff.offline.config.CalibrationConfig,
              sorted({str(w.message).split(" is ")[0] for w in caught if w.category is DeprecationWarning}))
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip().splitlines()[-1] == ("[True, True, True, True] True True ['agentkv.handoff.config', "
                                            "'agentkv.ledger', 'agentkv.local', 'agentkv.local.server', 'agentkv.vllm', "
                                            "'agentkv.vllm.params', 'agentkv.warm.guards']")


def test_an_old_name_keeps_the_new_modules_spec_and_runs_with_python_m():
    """Importing an old name leaves the new module's ``__spec__`` its own (importlib would set the old one on it), and
    ``python -m`` with an old module name runs the new module's code, with the warning."""
    code = textwrap.dedent('''
        import importlib, warnings
        warnings.simplefilter("ignore")
        import agentkv.embedded
        old = importlib.import_module("agentkv.local")
        print(old is agentkv.embedded, agentkv.embedded.__spec__.name, importlib.util.find_spec("agentkv.embedded").name)
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["True", "agentkv.embedded", "agentkv.embedded"]
    script = "import sys, runpy; sys.argv = ['x', '--help']; runpy.run_module('agentkv.handoff.cli', run_name='x')"
    ran = subprocess.run([sys.executable, "-W", "always", "-c", script], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    moved = subprocess.run([sys.executable, "-W", "always", "-m", "agentkv.handoff.cli"], capture_output=True,
                           text=True, timeout=120)
    assert moved.returncode == 0 and "agentkv.handoff.offline.cli now" in moved.stderr, moved.stderr[-2000:]
