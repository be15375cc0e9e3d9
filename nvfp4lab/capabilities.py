"""Capability probe: what this machine can run, natively or emulated, and what to use.

``probe()`` answers, for the current process and CUDA device 0:

* device name, compute capability (SM ``major.minor``), memory in bytes;
* torch / CUDA / cuDNN / Triton versions;
* Transformer Engine's version, or why it cannot be imported;
* for each of BF16, FP8 (delayed, current, block scaling), MXFP8 and NVFP4:
  whether it runs *natively* here (on the hardware's own tensor-core formats) and,
  if not, why;
* which mode nvfp4lab will use (``"native-te"``, ``"fast-emulation"``,
  ``"cpu-emulation"``) and a recommendation, with the reason.

Where to look for what
----------------------
When Transformer Engine (TE) imports and a CUDA GPU is present, the per-format
answers are TE's own (``transformer_engine.pytorch.is_fp8_available``,
``is_fp8_block_scaling_available``, ``is_mxfp8_available``, ``is_nvfp4_available``,
each with ``return_reason=True``; TE file ``transformer_engine/pytorch/quantization.py``,
``_compute_*_support``). Otherwise the same compute-capability rules are applied
here, with TE's reason strings word for word (TE pytorch/quantization.py):

* BF16: SM >= 8.0 (BF16 tensor cores);
* FP8 delayed / current scaling (``DelayedScaling``, ``Float8CurrentScaling``): SM >= 8.9,
  and on SM 8.9 also CUDA >= 12.1;
* FP8 block scaling (``Float8BlockScaling``): SM >= 9.0 and CUDA >= 12.9;
* MXFP8 (``MXFP8BlockScaling``): 10.0 <= SM < 12.0;
* NVFP4 (``NVFP4BlockScaling``): SM >= 10.0.

The rules live in the pure function :func:`format_support`, testable without a GPU.

Nothing here imports Transformer Engine or Triton at module import time; both
are imported lazily inside :func:`probe` (and :func:`recipe_support`) with their
import-time warnings silenced, so ``import nvfp4lab`` works with neither.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .precisions import FORMAT_KEYS as PRECISION_FORMAT_KEYS
from .precisions import get_precision

__all__ = [
    "TE_INSTALL_COMMAND",
    "TE_PINNED_VERSION",
    "FORMAT_KEYS",
    "MODES",
    "FormatSupport",
    "TEInfo",
    "Capabilities",
    "format_support",
    "choose_mode",
    "recommend",
    "probe",
    "recipe_support",
    "format_table",
    "add_probe_subcommand",
    "run_probe_command",
    "main_probe",
]

#: The Transformer Engine release nvfp4lab is bit-exact with.
TE_PINNED_VERSION = "2.20.2"
#: How to install it (TE setup.py): needs torch already installed, a CUDA GPU
#: machine with CUDA >= 12.1 and a C++17 compiler for the ``transformer-engine-torch`` sdist.
TE_INSTALL_COMMAND = f'pip install --no-build-isolation "transformer-engine[pytorch]=={TE_PINNED_VERSION}"'

#: Format keys, in the order they are reported (the precision table's hardware formats).
FORMAT_KEYS = PRECISION_FORMAT_KEYS

#: nvfp4lab's execution modes, best first.
MODES = ("native-te", "fast-emulation", "cpu-emulation")

_LABELS = {k: get_precision(k).label for k in FORMAT_KEYS}
_TE_RECIPES = {k: get_precision(k).te_recipe for k in FORMAT_KEYS}
# Which of TE's availability functions answers for which format.
_TE_CHECK_FOR_FORMAT = {k: get_precision(k).te_check for k in FORMAT_KEYS if get_precision(k).te_check}
#: TE's availability functions (``transformer_engine.pytorch.<name>``), by check name.
TE_CHECK_FUNCTIONS = {
    "fp8": "is_fp8_available",
    "fp8_block_scaling": "is_fp8_block_scaling_available",
    "mxfp8": "is_mxfp8_available",
    "nvfp4": "is_nvfp4_available",
}

SOURCE_TE = "transformer_engine"
SOURCE_RULES = "compute-capability rules"

# TE's reason strings (transformer_engine/pytorch/quantization.py, _compute_*_support), verbatim.
REASON_FP8_CC = "Device compute capability 8.9 or higher required for FP8 execution."
REASON_FP8_ADA_CUDA = "Cuda version 12.1 or higher required for FP8 execution on Ada."
REASON_FP8_BLOCK = "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."
REASON_MXFP8_CC = "Device compute capability 10.0 or higher required for MXFP8 execution."
REASON_MXFP8_SM120 = "MXFP8 (for all gemm layouts) is not supported on 12.0+ architectures yet."
REASON_NVFP4_CC = "Device compute capability 10.0 or higher required for NVFP4 execution."
# nvfp4lab's own (TE has no BF16 compute-capability message).
REASON_BF16_CC = "Device compute capability 8.0 or higher required for BF16 tensor-core GEMMs."
REASON_NO_GPU = "No CUDA GPU detected (torch.cuda.is_available() is False)."


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class FormatSupport:
    """Whether one number format runs natively on this machine.

    Attributes:
        key: one of :data:`FORMAT_KEYS` (``"bf16"``, ``"fp8-delayed"``, ``"fp8-current"``,
            ``"fp8-block"``, ``"mxfp8"``, ``"nvfp4"``).
        label: human name, e.g. ``"FP8 block scaling"``.
        te_recipe: the TE 2.20 recipe class name that runs it (``None`` for BF16).
        native: True when the hardware (and CUDA) support the format's GEMMs, as
            judged by TE when TE is importable, by the compute-capability rules otherwise.
            It does not say whether TE is installed; see :class:`TEInfo` for that.
        reason: empty when ``native``; otherwise why not (TE's words where TE has some).
        source: ``"transformer_engine"`` (TE's own check) or ``"compute-capability rules"``.
    """

    key: str
    label: str
    te_recipe: str | None
    native: bool
    reason: str
    source: str


@dataclass(frozen=True)
class TEInfo:
    """Transformer Engine as found in this process.

    Attributes:
        version: installed version (``"2.20.2"``), or ``None`` when not installed.
        importable: ``import transformer_engine.pytorch`` succeeded.
        error: why TE is unusable (not installed, or the import's exception and the
            install command), ``None`` when importable.
        checks: TE's own answers, ``((check, available, reason), ...)`` for check in
            ``"fp8"``, ``"fp8_block_scaling"``, ``"mxfp8"``, ``"nvfp4"`` — empty without a
            GPU (TE's checks need a CUDA device). A ``{check: (available, reason)}``
            mapping is accepted at construction and stored as a sorted tuple.
    """

    version: str | None = None
    importable: bool = False
    error: str | None = None
    checks: Any = ()

    def __post_init__(self) -> None:
        checks = self.checks
        if isinstance(checks, Mapping):
            items = [(str(k), bool(v[0]), str(v[1])) for k, v in checks.items()]
        else:
            items = [(str(k), bool(ok), str(reason)) for k, ok, reason in checks]
        unknown = {k for k, _, _ in items} - set(TE_CHECK_FUNCTIONS)
        if unknown:
            raise ValueError(f"unknown TE check(s) {sorted(unknown)}; expected {sorted(TE_CHECK_FUNCTIONS)}")
        object.__setattr__(self, "checks", tuple(sorted(items)))

    def check(self, name: str) -> tuple[bool, str] | None:
        """TE's ``(available, reason)`` for check ``name``, or ``None`` if TE was not asked."""
        for key, ok, reason in self.checks:
            if key == name:
                return ok, reason
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "importable": self.importable,
            "error": self.error,
            "checks": {k: {"available": ok, "reason": reason} for k, ok, reason in self.checks},
        }


@dataclass(frozen=True)
class Capabilities:
    """What :func:`probe` found. Frozen; :meth:`to_dict` gives plain JSON types.

    Attributes:
        python_version, platform: interpreter and OS (``platform.platform()``).
        torch_version: ``torch.__version__``.
        cuda_version: CUDA that torch was built with (``torch.version.cuda``), ``None`` on CPU builds.
        cudnn_version: ``torch.backends.cudnn.version()`` as a string, ``None`` if absent.
        triton_version: Triton's version if ``import triton`` works, else ``None``;
            ``triton_error`` then says why.
        gpu_available: ``torch.cuda.is_available()``.
        device_name: name of CUDA device 0, or ``"cpu"``.
        device_count: number of CUDA devices (0 without a GPU).
        compute_capability: ``(major, minor)`` of device 0, ``None`` without a GPU.
        total_memory_bytes: memory of device 0 in bytes, ``None`` without a GPU.
        transformer_engine: :class:`TEInfo`.
        formats: one :class:`FormatSupport` per key of :data:`FORMAT_KEYS`, in that order.
        mode: one of :data:`MODES`; ``mode_reason`` says why.
        recommendation: what to use here and why (the book's decision guide).
    """

    python_version: str
    platform: str
    torch_version: str
    cuda_version: str | None
    cudnn_version: str | None
    triton_version: str | None
    triton_error: str | None
    gpu_available: bool
    device_name: str
    device_count: int
    compute_capability: tuple[int, int] | None
    total_memory_bytes: int | None
    transformer_engine: TEInfo
    formats: tuple[FormatSupport, ...]
    mode: str
    mode_reason: str
    recommendation: str

    @property
    def total_memory_gib(self) -> float | None:
        """Device memory in GiB (2**30 bytes), ``None`` without a GPU."""
        return None if self.total_memory_bytes is None else self.total_memory_bytes / 2**30

    def format(self, key: str) -> FormatSupport:
        """The :class:`FormatSupport` for ``key`` (one of :data:`FORMAT_KEYS`); KeyError otherwise."""
        for f in self.formats:
            if f.key == key:
                return f
        raise KeyError(f"unknown format {key!r}; expected one of {FORMAT_KEYS}")

    def to_dict(self) -> dict[str, Any]:
        """Plain ``dict``/``list``/``str``/``int``/``float``/``bool``/``None`` only (``json.dumps`` works)."""
        return {
            "python_version": self.python_version,
            "platform": self.platform,
            "torch_version": self.torch_version,
            "cuda_version": self.cuda_version,
            "cudnn_version": self.cudnn_version,
            "triton_version": self.triton_version,
            "triton_error": self.triton_error,
            "gpu_available": self.gpu_available,
            "device_name": self.device_name,
            "device_count": self.device_count,
            "compute_capability": list(self.compute_capability) if self.compute_capability else None,
            "total_memory_bytes": self.total_memory_bytes,
            "transformer_engine": self.transformer_engine.to_dict(),
            "formats": {f.key: dataclasses.asdict(f) for f in self.formats},
            "mode": self.mode,
            "mode_reason": self.mode_reason,
            "recommendation": self.recommendation,
        }


# --------------------------------------------------------------------------- pure logic


def _parse_version(version: str | None) -> tuple[int, ...] | None:
    """``"12.9"`` -> ``(12, 9)``; ``"12.10"`` -> ``(12, 10)``; garbage or None -> None.

    TE compares ``float(torch.version.cuda)``, which would read "12.10" as 12.1; no CUDA
    12.10 exists (12.9 was the last 12.x), so tuples and floats agree on real versions.
    """
    if not version:
        return None
    parts = []
    for piece in str(version).split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) if parts else None


def _rule(key: str, cc: tuple[int, int], cuda: tuple[int, ...] | None) -> tuple[bool, str]:
    """TE 2.20's compute-capability rule for one format on a present GPU."""
    if key == "bf16":
        return (True, "") if cc >= (8, 0) else (False, REASON_BF16_CC)
    if key in ("fp8-delayed", "fp8-current"):
        if cc >= (9, 0):
            return True, ""
        if cc < (8, 9):
            return False, REASON_FP8_CC
        # Ada: TE also needs cuBLASLt >= 12.1.3, which only TE itself can check.
        if cuda is None or cuda < (12, 1):
            return False, REASON_FP8_ADA_CUDA
        return True, ""
    if key == "fp8-block":
        ok = cc >= (9, 0) and cuda is not None and cuda >= (12, 9)
        return (True, "") if ok else (False, REASON_FP8_BLOCK)
    if key == "mxfp8":
        if cc >= (12, 0):
            return False, REASON_MXFP8_SM120
        return (True, "") if cc >= (10, 0) else (False, REASON_MXFP8_CC)
    if key == "nvfp4":
        return (True, "") if cc >= (10, 0) else (False, REASON_NVFP4_CC)
    raise KeyError(key)


def _no_gpu_reason(key: str) -> str:
    if key == "bf16":
        return REASON_NO_GPU + " PyTorch still computes in BF16 on the CPU, without tensor cores."
    needs = {
        "fp8-delayed": "compute capability 8.9 or higher",
        "fp8-current": "compute capability 8.9 or higher",
        "fp8-block": "compute capability 9.0 or higher and CUDA >= 12.9",
        "mxfp8": "compute capability 10.x or 11.x",
        "nvfp4": "compute capability 10.0 or higher",
    }[key]
    return f"{REASON_NO_GPU} {_LABELS[key]} needs a GPU of {needs}."


def format_support(
    compute_capability: tuple[int, int] | None,
    cuda_version: str | None,
    te_info: TEInfo | None = None,
) -> dict[str, FormatSupport]:
    """Per-format native availability with reasons. Pure: no torch, no TE, no I/O.

    Args:
        compute_capability: ``(major, minor)`` of the GPU, e.g. ``(9, 0)`` for Hopper;
            ``None`` when there is no CUDA GPU.
        cuda_version: CUDA version torch was built with (``torch.version.cuda``, e.g.
            ``"12.8"``, ``"13.0"``); ``None`` on CPU-only builds.
        te_info: Transformer Engine's own answers (:attr:`TEInfo.checks`). Where TE
            answered a check, its verdict and reason win (TE also checks cuBLASLt on
            Ada); otherwise the compute-capability rules decide.

    Returns:
        ``{key: FormatSupport}`` for every key of :data:`FORMAT_KEYS`, in that order.

    Rules and reason strings: TE ``transformer_engine/pytorch/quantization.py``
    (``_compute_fp8_support``, ``_compute_fp8_block_scaling_support``,
    ``_compute_mxfp8_support``, ``_compute_nvfp4_support``).
    """
    if compute_capability is not None:
        compute_capability = (int(compute_capability[0]), int(compute_capability[1]))
    cuda = _parse_version(cuda_version)
    out: dict[str, FormatSupport] = {}
    for key in FORMAT_KEYS:
        te_answer = None
        if te_info is not None and compute_capability is not None and key in _TE_CHECK_FOR_FORMAT:
            te_answer = te_info.check(_TE_CHECK_FOR_FORMAT[key])
        if te_answer is not None:
            ok, reason = te_answer
            source = SOURCE_TE
        elif compute_capability is None:
            ok, reason, source = False, _no_gpu_reason(key), SOURCE_RULES
        else:
            ok, reason = _rule(key, compute_capability, cuda)
            source = SOURCE_RULES
        out[key] = FormatSupport(
            key=key,
            label=_LABELS[key],
            te_recipe=_TE_RECIPES[key],
            native=bool(ok),
            reason="" if ok else reason,
            source=source,
        )
    return out


def choose_mode(
    gpu_available: bool,
    te_importable: bool,
    nvfp4_native: bool,
    triton_version: str | None = None,
    triton_error: str | None = None,
) -> tuple[str, str]:
    """nvfp4lab's execution mode and why. Pure.

    * ``"native-te"``: TE imports and NVFP4 is native (SM >= 10.0) — TE's
      ``NVFP4BlockScaling`` runs on FP4 tensor cores.
    * ``"fast-emulation"``: a CUDA GPU without native NVFP4 (or without TE) —
      nvfp4lab's Triton kernels emulate NVFP4 on the GPU.
    * ``"cpu-emulation"``: no CUDA GPU — nvfp4lab's PyTorch reference on the CPU.

    Returns:
        ``(mode, reason)`` with ``mode`` in :data:`MODES`.
    """
    if te_importable and nvfp4_native:
        return "native-te", "Transformer Engine imports and this GPU runs NVFP4 natively (compute capability >= 10.0)."
    if gpu_available:
        if nvfp4_native:
            why = "This GPU runs NVFP4 natively but Transformer Engine is unavailable"
            why += f" (install it: {TE_INSTALL_COMMAND}); "
        else:
            why = "This GPU has no native NVFP4 (compute capability 10.0 or higher required); "
        why += "nvfp4lab emulates NVFP4 on the GPU with its Triton kernels"
        if triton_version:
            why += f" (Triton {triton_version})."
        else:
            why += f", but Triton does not import ({triton_error or 'not installed'})."
        return "fast-emulation", why
    return "cpu-emulation", "No CUDA GPU: nvfp4lab emulates NVFP4 with its PyTorch reference on the CPU (bit-exact, slow)."


def _fmt_gib(total_memory_bytes: int | None) -> str:
    return "" if total_memory_bytes is None else f", {total_memory_bytes / 2**30:.0f} GiB"


def _fp4_peak_text(compute_capability: tuple[int, int]) -> str:
    """The datasheet FP4-over-FP8 peaks of the GPUs of one compute capability (nvfp4lab.hardware), as text."""
    from .hardware import GPUS

    rows = [g for g in GPUS if g.compute_capability == tuple(compute_capability) and g.fp4_tflops]
    if not rows:
        return ""
    peaks = "; ".join(f"{g.name}: {g.fp4_tflops:,.0f} vs {g.fp8_tflops:,.0f} TFLOP/s" for g in rows)
    ratios = sorted({g.fp4_tflops / g.fp8_tflops for g in rows})
    ratio = " to ".join(f"{r:g}" for r in ratios)
    return f", with {ratio}× FP8's dense GEMM rate ({peaks}; datasheets, nvfp4lab.hardware)"


def recommend(
    compute_capability: tuple[int, int] | None,
    total_memory_bytes: int | None,
    formats: Mapping[str, FormatSupport],
    te_importable: bool,
) -> str:
    """What to train with here and why: the book's decision guide. Pure.

    Hardware decides what is *possible* (FP4 tensor cores from SM 10.0, FP8 from
    SM 8.9); memory and throughput decide between FP8 and NVFP4 where both are
    native. Byte counts per GEMM operand element: BF16 2, FP8 1 (+ scales),
    NVFP4 0.5625 (4-bit code + one E4M3 scale per 16 values).

    Args:
        compute_capability: ``(major, minor)`` or ``None``.
        total_memory_bytes: device memory, or ``None``.
        formats: :func:`format_support`'s result.
        te_importable: whether TE imports.
    """
    install = f"Transformer Engine is not available; install it with: {TE_INSTALL_COMMAND}"
    study = (
        "nvfp4lab's emulation (--backend nvfp4lab), which reproduces TE 2.20's NVFP4 quantization "
        "bit for bit on any machine, to study NVFP4"
    )
    if compute_capability is None:
        return (
            "No CUDA GPU: use nvfp4lab's CPU emulation to study NVFP4 numerics (quantization, RHT, "
            "stochastic rounding, training curves of small models); its quantization is bit-exact with "
            "TE 2.20 (stochastic rounding only statistically) but slow, "
            "and speed or memory savings cannot be measured without FP8/FP4 hardware."
        )
    cc = f"{compute_capability[0]}.{compute_capability[1]}"
    mem = _fmt_gib(total_memory_bytes)
    if formats["nvfp4"].native:
        text = (
            f"NVFP4 through TE (--backend te --precision nvfp4: NVFP4BlockScaling) when training is memory- or throughput-bound: "
            f"this GPU (SM {cc}{mem}) has FP4 tensor cores{_fp4_peak_text(compute_capability)}, "
            f"and GEMM operands take 0.5625 bytes per element instead of "
            f"1 (FP8) or 2 (BF16). "
            f"Keep the first and last blocks in BF16 (NVFP4Recipe.bf16_first_layers / bf16_last_layers, "
            f"applied with nested autocast), as the NVFP4 paper does. "
            f"When the model fits comfortably and compute is not the bottleneck, FP8 "
            f"({'MXFP8' if formats['mxfp8'].native else 'current scaling'}) is the lower-risk choice. "
        )
        if compute_capability >= (12, 0):
            text += (
                "Caution: TE trains NVFP4 on SM 10.0/10.3; SM 12.x (RTX 50) has known TE NVFP4 failures, "
                "e.g. stochastic rounding returning all-zero gradients (NVIDIA/TransformerEngine PR #3281) — "
                "compare against nvfp4lab's emulation before trusting a run. "
            )
        if not te_importable:
            text += install
        return text.strip()
    if formats["fp8-current"].native or formats["fp8-delayed"].native:
        fp8 = "Float8CurrentScaling or DelayedScaling"
        if formats["fp8-block"].native:
            fp8 += "; Float8BlockScaling, the block-scaled recipe closest to NVFP4, also runs here"
        text = (
            f"FP8 through TE (--backend te --precision fp8: {fp8}). Why: this GPU (SM {cc}{mem}) has FP8 tensor "
            f"cores but none for FP4 (no E2M1 conversion before SM 10.0), so NVFP4 can only be emulated here, "
            f"which costs time instead of saving it. If the model does not fit in memory even in FP8, "
            f"NVFP4 needs Blackwell (SM 10.0+). Use {study}; TE's reference CustomRecipe "
            f"(nvfp4-reference) is a slow cross-check only."
        )
        if not te_importable:
            text += " " + install
        return text
    return (
        f"BF16: this GPU (SM {cc}{mem}) has neither FP8 (SM 8.9+) nor FP4 (SM 10.0+) tensor cores, so "
        f"low-precision formats would only be emulated and slower than BF16. Use {study}."
    )


# --------------------------------------------------------------------------- environment


def _quiet_import(name: str):
    """Import ``name`` with its import-time warnings silenced; exceptions propagate."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def _exc_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


@functools.lru_cache(maxsize=None)
def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - broken metadata must not break the probe
            continue
    return None


def import_transformer_engine() -> tuple[Any | None, str | None, str | None]:
    """Try ``import transformer_engine.pytorch`` quietly.

    Returns:
        ``(module or None, version or None, error or None)``. ``error`` says why TE is
        unusable: not installed, or the import's exception (TE raises AssertionError
        on mismatched wheel versions, OSError on a missing core library, ...),
        followed by the install command. Warnings during the import are silenced.
    """
    if "transformer_engine" not in sys.modules:
        try:
            spec = importlib.util.find_spec("transformer_engine")
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return None, None, f"Transformer Engine is not installed. Install it with: {TE_INSTALL_COMMAND}"
    try:
        module = _quiet_import("transformer_engine.pytorch")
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, never raised
        version = _distribution_version("transformer-engine", "transformer_engine")
        name = f"Transformer Engine {version}" if version else "Transformer Engine"
        return None, version, (
            f"{name} is installed but does not import ({_exc_text(exc)}). "
            f"Reinstall it with: {TE_INSTALL_COMMAND}"
        )
    top = sys.modules.get("transformer_engine")
    version = (
        getattr(top, "__version__", None)
        or getattr(module, "__version__", None)
        or _distribution_version("transformer-engine", "transformer_engine")
    )
    return module, version, None


def _te_checks(te_pytorch: Any, names: Sequence[str] | None = None) -> dict[str, tuple[bool, str]]:
    """TE's own availability answers (needs a CUDA device); failures become reasons."""
    checks: dict[str, tuple[bool, str]] = {}
    for name, fn_name in TE_CHECK_FUNCTIONS.items():
        if names is not None and name not in names:
            continue
        fn = getattr(te_pytorch, fn_name, None)
        if fn is None:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ok, reason = fn(return_reason=True)
        except Exception as exc:  # noqa: BLE001
            ok, reason = False, f"transformer_engine.pytorch.{fn_name} failed: {_exc_text(exc)}"
        checks[name] = (bool(ok), str(reason))
    return checks


def _gpu_info() -> dict[str, Any]:
    """Device facts for the current CUDA device, from :func:`nvfp4lab.provenance.gpu_facts`."""
    import torch

    from .provenance import gpu_facts

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            available = bool(torch.cuda.is_available())
        except Exception:  # noqa: BLE001
            available = False
        info: dict[str, Any] = {
            "gpu_available": available,
            "device_name": "cpu",
            "device_count": 0,
            "compute_capability": None,
            "total_memory_bytes": None,
        }
        if not available:
            return info
        try:
            env = gpu_facts("cuda")
            info.update(device_name=env["device"], device_count=env["device_count"],
                        compute_capability=tuple(env["compute_capability"]),
                        total_memory_bytes=env["total_memory_bytes"])
        except Exception as exc:  # noqa: BLE001 - e.g. a driver problem after is_available()
            info.update(gpu_available=False, device_name=f"cpu (CUDA device unusable: {_exc_text(exc)})")
    return info


def _cuda_version() -> str | None:
    """CUDA version torch was built with (``torch.version.cuda``), ``None`` on CPU builds."""
    import torch

    return getattr(torch.version, "cuda", None)


def _software_info() -> dict[str, Any]:
    """Versions from :func:`nvfp4lab.provenance.software_versions`, and whether Triton imports."""
    from .provenance import software_versions

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = software_versions()
    triton_version, triton_error = None, None
    try:
        triton = _quiet_import("triton")
        triton_version = str(getattr(triton, "__version__", "unknown"))
    except Exception as exc:  # noqa: BLE001
        triton_error = _exc_text(exc)
    return {
        "python_version": env["python"],
        "platform": env["platform"],
        "torch_version": env["torch"],
        "cuda_version": _cuda_version(),
        "cudnn_version": env["cudnn"],
        "triton_version": triton_version,
        "triton_error": triton_error,
    }


def _te_info(gpu_available: bool) -> TEInfo:
    module, version, error = import_transformer_engine()
    if module is None:
        return TEInfo(version=version, importable=False, error=error)
    checks = _te_checks(module) if gpu_available else {}
    return TEInfo(version=version, importable=True, error=None, checks=checks)


def require_device(name: str):
    """The ``torch.device`` for ``name``, checked to exist on this machine.

    Args:
        name: a torch device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``).

    Returns:
        ``torch.device(name)``.

    Raises:
        ValueError: ``name`` is not a device string, names CUDA where CUDA is not available
            (a CPU-only torch build, or no GPU visible), or a CUDA index beyond the visible
            devices. The message is one line that says what to use instead.
    """
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {name!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
        raise ValueError(f"device {name!r} asked for, but CUDA is not available here (torch {torch.__version__}, "
                         f"{why}); use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


def probe() -> Capabilities:
    """Probe this machine (CUDA device 0 / the current device). No warnings, no exceptions
    from missing GPU, TE or Triton: absences are reported in the result.

    Returns:
        :class:`Capabilities`.
    """
    # Import TE before anything asks torch for cuDNN: on a machine whose system cuDNN differs
    # from torch's bundled one, the other order makes TE's import fail (seen on the lent H200:
    # "undefined symbol ... libcudnn_heuristic.so.9"). import_transformer_engine never raises.
    import_transformer_engine()
    sw = _software_info()
    gpu = _gpu_info()
    te = _te_info(gpu["gpu_available"])
    cc = gpu["compute_capability"] if gpu["gpu_available"] else None
    formats = format_support(cc, sw["cuda_version"], te if te.importable else None)
    mode, mode_reason = choose_mode(
        gpu["gpu_available"], te.importable, formats["nvfp4"].native, sw["triton_version"], sw["triton_error"]
    )
    return Capabilities(
        **sw,
        **gpu,
        transformer_engine=te,
        formats=tuple(formats[k] for k in FORMAT_KEYS),
        mode=mode,
        mode_reason=mode_reason,
        recommendation=recommend(cc, gpu["total_memory_bytes"], formats, te.importable),
    )


def recipe_support(key: str, te_pytorch: Any | None = None) -> FormatSupport:
    """Cheap runtime check for one format on the current CUDA device (used by
    :func:`nvfp4lab.te.autocast` before every ``te.autocast`` entry).

    Args:
        key: one of :data:`FORMAT_KEYS`.
        te_pytorch: the imported ``transformer_engine.pytorch`` module, whose
            ``is_*_available(return_reason=True)`` answers are used; ``None`` → rules only.

    Returns:
        the :class:`FormatSupport` that :func:`probe` would report for ``key``.
    """
    if key not in FORMAT_KEYS:
        raise KeyError(f"unknown format {key!r}; expected one of {FORMAT_KEYS}")
    gpu = _gpu_info()
    cc = gpu["compute_capability"] if gpu["gpu_available"] else None
    te = None
    if te_pytorch is not None and cc is not None and key in _TE_CHECK_FOR_FORMAT:
        name = _TE_CHECK_FOR_FORMAT[key]
        te = TEInfo(importable=True, checks=_te_checks(te_pytorch, [name]))
    return format_support(cc, _cuda_version(), te)[key]


# --------------------------------------------------------------------------- presentation


def format_table(caps: Capabilities) -> str:
    """Human-readable report of :class:`Capabilities` (plain text, ~80 columns)."""
    te = caps.transformer_engine
    if caps.gpu_available:
        cc = caps.compute_capability
        device = f"{caps.device_name} (SM {cc[0]}.{cc[1]}, {caps.total_memory_gib:.1f} GiB)"
        if caps.device_count > 1:
            device += f", {caps.device_count} GPUs"
    else:
        device = caps.device_name
    if te.importable:
        te_line = te.version or "installed (version unknown)"
    else:
        te_line = f"unavailable — {te.error}"
    rows = [
        ("device", device),
        ("python", caps.python_version),
        ("torch", caps.torch_version),
        ("CUDA (torch)", caps.cuda_version or "none (CPU build)"),
        ("cuDNN", caps.cudnn_version or "none"),
        ("Triton", caps.triton_version or f"none ({caps.triton_error})"),
        ("Transformer Engine", te_line),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["nvfp4lab probe", ""]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["", "format                native  TE recipe             why not / source"]
    for f in caps.formats:
        why = f.reason if not f.native else f"({f.source})"
        lines.append(f"{f.label:<21} {'yes' if f.native else 'no':<7} {f.te_recipe or '-':<21} {why}")
    lines += ["", f"mode: {caps.mode} — {caps.mode_reason}", "", f"recommendation: {caps.recommendation}"]
    return "\n".join(lines)


_DESCRIPTION = (
    "Report device, versions, Transformer Engine, per-format native support "
    "(BF16, FP8, MXFP8, NVFP4), nvfp4lab's mode and a recommendation."
)


def _build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--json", action="store_true", help="print Capabilities.to_dict() as JSON")
    parser.set_defaults(func=run_probe_command)
    return parser


def add_probe_subcommand(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``probe`` on an ``argparse`` sub-parser collection.

    Usage in the CLI::

        sub = parser.add_subparsers(dest="command", required=True)
        add_probe_subcommand(sub)
        args = parser.parse_args(argv)
        return args.func(args)          # run_probe_command(args) -> exit status 0

    Returns:
        the ``probe`` sub-parser (``--json`` flag; ``func`` default set to :func:`run_probe_command`).
    """
    p = subparsers.add_parser(
        "probe",
        help="report GPU, software and native FP8/MXFP8/NVFP4 support, and what to use",
        description=_DESCRIPTION,
    )
    return _build_parser(p)


def run_probe_command(args: argparse.Namespace) -> int:
    """Run the probe for parsed ``args`` (``args.json``); print; return exit status 0."""
    caps = probe()
    if getattr(args, "json", False):
        print(json.dumps(caps.to_dict(), indent=2))
    else:
        print(format_table(caps))
    return 0


def main_probe(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m nvfp4lab.capabilities [--json]``. Returns the exit status."""
    parser = _build_parser(argparse.ArgumentParser(prog="nvfp4lab probe", description=_DESCRIPTION))
    args = parser.parse_args(list(argv) if argv is not None else None)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main_probe())
