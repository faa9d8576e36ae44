"""Counting checks over the package's imports, read with ``ast`` (nothing imported): no private name
crosses a package boundary, and no module-level import circle between ampkit's modules."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "ampkit")

# module-level circles only (import-linter's acyclic_siblings contract, pyproject.toml, also forbids
# function-level and TYPE_CHECKING ones)
KNOWN_CYCLES = set()


def _modules():
    """dotted name -> (path, is_package) for every module of ampkit."""
    found = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].split(os.sep)
                is_pkg = rel[-1] == "__init__"
                found[".".join(rel[:-1] if is_pkg else rel)] = (os.path.join(d, f), is_pkg)
    return found


def _imports(name, path, is_pkg, module_level_only=False):
    """(target module, imported name or None, line) for each ``import``/``from ... import`` in a module."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    if module_level_only:  # top-level statements, into plain if/try blocks but not TYPE_CHECKING ones
        todo, nodes = list(tree.body), []
        while todo:
            n = todo.pop()
            nodes.append(n)
            if isinstance(n, ast.If) and "TYPE_CHECKING" not in ast.unparse(n.test):
                todo += n.body + n.orelse
            elif isinstance(n, ast.Try):
                todo += n.body + n.orelse + n.finalbody + [s for h in n.handlers for s in h.body]
    out = []
    for n in nodes:
        if isinstance(n, ast.ImportFrom):
            mod = ".".join(base[: len(base) - n.level + 1] + ([n.module] if n.module else [])) if n.level else n.module
            out += [(mod, a.name, n.lineno) for a in n.names]
        elif isinstance(n, ast.Import):
            out += [(a.name, None, n.lineno) for a in n.names]
    return [o for o in out if o[0] and (o[0] == "ampkit" or o[0].startswith("ampkit."))]


def _package(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _root_private(target):
    """``ampkit._optional``, ``ampkit._startup``: the whole library's own helpers (every package is inside it)."""
    parts = target.split(".")
    return len(parts) == 2 and parts[1].startswith("_")


def _private(part):
    return part.startswith("_") and not part.startswith("__")


def private_cross_package_imports():
    bad = []
    for name, (path, is_pkg) in _modules().items():
        for target, imported, line in _imports(name, path, is_pkg):
            if _package(target) == _package(name) or _root_private(target):
                continue
            if any(_private(p) for p in target.split(".")) or (imported and _private(imported)):
                bad.append(f"{os.path.relpath(path, ROOT)}:{line}: {target} import {imported}")
    return bad


def module_cycles():
    """Strongly connected components (more than one module) of the module-level import graph."""
    mods = _modules()
    graph = {}
    for name, (path, is_pkg) in mods.items():
        edges = set()
        for target, imported, _ in _imports(name, path, is_pkg, module_level_only=True):
            sub = f"{target}.{imported}" if imported else None
            dest = sub if sub in mods else target  # ``from .pkg import module`` imports the module
            if dest in mods and dest != name:
                edges.add(dest)
        graph[name] = edges
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):  # Tarjan
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
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def test_no_private_name_imported_across_packages():
    assert private_cross_package_imports() == []


def test_the_counter_sees_a_private_cross_package_import(tmp_path, monkeypatch):
    """The check can fail: a module that reaches into another package's private name is reported."""
    path = tmp_path / "x.py"
    path.write_text("from ..optim.master import _private_helper\nfrom . import _own_private\n")
    got = _imports("ampkit.compat.x", str(path), False)
    assert ("ampkit.optim.master", "_private_helper", 1) in got
    monkeypatch.setattr(__import__(__name__), "_modules", lambda: {"ampkit.compat.x": (str(path), False)})
    assert len(private_cross_package_imports()) == 1  # the same-package private import is allowed


def test_no_module_level_import_cycles():
    cycles = module_cycles()
    assert [sorted(c) for c in cycles if c not in KNOWN_CYCLES] == []


def test_the_cycle_finder_sees_a_module_level_circle(tmp_path, monkeypatch):
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("from .b import thing\n")
    b.write_text("from . import a\n")
    c.write_text("def late():\n    from .a import thing\n")  # function-level: not a module-level edge
    mods = {"ampkit.p.a": (str(a), False), "ampkit.p.b": (str(b), False), "ampkit.p.c": (str(c), False),
            "ampkit.p": (str(tmp_path / "__init__.py"), True)}
    (tmp_path / "__init__.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "_modules", lambda: mods)
    assert module_cycles() == [frozenset({"ampkit.p.a", "ampkit.p.b"})]
