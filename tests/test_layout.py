"""The package's shape: no import cycle between nvfp4lab's modules (imports inside functions
included) and no private name (``_x``) used across modules.

Issue 12's rules, checked on the source with :mod:`ast`, so that they hold as the library grows.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nvfp4lab"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute name of ``from <level dots><node.module> import ...`` inside ``module``."""
    if node.level == 0:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> list[tuple[str, str | None, int]]:
    """Every import of ``module`` (any depth) as (imported module, imported name or None, line)."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub, None, node.lineno) if sub in MODULES else (target, a.name, node.lineno))
    return [(m, n, line) for m, n, line in out if m == "nvfp4lab" or m.startswith("nvfp4lab.")]


def import_graph() -> dict[str, set[str]]:
    """module -> the nvfp4lab modules it imports (the package facade ``nvfp4lab`` is a node too)."""
    return {m: {target for target, _, _ in imports(m) if target in MODULES and target != m} for m in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_graph_sees_function_level_imports():
    """quantize imports kernels; an import inside a function would count as much as one at the top."""
    tree_src = "def f():\n    from . import kernels\n"
    node = ast.parse(tree_src).body[0].body[0]
    assert _resolve("nvfp4lab.quantize", node) == "nvfp4lab"
    assert "nvfp4lab.kernels" in import_graph()["nvfp4lab.quantize"]


def test_no_import_cycle():
    graph = dict(import_graph())
    graph.pop("nvfp4lab", None)  # the facade imports everything; nothing below may import it
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)
    back = sorted(m for m, targets in graph.items() if "nvfp4lab" in targets)
    assert not back, f"modules importing the package facade nvfp4lab (a cycle through __init__): {back}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_modules(module):
    """``from nvfp4lab.x import _y`` and ``x._y`` with ``x`` another nvfp4lab module are not used."""
    bad = [f"line {line}: {name} from {target}" for target, name, line in imports(module)
           if name and name.startswith("_") and not name.startswith("__") and target != module]
    tree = ast.parse(MODULES[module].read_text())
    own = {target.rsplit(".", 1)[-1] for target, name, _ in imports(module) if name is None}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in own
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            bad.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, f"{module} uses private names of other modules: {bad}"


_NUMPY_SECTION = re.compile(r"^\s*(Parameters|Returns|Raises|Attributes|Yields|Notes|Examples)\s*\n\s*-{3,}\s*$", re.M)
_NUMPY_FIELD = re.compile(r"^\s*\w+(, \w+)* : \S", re.M)


def _definitions(module: str):
    tree = ast.parse(MODULES[module].read_text())
    yield "module", tree, True
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            yield node.name, node, not node.name.startswith("_")
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef):
                        yield f"{node.name}.{sub.name}", sub, False


def test_docstring_style_checker_flags_numpy_style():
    assert _NUMPY_SECTION.search("Sum.\n\nParameters\n----------\nx : int\n")
    assert _NUMPY_FIELD.search("Sum.\n\n    x : int\n        the value\n")
    assert not _NUMPY_SECTION.search("Sum.\n\nArgs:\n    x: the value.\n")
    assert not _NUMPY_FIELD.search("Sum.\n\nArgs:\n    x: the value.\n")


@pytest.mark.parametrize("module", sorted(MODULES))
def test_docstrings_google_style(module):
    """Public module-level functions and classes have docstrings, and every docstring uses the
    Google style of ``quantize.py`` (``Args:``/``Returns:``/``Raises:``), not numpy sections."""
    missing, numpy_style = [], []
    for name, node, required in _definitions(module):
        doc = ast.get_docstring(node)
        if doc is None:
            if required:
                missing.append(name)
        elif _NUMPY_SECTION.search(doc) or _NUMPY_FIELD.search(doc):
            numpy_style.append(name)
    assert not missing, f"{module}: public definitions without a docstring: {missing}"
    assert not numpy_style, f"{module}: numpy-style docstrings (use Google style): {numpy_style}"
