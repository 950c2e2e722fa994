"""The package's import graph: layers import downward only, no cycles, no private names across modules, and the
environment is read only through the switch registry.

Every ``import`` in ``src/lowbit`` counts, those inside functions too. See docs/ARCHITECTURE.md for the layers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "lowbit"

# Lower number = lower layer. A module may import its own package, any lower layer, and nothing else.
LAYERS = {
    "runtime": 0,
    "formats": 1,
    "quant": 2,
    "gemm": 3,
    "attention": 3,
    "ops": 3,
    "recipes": 4,
    "distributed": 4,
    "nn": 5,
    "integrations": 5.5,  # lowbit inside other libraries (transformers): built on nn and attention
    "optim": 6,
    "models": 7,
    "train": 8,
    "bench": 9,
    "cli": 10,
    "__init__": 9.5,  # the root package's lazy exports (cli may use them)
    "__main__": 11,
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _room(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _from_target(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` in ``module`` reads from."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path):
    """(target module, imported name or None, line) for every import of a lowbit module in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "lowbit":
                    yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(module, is_pkg, node)
            if target.split(".")[0] != "lowbit":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:
                    yield sub, None, node.lineno
                else:
                    yield target, a.name, node.lineno


EDGES = {m: list(_imports(m, p)) for m, p in MODULES.items()}


def test_layers_import_downward_only():
    bad = []
    for m, edges in EDGES.items():
        src = _room(m)
        for target, _, line in edges:
            dst = _room(target)
            if target == "lowbit" and src not in ("cli", "__main__", "__init__"):
                bad.append(f"{m}:{line} imports the root package 'lowbit' (import the layer itself)")
            elif dst != src and LAYERS[dst] >= LAYERS[src]:
                bad.append(f"{m}:{line} ({src}, layer {LAYERS[src]}) imports {target} ({dst}, layer {LAYERS[dst]})")
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_every_room_has_a_layer():
    assert {_room(m) for m in MODULES} <= set(LAYERS), sorted({_room(m) for m in MODULES} - set(LAYERS))


def test_no_import_cycles():
    graph = {m: {t for t, _, _ in edges if t != m and t in MODULES} for m, edges in EDGES.items()}
    # a package's __init__ importing its own submodules, which import a sibling through the package, is no cycle:
    # only edges into a package __init__ from outside that package count
    for m in graph:
        graph[m] = {t for t in graph[m] if not (MODULES[t].name == "__init__.py" and m.startswith(t + "."))}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_names_across_modules():
    bad = []
    for m, edges in EDGES.items():
        for target, name, line in edges:
            if name is not None and name.startswith("_") and not name.startswith("__") and target != m:
                bad.append(f"{m}:{line} imports {target}.{name}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def _module_aliases(module: str, path: Path) -> dict[str, str]:
    """Local names bound to lowbit modules in ``path`` (``import lowbit.x as X``, ``from . import x``), -> module."""
    out = {}
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    out[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(module, is_pkg, node)
            for a in node.names:
                if f"{target}.{a.name}" in MODULES:
                    out[a.asname or a.name] = f"{target}.{a.name}"
    return out


def test_no_private_attributes_of_other_modules():
    """``mod._name`` where ``mod`` is another lowbit module (a package's private submodules, ``pkg._triton``, are
    fine: the attribute's owner is then the package)."""
    bad = []
    for m, path in MODULES.items():
        aliases = _module_aliases(m, path)
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and f"{aliases[node.value.id]}.{node.attr}" not in MODULES and aliases[node.value.id] != m):
                bad.append(f"{m}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not bad, "private attributes of other modules:\n" + "\n".join(bad)


def _sources():
    return [(p, p.read_text()) for p in sorted(PKG.rglob("*.py"))]


def test_environment_read_only_by_the_registry():
    """``os.environ`` / ``os.getenv`` reads of LOWBIT_* and TRITON_INTERPRET live in runtime/ only."""
    bad = []
    for p, text in _sources():
        if p.parent.name == "runtime":
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if re.search(r"(environ|getenv)\b.*\b(LOWBIT_\w+|TRITON_INTERPRET)", line):
                bad.append(f"{p.relative_to(SRC)}:{i}: {line.strip()}")
    assert not bad, "environment switches read outside lowbit.runtime:\n" + "\n".join(bad)


def test_every_switch_named_in_the_code_is_registered():
    from lowbit.runtime.env import SWITCHES

    assert len(SWITCHES) <= 12
    named = set()
    for _, text in _sources():
        named |= set(re.findall(r"\bLOWBIT_[A-Z0-9_]*[A-Z0-9]\b", text))
    assert named <= set(SWITCHES), sorted(named - set(SWITCHES))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_imports_on_its_own(module):
    """Every module imports (here, in this test process: no syntax error, no import of a name that is gone)."""
    import importlib

    importlib.import_module(module)
