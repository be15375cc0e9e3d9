"""The precision table: every training precision nvfp4lab names, in one place.

One row per precision name, saying what it is, which Transformer Engine recipe runs it natively,
which of TE's availability checks answers for it, and whether nvfp4lab emulates it. The CLI's
``--precision`` choices, :func:`nvfp4lab.convert_model`, the TE model builder and the capability
probe all read this table; nothing else lists precision names.

``mxfp4`` (E2M1 elements, E8M0 scales per 32 elements, :mod:`nvfp4lab.mx`) is emulated only: TE 2.20
has no MXFP4 recipe, so it has no ``te_recipe`` and the ``te`` backend does not list it.

Sources: TE 2.20's recipe classes (``transformer_engine/common/recipe/__init__.py``) and its
availability functions (``transformer_engine/pytorch/quantization.py``: ``is_fp8_available``,
``is_fp8_block_scaling_available``, ``is_mxfp8_available``, ``is_nvfp4_available``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Precision", "PRECISIONS", "ALIASES", "EMULATED", "TE_BACKEND", "FORMAT_KEYS", "get_precision",
    "canonical_name",
]


@dataclass(frozen=True)
class Precision:
    """One training precision.

    Attributes:
        name: the name used on the command line and in result files (``"fp8-current"``).
        label: how the book and tables print it (``"FP8 current scaling"``).
        te_recipe: TE 2.20's recipe class that runs it natively (``"Float8CurrentScaling"``), or
            ``None`` for the unquantized precisions.
        te_check: the key of TE's availability function that answers for it (``"fp8"`` for
            ``te.is_fp8_available``), or ``None``.
        emulated: nvfp4lab's own layers emulate it (``nvfp4lab`` backend, any device).
        format_key: listed by the capability probe as a hardware format.
        quantized: its linear layers run quantized GEMMs (False for ``fp32`` / ``bf16``). A quantized
            precision without ``te_recipe`` (``mxfp4``: TE 2.20 has no MXFP4 recipe) is emulated only.
    """

    name: str
    label: str
    te_recipe: str | None
    te_check: str | None
    emulated: bool
    format_key: bool = True
    quantized: bool = True


#: Every precision, in the order they are reported.
PRECISIONS: tuple[Precision, ...] = (
    Precision("fp32", "FP32", None, None, emulated=True, format_key=False, quantized=False),
    Precision("bf16", "BF16", None, None, emulated=True, quantized=False),
    Precision("fp8-delayed", "FP8 delayed scaling", "DelayedScaling", "fp8", emulated=True),
    Precision("fp8-current", "FP8 current scaling", "Float8CurrentScaling", "fp8", emulated=True),
    Precision("fp8-block", "FP8 block scaling", "Float8BlockScaling", "fp8_block_scaling", emulated=True),
    Precision("mxfp8", "MXFP8", "MXFP8BlockScaling", "mxfp8", emulated=True),
    Precision("mxfp4", "MXFP4", None, None, emulated=True, format_key=False, quantized=True),
    Precision("nvfp4", "NVFP4", "NVFP4BlockScaling", "nvfp4", emulated=True),
    Precision("nvfp4-reference", "NVFP4, TE's reference quantizer", "CustomRecipe", None, emulated=False,
              format_key=False),
)

#: Other spellings accepted wherever a precision name is: ``fp8`` is FP8 current scaling.
ALIASES: dict[str, str] = {"fp8": "fp8-current"}

_BY_NAME = {p.name: p for p in PRECISIONS}

#: Names the ``nvfp4lab`` backend trains (aliases included), in table order.
EMULATED: tuple[str, ...] = tuple(p.name for p in PRECISIONS if p.emulated) + tuple(
    a for a, target in ALIASES.items() if _BY_NAME[target].emulated)
#: Names the ``te`` backend trains (aliases included): the unquantized ones and every TE recipe.
TE_BACKEND: tuple[str, ...] = tuple(p.name for p in PRECISIONS if not p.quantized or p.te_recipe is not None) + tuple(
    a for a, target in ALIASES.items() if not _BY_NAME[target].quantized or _BY_NAME[target].te_recipe is not None)
#: Hardware formats reported by the capability probe, in order.
FORMAT_KEYS: tuple[str, ...] = tuple(p.name for p in PRECISIONS if p.format_key)


def canonical_name(name: str) -> str:
    """``name`` with an alias resolved (``"fp8"`` -> ``"fp8-current"``).

    Raises:
        ValueError: ``name`` is neither a precision nor an alias; the message lists them all.
    """
    name = ALIASES.get(name, name)
    if name not in _BY_NAME:
        known = ", ".join([p.name for p in PRECISIONS] + list(ALIASES))
        raise ValueError(f"unknown precision {name!r}; choose one of {known}")
    return name


def get_precision(name: str) -> Precision:
    """The :class:`Precision` row for ``name`` (aliases accepted).

    Raises:
        ValueError: unknown name (see :func:`canonical_name`).
    """
    return _BY_NAME[canonical_name(name)]
