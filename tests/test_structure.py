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


# ---------------------------------------------------------------- mode branches (issue 24)
# Outside ampkit/precision and ampkit/optim nobody decides for a precision kind: no code builds a
# MasterWeightOptimizer or branches on a mode row's ``master_weights`` /
# ``compensated``; they ask the kind (``wrap_optimizer``, ``param_dtype``...).
OWNERS = ("precision", "optim")
_MODE_FLAGS = ("master_weights", "compensated")


def _is_mode_row(node):
    """``mode``, ``<x>.mode``, ``MODES[...]``, ``resolve_mode(...)``: an expression naming a mode row."""
    text = ast.unparse(node)
    return text == "mode" or text.endswith(".mode") or text.startswith("MODES[") or text.endswith("_mode()")


def mode_branches(modules=None):
    """``path:line: what`` for each MasterWeightOptimizer construction or mode-flag read outside the owners."""
    bad = []
    for name, (path, _) in (modules or _modules()).items():
        if _package(name) in OWNERS:
            continue
        for n in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            func = getattr(n, "func", None) if isinstance(n, ast.Call) else None
            callee = getattr(func, "id", None) or getattr(func, "attr", None)
            if callee == "MasterWeightOptimizer":
                bad.append(f"{os.path.relpath(path, ROOT)}:{n.lineno}: builds {ast.unparse(n)}")
            elif isinstance(n, ast.Attribute) and n.attr in _MODE_FLAGS and _is_mode_row(n.value):
                bad.append(f"{os.path.relpath(path, ROOT)}:{n.lineno}: branches on {ast.unparse(n)}")
            elif (callee == "getattr" and len(n.args) > 1 and isinstance(n.args[1], ast.Constant)
                  and n.args[1].value in _MODE_FLAGS and _is_mode_row(n.args[0])):
                bad.append(f"{os.path.relpath(path, ROOT)}:{n.lineno}: branches on {ast.unparse(n)}")
    return sorted(bad, key=lambda b: (b.split(":")[0], int(b.split(":")[1])))


def test_no_mode_branches_outside_precision_and_optim():
    assert mode_branches() == []


def test_the_counter_sees_the_old_mode_branches(tmp_path):
    """The check can fail: apex's FP16_Optimizer building its masters and the Lightning plugin branching on
    the mode row, as they were written before they asked the kind, are both counted; the kind's answer is not."""
    old = tmp_path / "old.py"
    old.write_text(
        "class FP16_Optimizer:\n"
        "    def __init__(self, init_optimizer):\n"
        "        self._master = MasterWeightOptimizer(init_optimizer)\n"
        "class Plugin:\n"
        "    def convert_module(self, module):\n"
        "        if self.ampkit.mode.master_weights:\n"
        "            pass\n"
        "        if MODES[name].compensated or getattr(self.mode, 'compensated'):\n"
        "            pass\n")
    new = tmp_path / "new.py"
    new.write_text(
        "def f(precision, opt, level):\n"
        "    made = precision_class('fp16-master').master_optimizer(opt)\n"
        "    keep = precision.keeps_fp32_masters or isinstance(opt, MasterWeightOptimizer)\n"
        "    return level.master_weights\n")  # apex's own opt-level property, not a mode row
    got = mode_branches({"ampkit.compat.old": (str(old), False), "ampkit.compat.new": (str(new), False),
                         "ampkit.optim.master": (str(old), False)})
    assert [g.split(": ", 1)[1] for g in got] == [
        "builds MasterWeightOptimizer(init_optimizer)", "branches on self.ampkit.mode.master_weights",
        "branches on MODES[name].compensated", "branches on getattr(self.mode, 'compensated')"], got


# Guidance for reviews, not a test (issue 47: a line limit shaped the code instead of the design): a function's
# body that does one thing fits a screen (about 60 lines); a module far longer than a few hundred lines likely
# holds more than one job. Split by responsibility, never to win lines.


# ---------------------------------------------------------------- the user API fits on one screen (issue 47)
_LOOP = ("Precision(", ".setup(model, optimizer)", "with precision.autocast():", "precision.backward(loss)",
         "precision.step(optimizer, max_norm=1.0)", "optimizer.zero_grad(", "precision.describe()")


def _public(cls):
    return {n for n in dir(cls) if not n.startswith("_")}


def test_precision_has_at_most_25_public_names_each_named_in_its_docstring():
    """What a user sees of ``Precision`` (``dir``, ``help``) is the loop's API; the integrations' hooks are the
    private protocol (docs/ARCHITECTURE.md, "The integration protocol"). Each public name is in the class docstring,
    so ``help(ampkit.Precision)`` is the whole API in one read."""
    import ampkit

    public = _public(ampkit.Precision)
    assert len(public) <= 25, sorted(public)
    doc = ampkit.Precision.__doc__
    assert [n for n in sorted(public) if f"{n}" not in doc] == []
    from ampkit.precision.kinds import KINDS

    for kind in KINDS.values():
        assert _public(kind) == public, kind  # a kind adds no public name of its own


def test_precision_docstring_opens_with_the_readme_loop():
    """``help(ampkit.Precision)`` reads as README.md's loop: its first lines are the loop, in order, before the
    constructor's arguments."""
    import ampkit

    doc = ampkit.Precision.__doc__
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    loop_at = [doc.find(line) for line in _LOOP]
    assert -1 not in loop_at and loop_at == sorted(loop_at), dict(zip(_LOOP, loop_at))
    assert loop_at[-1] < doc.index("Args:") and doc.index("::") < 120  # the loop comes first
    assert all(line in readme for line in _LOOP)


def test_the_api_counter_sees_a_public_hook(monkeypatch):
    """The count is of what a user sees: a hook without its underscore counts (and is missing from the docs)."""
    import ampkit

    monkeypatch.setattr(ampkit.Precision, "sync_grads", lambda self, optimizer: None, raising=False)
    assert "sync_grads" in _public(ampkit.Precision) and "sync_grads" not in ampkit.Precision.__doc__


# ---------------------------------------------------------------- clients' quirks live with the clients (issue 47)
_CLIENTS = ("accelerate", "fastai", "lightning", "pytorch_lightning", "lightning_fabric", "ignite")


def _client_names_in_code(root):
    """(file, line, text) for each string constant in code (docstrings aside) under ``root`` that names a client
    library or its modules: a module-name check, a ``sys.modules`` look-up, an attribute read by name."""
    found = []
    for d, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            tree = ast.parse(open(path, encoding="utf-8").read(), path)
            docs = {id(n.body[0].value) for n in ast.walk(tree)
                    if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                    and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
            for n in ast.walk(tree):
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs \
                        and n.value.split(".")[0] in _CLIENTS:
                    found.append((os.path.relpath(path, ROOT), n.lineno, n.value))
    return found


def test_the_precision_core_reads_no_client_library():
    """Accelerate's accumulation divisor and wrapper, fastai's and Lightning's wrappers, schedulers' skip flags:
    ``ampkit/integrations/`` handles them; ``ampkit/precision/`` names none of those libraries in its code."""
    assert _client_names_in_code(os.path.join(PKG, "precision")) == []


def test_the_client_counter_sees_a_module_name_check(tmp_path):
    (tmp_path / "m.py").write_text('"""accelerate in a docstring is fine."""\n'
                                   'ENGINES = ("accelerate", "fastai")\nstate = "accelerate.state"\n')
    assert sorted(v for _, _, v in _client_names_in_code(str(tmp_path))) == ["accelerate", "accelerate.state", "fastai"]
