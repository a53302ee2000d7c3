"""The dependency floors: imports point one way, ``jobs/cluster/harness/tools -> serve_app ->
pipelines -> specdec``. Every module of the library floors is read (not imported) and each
import, at module level or inside a function, must name a package on its own floor or a
lower one; ``specdec`` (the algorithm) never imports Ray."""

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
