"""The package layout: every layer imports only layers below it, every relative import resolves.

Layers bottom up: ``core``; ``backends`` and ``transport``
(side by side); ``algorithms``; ``observe``; ``engine``; ``api``; ``tools``;
``torch`` (the torch.distributed backend, on the public API) beside
the package itself (``mpicoll/__init__.py`` and the thin
``python -m mpicoll.<tool>`` modules).  Imports are read from the source
(``ast``, every ``from . import``/``from ..x import``, also those inside
functions), so a cycle that only shows when a lazy import runs is caught too.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import types

import pytest

pytestmark = pytest.mark.local  # reads source files: no MPI peer

ROOT = pathlib.Path(__file__).resolve().parents[2] / "mpicoll"

# layer -> its level; a module may import its own layer and lower levels (and
# backends/transport each other's, as one level)
LEVEL = {"core": 0, "backends": 1, "transport": 1, "algorithms": 2, "observe": 3,
         "engine": 4, "api": 5, "tools": 6, "torch": 7, "top": 7}


def _imports():
    """[(file, importing layer, imported module, names)] of every relative import in mpicoll."""
    out = []
    for f in sorted(ROOT.rglob("*.py")):
        parts = ("mpicoll",) + f.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module if f.name == "__init__.py" else module.rpartition(".")[0]
        layer = parts[1] if len(parts) > 2 else "top"
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                out.append((f.relative_to(ROOT.parent), layer, target,
                            [a.name for a in node.names]))
    return out


def _find_spec(module: str):
    """``importlib.util.find_spec`` for mpicoll's modules read from the source tree, not imported:
    finding ``mpicoll.torch.x`` by import would import torch, which the suite may not have."""
    if module != "mpicoll" and not module.startswith("mpicoll."):
        return importlib.util.find_spec(module)
    path = ROOT.parent.joinpath(*module.split("."))
    if (path / "__init__.py").exists():
        return types.SimpleNamespace(origin=str(path / "__init__.py"), submodule_search_locations=[str(path)])
    if path.with_suffix(".py").exists():
        return types.SimpleNamespace(origin=str(path.with_suffix(".py")), submodule_search_locations=None)
    return None


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LEVEL else "top"


def test_every_layer_is_known():
    layers = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert layers == set(LEVEL) - {"top"}, f"layers on disk {sorted(layers)}, table {sorted(LEVEL)}"


def test_layers_import_only_layers_below():
    bad = [f"{f}: {layer} imports {target} ({_layer(target)})"
           for f, layer, target, _ in _imports()
           if LEVEL[_layer(target)] > LEVEL[layer]]
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_relative_imports_resolve():
    """Every ``from .x import y`` names a module, or a package and one of its modules or names."""
    missing = []
    for f, _, target, names in _imports():
        spec = _find_spec(target)
        if spec is None:
            missing.append(f"{f}: no module {target}")
            continue
        package = spec.submodule_search_locations is not None
        for name in names:
            if name == "*" or _defines(target, name):
                continue
            if package and _find_spec(f"{target}.{name}") is not None:
                continue
            missing.append(f"{f}: {target} has no {name}")
    assert not missing, "\n".join(missing)


def _defines(module: str, name: str) -> bool:
    """Whether the source of ``module`` binds ``name`` at its top level."""
    spec = _find_spec(module)
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names = t.elts if isinstance(t, ast.Tuple) else [t]
                if any(isinstance(x, ast.Name) and x.id == name for x in names):
                    return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
    return False


def test_no_module_reads_another_modules_private_names():
    """``_mod._name`` where ``_mod`` is an imported mpicoll module: private state read from outside."""
    aliases = {}  # file -> {local name: module} of the mpicoll modules it imports
    for f, _, target, names in _imports():
        spec = _find_spec(target)
        if spec is None or spec.submodule_search_locations is None:
            continue
        for node_name in names:
            if _find_spec(f"{target}.{node_name}") is not None:
                aliases.setdefault(f, {})[node_name] = f"{target}.{node_name}"
    bad = []
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT.parent)
        tree = ast.parse(f.read_text(), str(f))
        local = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                for a in node.names:
                    if a.name in aliases.get(rel, {}):
                        local[a.asname or a.name] = aliases[rel][a.name]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in local and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                bad.append(f"{rel}:{node.lineno}: {local[node.value.id]}.{node.attr}")
    assert not bad, "private names read from another module:\n" + "\n".join(bad)


def test_only_the_torch_layer_imports_torch():
    """mpicoll without torch never imports it: only ``mpicoll/torch/`` names torch in an import."""
    bad = []
    for f in sorted(ROOT.rglob("*.py")):
        if f.relative_to(ROOT).parts[0] == "torch":
            continue
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            bad += [f"{f.relative_to(ROOT.parent)}:{node.lineno}: {n}" for n in names
                    if n == "torch" or n.startswith("torch.")]
    assert not bad, "torch imported outside mpicoll/torch:\n" + "\n".join(bad)


def _module_graph() -> dict:
    """{module: {modules it imports}} of mpicoll, read from the source (relative imports,
    also those inside functions; ``from pkg import mod`` is an edge to ``pkg.mod``)."""
    graph: dict = {}
    for f, _, target, names in _imports():
        parts = f.with_suffix("").parts  # (f: relative to mpicoll's parent)
        source = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        edges = graph.setdefault(source, set())
        spec = _find_spec(target)
        package = spec is not None and spec.submodule_search_locations is not None
        subs = [f"{target}.{n}" for n in names if package and _find_spec(f"{target}.{n}")]
        edges.update(subs or [target])
    return graph


def _cycles(graph) -> list:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_circle():
    """No two modules of mpicoll import each other, directly or through others, even
    lazily (a circle makes each half's meaning depend on the other's: the engine's run
    path and its cache, a backend and the registry that finds it)."""
    cycles = _cycles(_module_graph())
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_circle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
