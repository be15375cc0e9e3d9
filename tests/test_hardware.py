"""nvfp4lab.hardware: the one table of datasheet figures the book quotes."""

import re
from pathlib import Path

import pytest

from nvfp4lab import hardware
from nvfp4lab.capabilities import format_support
from nvfp4lab.hardware import GPUS, PAPER_FP4_OVER_BF16, gpu, hardware_table, markdown_table

ROOT = Path(__file__).resolve().parents[1]


def test_names_are_unique_and_cover_what_the_book_quotes():
    names = [g.name for g in GPUS]
    assert len(names) == len(set(n.lower() for n in names))
    assert {"H100 SXM", "H200", "B200", "GB200", "GB300"} <= set(names)


@pytest.mark.parametrize("name", list(PAPER_FP4_OVER_BF16))
def test_fp4_over_bf16_is_what_the_paper_states(name):
    # NVFP4 paper, §2, Table 1: FP4 GEMMs 4x BF16 on GB200, 6x on GB300.
    g = gpu(name)
    assert g.fp4_tflops / g.bf16_tflops == PAPER_FP4_OVER_BF16[name]


def test_fp4_over_fp8_on_blackwell():
    # B200 and GB200: FP4 twice FP8 (datasheets; paper Table 1 for GB200); GB300: three times (paper Table 1).
    assert gpu("B200").fp4_tflops == 2 * gpu("B200").fp8_tflops
    assert gpu("GB200").fp4_tflops == 2 * gpu("GB200").fp8_tflops
    assert gpu("GB300").fp4_tflops == 3 * gpu("GB300").fp8_tflops


def test_fp8_is_twice_bf16_everywhere():
    # (the H100 datasheet rounds: 1,979 and 989 TFLOP/s)
    assert all(g.fp8_tflops / g.bf16_tflops == pytest.approx(2, rel=1e-3) for g in GPUS)


def test_hopper_has_no_fp4_and_its_capability_agrees():
    for g in GPUS:
        has_fp4 = g.fp4_tflops is not None
        assert has_fp4 == (g.compute_capability >= (10, 0)), g.name
        # the capability rules (TE 2.20) say the same thing about NVFP4
        assert format_support(g.compute_capability, "12.9")["nvfp4"].native == has_fp4, g.name


def test_h200_is_an_h100_with_more_memory():
    h100, h200 = gpu("H100 SXM"), gpu("H200")
    assert (h200.bf16_tflops, h200.fp8_tflops) == (h100.bf16_tflops, h100.fp8_tflops)
    assert h200.memory_gb > h100.memory_gb and h200.hbm_tbps > h100.hbm_tbps


def test_every_row_has_a_source_and_a_citation_in_refs_bib():
    bib = (ROOT / "refs.bib").read_text()
    keys = set(re.findall(r"@\w+\{([^,]+),", bib))
    for g in GPUS:
        assert len(g.source) > 20 and "datasheet" in g.source.lower(), g.name
        assert g.citation in keys, f"{g.name}: {g.citation} is not in refs.bib"


def test_lookup_is_case_insensitive_and_unknown_names_raise():
    assert gpu(" h100 sxm ") is gpu("H100 SXM")
    with pytest.raises(ValueError, match="unknown GPU 'A100'.*H100 SXM"):
        gpu("A100")
    with pytest.raises(ValueError):
        hardware_table(["B200", "B9000"])
    with pytest.raises(ValueError, match="unknown format"):
        gpu("B200").peak_tflops("FP6")


def test_table_rows_and_ratios():
    rows = hardware_table()
    assert [r["name"] for r in rows] == hardware.gpu_names()
    b200 = hardware_table(["B200"])[0]
    assert b200["fp4_over_fp8"] == 2 and b200["fp4_over_bf16"] == 4 and b200["compute_capability"] == "10.0"
    assert hardware_table(["H100 SXM"])[0]["fp4_over_bf16"] is None
    assert gpu("B200").peak_tflops("fp4") == gpu("B200").fp4_tflops
    assert gpu("H200").to_dict()["memory_gb"] == gpu("H200").memory_gb


def test_markdown_table_has_one_line_per_gpu():
    text = markdown_table(["H100 SXM", "GB300"])
    lines = text.splitlines()
    assert len(lines) == 4 and "| none |" in lines[2] and "6×" in lines[3]
    assert "source" not in markdown_table(sources=False).splitlines()[0]


def test_the_memory_planner_reads_the_same_table():
    from nvfp4lab.plan import GPUS as PLAN_GPUS

    assert PLAN_GPUS["h200"][1] == gpu("H200").memory_gb * 10**9
    assert PLAN_GPUS["b200"][1] == gpu("B200").memory_gb * 10**9
    assert len(PLAN_GPUS) == len(GPUS)
