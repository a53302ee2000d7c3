"""The dependency floors: imports point one way, ``jobs/cluster/harness/tools -> serve_app ->
pipelines -> specdec``. Every module of the library floors is read (not imported) and each
import, at module level or inside a function, must name a package on its own floor or a
lower one; ``specdec`` (the algorithm) never imports Ray. Within and across floors no
modules import one another in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
#: package -> floor; anything not named here (stdlib, third party) is not checked
FLOORS = {"specdec": 0, "pipelines": 1, "serve_app": 2, "jobs": 3, "cluster": 3, "harness": 3, "tools": 3}
LIBRARY = ("specdec", "pipelines", "serve_app")  # the floors whose modules are checked
NO_RAY = ("specdec",)  # floors that must run without Ray


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module) for every absolute import in the tree, nested ones included,
    and ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))  # relative imports stay inside their package
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            out.append((node.lineno, node.args[0].value))
    return out


def _is_dynamic_import(func: ast.expr) -> bool:
    """``importlib.import_module``, ``import_module`` or ``__import__``."""
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def offences(package: str) -> list[str]:
    """``file:line: import X (...)`` for each import of ``package``'s modules that goes up a
    floor (or reaches Ray from a floor that must not)."""
    floor = FLOORS[package]
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT)
        for line, module in imported(ast.parse(path.read_text(), str(rel))):
            top = module.split(".")[0]
            if FLOORS.get(top, -1) > floor:
                bad.append(f"{rel}:{line}: import {module} ({package} is floor {floor}, {top} is floor {FLOORS[top]})")
            elif top == "ray" and package in NO_RAY:
                bad.append(f"{rel}:{line}: import {module} ({package} must not use Ray)")
    return bad


def test_library_floors_import_only_downwards_and_specdec_has_no_ray():
    bad = [b for package in LIBRARY for b in offences(package)]
    assert not bad, "imports that go up a floor:\n" + "\n".join(bad)


def test_the_scan_sees_nested_and_dynamic_imports():
    tree = ast.parse("def f():\n    import ray.data\n    from harness.bench import x\n"
                     "    importlib.import_module('cluster.stack')\nfrom . import sibling\n")
    assert sorted(imported(tree)) == [(2, "ray.data"), (3, "harness.bench"), (4, "cluster.stack")]


#: the house rule for code outside tests: a function a reader can hold at once
MAX_FUNCTION_LINES = 80


def test_no_function_over_80_lines():
    long = []
    tops = [d for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".")
            and d.name not in ("tests", "build", "runs", "out")]
    for path in sorted(p for d in tops for p in d.rglob("*.py")):
        rel = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.lineno}: {node.name} is {size} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


#: every package of the repository whose modules import one another
PACKAGES = ("specdec", "pipelines", "serve_app", "jobs", "cluster", "harness", "tools")


def module_names() -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES (a package is its ``__init__``)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_edges(modules: dict[str, Path]) -> dict[str, dict[str, set[str]]]:
    """module -> {module it imports: the names it takes from it}. ``from pkg import sub`` ties to
    the submodule ``pkg.sub`` (not to ``pkg``'s ``__init__``); nested imports count too."""
    def owner(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    edges: dict[str, dict[str, set[str]]] = {}
    for name, path in modules.items():
        out = edges.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                pairs = [(owner(a.name), a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                pairs = [(f"{node.module}.{a.name}", "*") if f"{node.module}.{a.name}" in modules
                         else (owner(node.module), a.name) for a in node.names]
            else:
                continue
            for target, what in pairs:
                if target and target != name:
                    out.setdefault(target, set()).add(what)
    return edges


def circles(edges: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(root: str) -> None:
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next((c for c in children if c in edges), None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(edges[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    """No two modules of the repository import one another, directly or round a longer circle
    (nested imports included): a circle is a rule living in the wrong room. The failure names
    each circle's modules and the names that tie them."""
    edges = import_edges(module_names())
    found = circles(edges)
    lines = [f"{a} -> {b} ({', '.join(sorted(edges[a][b]))})"
             for component in found for a in component for b in sorted(edges[a]) if b in component]
    assert not found, "modules that import one another (each circle's ties):\n" + "\n".join(lines)


def test_the_circle_finder_names_every_circle():
    edges = {"a": {"b": {"x"}}, "b": {"c": {"y"}}, "c": {"a": {"z"}}, "d": {"a": {"w"}}, "e": {"f": {"v"}},
             "f": {"e": {"u"}}, "g": {}}
    assert sorted(circles(edges)) == [["a", "b", "c"], ["e", "f"]]
    assert circles({"a": {"b": set()}, "b": {}}) == []


#: past this many lines a file says in its opening docstring why it is one room
ROOM_LINES = 400


def test_a_file_over_400_lines_says_why_it_is_one_room():
    big = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            doc = ast.get_docstring(ast.parse(text)) or ""
            if text.count("\n") > ROOM_LINES and "one room" not in doc.lower():
                big.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines, no 'one room' reason")
    assert not big, "large rooms: split them by what they do, or say why they are one:\n" + "\n".join(big)
