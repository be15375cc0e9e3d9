"""Notebooks are committed clean: no outputs, no execution counts, a python3 kernelspec, and a
first code cell tagged ``parameters`` that sets ``smoke = False`` (papermill's entry point).

Strip a notebook with ``nbstripout --extra-keys "metadata.papermill cell.metadata.papermill
cell.metadata.execution" NOTEBOOK``. Notebooks named ``*_gpu.ipynb`` keep their outputs (they need a
GPU the book build does not have) and are exempt from the output checks.
"""

import ast
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(
    p for d in ("book", "labs") for p in (ROOT / d).rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts
)
SMOKE = re.compile(r"^smoke\s*=\s*False\b", re.MULTILINE)


def _ids(p):
    return str(p.relative_to(ROOT))


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found under book/ or labs/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_is_valid_and_has_python3_kernel(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", "kernelspec name must be python3"


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if not p.name.endswith("_gpu.ipynb")], ids=_ids)
def test_notebook_has_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"cells {dirty} have outputs or execution counts: run nbstripout on {path.name}"
    assert "widgets" not in nb.metadata, "saved widget state in metadata: run nbstripout"
    assert "papermill" not in nb.metadata, "papermill metadata: strip it (nbstripout --extra-keys metadata.papermill)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_first_code_cell_is_parameters_with_smoke(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "notebook has no code cells"
    first = code[0]
    assert "parameters" in first.metadata.get("tags", []), "first code cell must be tagged 'parameters'"
    assert SMOKE.search(first.source), "the parameters cell must set `smoke = False`"
    # papermill injects its values in a cell after this one: a value computed here from another
    # parameter (``steps = 4 if smoke else 60``) would keep the default's result, so every statement
    # must assign a literal.
    for stmt in ast.parse(first.source).body:
        assert isinstance(stmt, (ast.Assign, ast.AnnAssign)), f"line {stmt.lineno}: only assignments belong here"
        try:
            ast.literal_eval(stmt.value)
        except ValueError:
            raise AssertionError(f"line {stmt.lineno} computes its value ({ast.unparse(stmt.value)}): papermill's "
                                 "injected parameters would not reach it; move it to the next cell") from None


CHAPTER_REF = re.compile(r"\b[Cc]hapters? (\d+[a-c]?)\b")
CHAPTER_LABEL = re.compile(r"^\((ch\d\d[a-c]?)\)=\n#", re.MULTILINE)


def test_chapters_are_referred_to_by_label():
    """The rendered book numbers its chapters straight through the parts (``use_multitoc_numbering``),
    so 08b is chapter 9 and 11 is chapter 14: a chapter number typed in prose would follow the file
    names and point at the wrong chapter. Markdown cells refer to chapters with
    ``{numref}`%s <chNN>``` instead; each chapter carries its label ``(chNN)=`` above its title."""
    labels, typed = {}, []
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for c in nb.cells:
            if c.cell_type != "markdown":
                continue
            for m in CHAPTER_LABEL.finditer(c.source):
                labels[m.group(1)] = path.name
            typed += [f"{path.name}: {c.source[max(0, m.start() - 30):m.end() + 10]!r}"
                      for m in CHAPTER_REF.finditer(c.source)]
    assert not typed, "chapter numbers typed in prose (use {numref}`%s <chNN>`):\n" + "\n".join(typed)
    chapters = {p.name for p in NOTEBOOKS if re.match(r"\d\d[a-c]?_", p.name)}
    assert set(labels.values()) == chapters, f"chapters without a (chNN)= label: {chapters - set(labels.values())}"
    assert all(name.startswith(label[2:] + "_") for label, name in labels.items()), labels
