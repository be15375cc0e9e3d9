"""Datasheet figures of the GPUs the book talks about: one table, each row with its source.

The book quotes tensor-core peaks and memory figures in book/01_why_4_bits (the roofline),
book/11_fp8_or_nvfp4 (the decision between FP8 and NVFP4) and the GPU lab. They all read them from :data:`GPUS` through
:func:`gpu` and :func:`hardware_table`, so a figure is typed once, here, next to where it comes from.

Every throughput is a **dense** tensor-core peak in TFLOP/s (10^12 floating-point operations per
second; NVIDIA's datasheets print sparse peaks, twice the dense ones, and mark them with an
asterisk). FP4 means NVFP4 / FP4 tensor-core GEMMs; FP8 means E4M3/E5M2 GEMMs. Memory bandwidth is
in TB/s (10^12 bytes per second) and memory size in GB (10^9 bytes), both per GPU. For the
rack-scale systems (GB200 NVL72, GB300 NVL72) the datasheets give rack totals for 72 GPUs; the rows
hold the rack figure divided by 72.

The NVFP4 paper (arXiv 2509.25149, §2, Table 1) states the ratios of the Blackwell GEMM peaks:
FP4 is 2× FP8 and 4× BF16 on GB200, 3× FP8 and 6× BF16 on GB300 (Blackwell Ultra). The unit tests
check the rows against those ratios (``tests/test_hardware.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

__all__ = ["GPUSpec", "GPUS", "PAPER_FP4_OVER_BF16", "gpu", "gpu_names", "hardware_table", "markdown_table"]


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """One GPU's datasheet figures, per GPU, dense tensor-core peaks.

    Attributes:
        name: the name the book uses, e.g. ``"H100 SXM"``; :func:`gpu` looks rows up by it.
        architecture: ``"Hopper"``, ``"Blackwell"`` or ``"Blackwell Ultra"``.
        compute_capability: CUDA compute capability ``(major, minor)``, e.g. ``(9, 0)``; this is
            what :func:`nvfp4lab.capabilities.format_support` takes.
        bf16_tflops: dense BF16 tensor-core peak, TFLOP/s.
        fp8_tflops: dense FP8 tensor-core peak, TFLOP/s.
        fp4_tflops: dense FP4 tensor-core peak, TFLOP/s; ``None`` where the GPU has no FP4 tensor
            cores (Hopper).
        hbm_tbps: memory bandwidth, TB/s (10^12 bytes per second).
        memory_gb: memory size, GB (10^9 bytes).
        source: where the figures come from (document, and how a rack total was divided).
        citation: the ``refs.bib`` key of that document, for ``{cite:p}`` in the book.
        note: anything the figures do not say on their own (ranges, variants), or ``""``.
    """

    name: str
    architecture: str
    compute_capability: tuple[int, int]
    bf16_tflops: float
    fp8_tflops: float
    fp4_tflops: float | None
    hbm_tbps: float
    memory_gb: float
    source: str
    citation: str
    note: str = ""

    def peak_tflops(self, fmt: str) -> float | None:
        """The dense peak of one format.

        Args:
            fmt: ``"BF16"``, ``"FP8"`` or ``"FP4"`` (case-insensitive).

        Returns:
            TFLOP/s, or ``None`` if the GPU has no tensor cores for ``fmt``.

        Raises:
            ValueError: ``fmt`` is not one of the three.
        """
        key = fmt.upper()
        if key not in ("BF16", "FP8", "FP4"):
            raise ValueError(f"unknown format {fmt!r}: expected 'BF16', 'FP8' or 'FP4'")
        return {"BF16": self.bf16_tflops, "FP8": self.fp8_tflops, "FP4": self.fp4_tflops}[key]

    def to_dict(self) -> dict[str, Any]:
        """The row as a plain dict (field name -> value), e.g. for a JSON file or a DataFrame."""
        return dataclasses.asdict(self)


#: The datasheet table. Dense peaks; the datasheets print sparse ones (twice as high).
GPUS: tuple[GPUSpec, ...] = (
    GPUSpec(
        name="H100 SXM", architecture="Hopper", compute_capability=(9, 0),
        bf16_tflops=989.0, fp8_tflops=1979.0, fp4_tflops=None, hbm_tbps=3.35, memory_gb=80.0,
        source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (sparse peaks halved)",
        citation="nvidia2023h100",
    ),
    GPUSpec(
        name="H200", architecture="Hopper", compute_capability=(9, 0),
        bf16_tflops=989.0, fp8_tflops=1979.0, fp4_tflops=None, hbm_tbps=4.8, memory_gb=141.0,
        source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (sparse peaks halved)",
        citation="nvidia2024h200",
        note="the same tensor cores as H100 SXM, with more and faster HBM3e",
    ),
    GPUSpec(
        name="B200", architecture="Blackwell", compute_capability=(10, 0),
        bf16_tflops=2250.0, fp8_tflops=4500.0, fp4_tflops=9000.0, hbm_tbps=8.0, memory_gb=180.0,
        source="NVIDIA DGX B200 / HGX B200 datasheet, per GPU (system totals divided by 8, sparse peaks halved)",
        citation="nvidia2024b200",
        note="bandwidth listed as 7.7 to 8 TB/s depending on the system; memory: the DGX B200 datasheet's "
             "1,440 GB for 8 GPUs (other listings give 192 GB, the HBM3e fitted)",
    ),
    GPUSpec(
        name="GB200", architecture="Blackwell", compute_capability=(10, 0),
        bf16_tflops=2500.0, fp8_tflops=5000.0, fp4_tflops=10000.0, hbm_tbps=8.0, memory_gb=186.0,
        source="NVIDIA GB200 NVL72 datasheet, per GPU (rack totals divided by 72, sparse peaks halved); "
               "FP4 = 2x FP8 = 4x BF16 as in the NVFP4 paper, §2, Table 1",
        citation="nvidia2024gb200",
        note="memory: the datasheet's up to 13.4 TB HBM3e for 72 GPUs (other listings give 192 GB per GPU)",
    ),
    GPUSpec(
        name="GB300", architecture="Blackwell Ultra", compute_capability=(10, 3),
        bf16_tflops=2500.0, fp8_tflops=5000.0, fp4_tflops=15000.0, hbm_tbps=8.0, memory_gb=288.0,
        source="NVIDIA GB300 NVL72 datasheet, per GPU (rack totals divided by 72, dense peaks); "
               "FP4 = 3x FP8 = 6x BF16 as in the NVFP4 paper, §2, Table 1",
        citation="nvidia2025gb300",
    ),
)

#: FP4 GEMM peak over BF16 as the NVFP4 paper states it (arXiv 2509.25149, §2, Table 1).
PAPER_FP4_OVER_BF16: dict[str, float] = {"GB200": 4.0, "GB300": 6.0}

_BY_NAME = {g.name.lower(): g for g in GPUS}


def gpu_names() -> list[str]:
    """The names of the rows of :data:`GPUS`, in table order."""
    return [g.name for g in GPUS]


def gpu(name: str) -> GPUSpec:
    """Look a GPU up by name.

    Args:
        name: a row name of :data:`GPUS` (case-insensitive, surrounding spaces ignored), e.g.
            ``"B200"`` or ``"h100 sxm"``.

    Returns:
        The :class:`GPUSpec` row.

    Raises:
        ValueError: no row has that name; the message lists the known names.
    """
    row = _BY_NAME.get(str(name).strip().lower())
    if row is None:
        raise ValueError(f"unknown GPU {name!r}: nvfp4lab.hardware knows {', '.join(gpu_names())}")
    return row


def hardware_table(names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The table for the book: one dict per GPU, with the ratios a reader compares.

    Args:
        names: GPU names to include, in this order; ``None`` for every row of :data:`GPUS`.

    Returns:
        A list of dicts with keys ``name``, ``architecture``, ``compute_capability`` (string
        ``"9.0"``), ``bf16_tflops``, ``fp8_tflops``, ``fp4_tflops`` (``None`` without FP4),
        ``fp8_over_bf16``, ``fp4_over_fp8`` and ``fp4_over_bf16`` (``None`` without FP4),
        ``hbm_tbps``, ``memory_gb``, ``source``, ``citation`` and ``note``.

    Raises:
        ValueError: a name is unknown (see :func:`gpu`).
    """
    rows = []
    for g in (gpu(n) for n in names) if names is not None else GPUS:
        fp4 = g.fp4_tflops
        rows.append({
            "name": g.name, "architecture": g.architecture,
            "compute_capability": f"{g.compute_capability[0]}.{g.compute_capability[1]}",
            "bf16_tflops": g.bf16_tflops, "fp8_tflops": g.fp8_tflops, "fp4_tflops": fp4,
            "fp8_over_bf16": g.fp8_tflops / g.bf16_tflops,
            "fp4_over_fp8": fp4 / g.fp8_tflops if fp4 else None,
            "fp4_over_bf16": fp4 / g.bf16_tflops if fp4 else None,
            "hbm_tbps": g.hbm_tbps, "memory_gb": g.memory_gb,
            "source": g.source, "citation": g.citation, "note": g.note,
        })
    return rows


def markdown_table(names: Sequence[str] | None = None, sources: bool = True) -> str:
    """:func:`hardware_table` as a Markdown table (for ``display(Markdown(...))`` in a notebook).

    Args:
        names: GPU names to include, in order; ``None`` for all.
        sources: add a last column with each row's :attr:`GPUSpec.source` (and its note, if any).

    Returns:
        Markdown text: GPU, compute capability, dense BF16 / FP8 / FP4 TFLOP/s, FP4 over FP8 and
        over BF16, memory bandwidth (TB/s) and size (GB), and the source.

    Raises:
        ValueError: a name is unknown.
    """
    def ratio(v: float | None) -> str:
        return f"{v:.0f}×" if v else "–"

    head = ("| GPU | compute capability | BF16 TFLOP/s | FP8 TFLOP/s | FP4 TFLOP/s | FP4 / FP8 | FP4 / BF16 "
            "| memory bandwidth | memory |" + (" source |" if sources else ""))
    rows = [head, "|---" * (9 + int(sources)) + "|"]
    for r in hardware_table(names):
        fp4 = f"{r['fp4_tflops']:,.0f}" if r["fp4_tflops"] else "none"
        rows.append(
            f"| {r['name']} ({r['architecture']}) | {r['compute_capability']} | {r['bf16_tflops']:,.0f} | "
            f"{r['fp8_tflops']:,.0f} | {fp4} | {ratio(r['fp4_over_fp8'])} | {ratio(r['fp4_over_bf16'])} | "
            f"{r['hbm_tbps']:g} TB/s | {r['memory_gb']:,.0f} GB |" + (f" {r['source']}{'; ' + r['note'] if r['note'] else ''} |" if sources else ""))
    return "\n".join(rows)
