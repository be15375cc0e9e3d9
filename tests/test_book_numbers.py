"""No measured number typed into the book's prose.

A number that comes from a measurement (a time, a speed-up, a loss gap, a bandwidth, a memory
figure, a step count of a recorded run) must reach the page through myst-nb's ``glue`` from a result
file under ``results/`` or a computation in the notebook, so that the prose cannot drift from the
data. This test scans every markdown cell of ``book/*.ipynb`` and ``labs/*.ipynb`` and every
``book/*.md`` page for literals that look like measurements:

* decimals (``0.75``), percentages (``30%``), speed-ups (``1.5×``, ``3x``),
* numbers with a unit of time, rate, size or training length (``µs``, ``ms``, ``s``, ``min``,
  ``minutes``, ``hours``, ``GB``, ``GiB``, ``MB``, ``MiB``, ``TB``, ``TB/s``, ``GB/s``, ``TFLOP/s``,
  ``PFLOP/s``, ``tok/s``, ``tokens/s``, ``steps``, ``nats``),
* vague stand-ins for a count that was never measured ("a dozen").

It ignores what cannot be a typed copy: glue roles (``{glue:text}`key```), inline and display maths
(``$...$``, ``$$...$$``), code spans and fenced code blocks, MyST roles and directive options,
cross-references and links.

**The rule.** A flagged literal is allowed

1. if it is in :data:`ALLOWED` (a definitional or analytic constant, such as NVFP4's 0.5625 bytes per
   element or the 12.5% its scales add, with the reason next to it; an entry no page needs fails the
   test, so the list stays short), or
   matches a pattern of :data:`ALLOWED_CONTEXTS` (version numbers, compute capabilities), or
2. if the same sentence (or table row) cites its source: a ``{cite:p}``/``{cite:t}`` role, or a
   place in the paper or TE ("§4.1", "Table 1", "Fig. 4", "appendix A.1", a ``transformer_engine/...py``
   file). Naming one of our own scripts is not a citation: its numbers live in ``results/``. Published
   figures are facts about a source, not our measurements; the citation says which.

Everything else is a typed measurement: glue it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "book").glob("*.ipynb"), *(ROOT / "labs").glob("*.ipynb"), *(ROOT / "book").glob("*.md")])

#: Literals allowed anywhere, each with its reason (definitions and exact arithmetic, not measurements).
ALLOWED: dict[str, str] = {
    "0.5": "an E2M1 value",
    "0.5625": "NVFP4 bytes per element: 4-bit code + 8-bit scale / 16 = 4.5 bits (definition)",
    "3.125": "bytes per element with rowwise and columnwise outputs from one read (definition)",
    "12.5%": "the E4M3 scale per 16 four-bit codes: 8 / (16 x 4) (definition)",
    "100%": "a bound (all of something), not a measurement",
    "14%": "chapter 3's worked example: 7 saturating to 6 (or 8 decoding from a tie) is 1/7 off (arithmetic)",
    "1 MiB": "chapter 5: 1×16 E4M3 scales of a 4096×4096 tensor, 4096²/16 bytes (arithmetic)",
    "1.0": "a block maximum chosen for an example (a value, not a measurement)",
    "0.25": "half of E2M1's smallest non-zero value, a rounding threshold (definition)",
    "0.02": "the standard deviation of the synthetic weights' distribution (a chosen parameter)",
    **{cc: "a CUDA compute capability (a name, not a measurement)"
       for cc in ("8.0", "8.6", "8.9", "9.0", "10.0", "10.3")},
}

#: Patterns of text whose numbers are names or versions, not measurements (reason, regex).
ALLOWED_CONTEXTS: list[tuple[str, re.Pattern]] = [
    ("software versions", re.compile(r"\b(?:TE|Transformer Engine|CUDA|torch|PyTorch|Python|torchao|release|version|jupyter-book|"
                                     r"Triton|cuDNN|cuBLAS(?:Lt)?|sm_|PTX ISA)\s*(?:≥|>=|<|≤)?\s*v?\d+(?:\.\d+)+")),
    ("compute capabilities", re.compile(r"capabilit(?:y|ies)\s*(?:≥|>=|<|≤)?\s*\d+\.\d+(?:\s*[–-]\s*\d+\.\w+)?")),
    ("arXiv identifiers", re.compile(r"arXiv[: ]\s*\d{4}\.\d{4,5}")),
    ("bit widths and block shapes", re.compile(r"\b\d+\s*×\s*\d+\b")),
]

#: A sentence that says where its number comes from.
CITATION = re.compile(
    r"\{cite:[pt]\}|§\s*\d|\b(?:Table|Tables|Fig\.|Figs?\.|Figure|appendix|appendices|App\.)\s*[A-Z]?\d"
    r"|\b(?:appendix|App\.)\s+[A-E]\b|transformer_engine/[\w/.]+\.py|reference_nvfp4\.py|nvfp4_tensor\.py",
    re.IGNORECASE,
)

UNITS = (r"µs|us|ms|s|sec|seconds?|min|minutes?|hours?|h|GB|GiB|MB|MiB|TB|TB/s|GB/s|TFLOP/s|PFLOP/s|TFLOPS|PFLOPS"
         r"|tok/s|tokens/s|tokens per second|steps|nats")
UNITS = "|".join(sorted(UNITS.split("|"), key=len, reverse=True))   # longest first: "TB/s" before "TB"
MEASUREMENT = re.compile(
    r"(?<![\w.,/^_-])(?:"
    r"\d[\d,]*(?:\.\d+)?\s+(?:" + UNITS + r")(?![\w])"              # numbers with units
    r"|[+±−-]?\d[\d,]*\.\d+\s*(?:%|×|x(?![\w\d]))?"                # decimals, maybe with % or ×
    r"|[+±−-]?\d[\d,]*\s*%"                                       # percentages
    r"|\d[\d,]*\s?(?:×|x)(?![\w\d×])"                             # speed-ups: 3×, 2x (not 16×16)
    r")(?![\w]|\.\d)"
    r"|\ba dozen\b|\bdozens of\b|\bhundreds of times\b",
    re.IGNORECASE,
)

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(.*?)\s*$")
VERBATIM = re.compile(r"^\{(?:code-cell|code-block|code|math|literalinclude)\}")


def drop_code_blocks(text: str) -> str:
    """Remove fenced code blocks (and ``{math}``/``{code}`` directives), keep other directives' text.

    Exercises and solutions are ``````{exercise}`````` directives: their prose is scanned, the code
    inside them is not.
    """
    out, directives, code = [], [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if code is not None:                                    # inside a code block: drop
            if m and not m.group(2) and m.group(1)[0] == code[0] and len(m.group(1)) >= len(code):
                code = None
            continue
        if m:
            fence, info = m.groups()
            if info.startswith("{") and not VERBATIM.match(info):
                directives.append(fence)                        # a directive: keep its content
            elif not info and directives and directives[-1] == fence:
                directives.pop()
            else:
                code = fence                                    # a code block (or a verbatim directive)
            continue
        out.append(line)
    return "\n".join(out)


STRIP = [
    re.compile(r"\$\$.*?\$\$", re.DOTALL),                                # display maths
    re.compile(r"\{(?!cite)[\w:-]+\}`[^`]*`"),                            # glue and other roles (keep cite)
    re.compile(r"(?<!\\)\$[^$\n]+?(?<!\\)\$"),                           # inline maths
    re.compile(r"``.*?``|`[^`\n]*`"),                                     # code spans
    re.compile(r"^\s*:[\w-]+:.*$", re.MULTILINE),                         # directive options
    re.compile(r"\]\([^)]*\)|<https?://[^>]*>|https?://\S+"),              # link targets and URLs
    re.compile(r"\\begin\{.*?\\end\{[^}]*\}", re.DOTALL),                 # amsmath environments
]


def prose(text: str) -> str:
    """Markdown with everything the scanner ignores replaced by a space."""
    text = drop_code_blocks(text)
    for pattern in STRIP:
        text = pattern.sub(" ", text)
    return text


def units(text: str) -> list[str]:
    """Sentences, with each table row and list item its own unit."""
    out = []
    for line_block in re.split(r"\n(?=\s*(?:\||[-*] |\d+\. |#))|\n\s*\n", text):
        out += re.split(r"(?<=[.!?])\s+(?=[A-Z(*])", line_block)
    return out


def typed_numbers(markdown: str) -> list[tuple[str, str]]:
    """The measurement-like literals of a markdown text that no rule allows.

    Returns:
        (literal, the sentence it is in) pairs.
    """
    found = []
    for sentence in units(prose(markdown)):
        if CITATION.search(sentence):
            continue
        allowed_spans = [m.span() for _, rx in ALLOWED_CONTEXTS for m in rx.finditer(sentence)]
        for m in MEASUREMENT.finditer(sentence):
            literal = re.sub(r"\s+", "", m.group(0)).replace("x", "×").lstrip("+±−-")
            if literal in ALLOWED or m.group(0).strip() in ALLOWED:
                continue
            if any(a <= m.start() < b for a, b in allowed_spans):
                continue
            found.append((m.group(0).strip(), " ".join(sentence.split())[:160]))
    return found


def markdown_cells(path: Path) -> list[tuple[str, str]]:
    """(where, markdown) for every markdown cell of a notebook, or the whole of a .md page."""
    if path.suffix == ".md":
        return [(path.name, path.read_text())]
    nb = json.loads(path.read_text())
    return [(f"{path.name} cell {c.get('id', i)}", "".join(c["source"]))
            for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown"]


# --- the scanner itself -------------------------------------------------------------------------

def test_scanner_flags_a_typed_number():
    cell = "The emulated layer took 1.79× the BF16 time and the copy reached 4.0 TB/s in 300 steps."
    assert [lit for lit, _ in typed_numbers(cell)] == ["1.79×", "4.0 TB/s", "300 steps"]
    assert typed_numbers("It ran about 30 minutes on the CPU.")
    assert typed_numbers("every layer launches a dozen small kernels")
    assert typed_numbers("the project's target is 0.75.")
    assert typed_numbers("NVFP4 saved 12% of the memory.")
    assert typed_numbers("benchmarks/bench_kernels.py measured 1.79× on the H200.")   # our script is no citation
    assert typed_numbers("B200 has 9,000 TFLOP/s of FP4 (the datasheet).")            # datasheets: nvfp4lab.hardware


def test_scanner_ignores_glue_maths_code_and_cited_figures():
    assert typed_numbers("The layer took {glue:text}`emu_x:.2f`× the BF16 time.") == []
    assert typed_numbers("So $n^\\star \\approx 1181$ and `print(0.75)` prints 0.75 in code.") == [
        ("0.75", "So and prints 0.75 in code.")]
    assert typed_numbers("```python\nx = 1.5 * 3.14\n```\n") == []
    solution = "````{solution} ex\n:class: dropdown\n\nIt took 2.5 ms.\n\n```python\nprint(3.25)\n```\n````\n"
    assert [lit for lit, _ in typed_numbers(solution)] == ["2.5 ms"]      # prose in a directive is scanned
    assert typed_numbers("MMLU-Pro 62.58% against 62.62% {cite:p}`nvidia2025nvfp4`.") == []
    assert typed_numbers("Keep 16% of the linear layers in BF16 (appendix A.1).") == []
    assert typed_numbers("FP8 block scaling needs CUDA ≥ 12.9 and TE 2.20 on compute capability 9.0.") == []
    assert typed_numbers("It costs 0.5625 bytes per element, 12.5% for the scales, in 16×16 tiles.") == []


def test_there_is_prose_to_scan():
    assert len(SOURCES) > 10
    assert sum(len(markdown_cells(p)) for p in SOURCES) > 50


def test_allow_list_has_no_unused_entries():
    texts = [text for path in SOURCES for _, text in markdown_cells(path)]
    unused = []
    for literal in list(ALLOWED):
        reason = ALLOWED.pop(literal)
        try:
            if not any(typed_numbers(text) for text in texts):
                unused.append(literal)
        finally:
            ALLOWED[literal] = reason
    assert not unused, f"ALLOWED entries no page needs (remove them): {unused}"


# --- the book -----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_measured_number_typed_into_prose(path):
    bad = [f"{where}: {lit!r} in “{sentence}”" for where, text in markdown_cells(path) for lit, sentence in typed_numbers(text)]
    assert not bad, ("measured numbers typed into markdown (glue them from results/ or a computation, cite their "
                     "source in the same sentence, or add a definitional constant to ALLOWED with its reason):\n"
                     + "\n".join(bad))
