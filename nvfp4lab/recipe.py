"""The NVFP4 training recipe as a validated configuration object.

:class:`NVFP4Recipe` mirrors Transformer Engine 2.20's ``recipe.NVFP4BlockScaling``
(``transformer_engine/common/recipe/__init__.py`` L489-627, spec section 6) for the three
switches that change numerics, and adds the part TE leaves to the user: which linear layers
stay in high precision (the paper, arXiv 2509.25149, keeps ~15% of linear layers in BF16,
mostly the last blocks; background section 1).

What each tensor gets (spec section 3, TE ``__post_init__``)::

    role                      block          RHT                 rounding
    input,  rowwise  (Fprop)  1x16           no                  RNE
    input,  columnwise(Wgrad) 1x16 (tokens)  yes unless disabled RNE
    weight (Fprop and Dgrad)  16x16 (2D)     no                  RNE
                              1x16 if disable_2d_quantization
    grad_output, rowwise      1x16           no                  SR unless disabled
    grad_output, columnwise   1x16 (tokens)  yes unless disabled SR unless disabled

Everything that is not the GEMM of a quantized ``nn.Linear`` (embeddings, norms, the
attention core ``softmax(QK^T)V``, non-linearities, the loss, master weights, gradients and
optimizer state) stays in high precision; that is not configurable here because TE's recipe
does not quantize it either (``fp8_dpa=False``, ``fp8_mha=False``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .precisions import canonical_name, get_precision

__all__ = ["NVFP4Recipe", "QUANTIZATION_ROLES", "FOUR_OVER_SIX_SCOPES", "FOUR_OVER_SIX_ERR_MODES", "BACKWARD_OVERRIDES", "DEFAULT_BLOCK_PATTERN", "block_index", "layer_is_quantized"]

#: The quantization roles of a linear layer, see :meth:`NVFP4Recipe.quantize_options`.
QUANTIZATION_ROLES = (
    "input_rowwise",
    "input_columnwise",
    "weight",
    "weight_columnwise",
    "grad_output_rowwise",
    "grad_output_columnwise",
)

_TE_ENV = {
    "disable_rht": "NVTE_NVFP4_DISABLE_RHT",
    "disable_stochastic_rounding": "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING",
    "disable_2d_quantization": "NVTE_NVFP4_DISABLE_2D_QUANTIZATION",
    "row_scaled_activation": "NVTE_NVFP4_ROW_SCALED_ACTIVATION",
}
#: String fields read from the environment as they are (TE recipe ``__init__.py``).
_TE_ENV_STR = {
    "nvfp4_4over6": "NVTE_NVFP4_4OVER6",
    "nvfp4_4over6_e4m3_use_256": "NVTE_NVFP4_4OVER6_E4M3_USE_256",
    "nvfp4_4over6_err_mode": "NVTE_NVFP4_4OVER6_ERR_MODE",
    "backward_override": "NVTE_BACKWARD_OVERRIDE",
}

#: The scopes of ``nvfp4_4over6`` and ``nvfp4_4over6_e4m3_use_256`` (TE ``NVFP4BlockScaling``).
FOUR_OVER_SIX_SCOPES = ("none", "weights", "activations", "all")
#: The error measures 4over6 picks a block's candidate by.
FOUR_OVER_SIX_ERR_MODES = ("MAE", "MSE")
#: TE's ``backward_override`` values (``None``: the backward GEMMs are quantized too).
BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


def recipe_from_dict(cls: type, data: Mapping[str, Any] | None):
    """Build the recipe dataclass ``cls`` from a ``to_dict()`` mapping (``None``: defaults; an
    instance is returned as is). Unknown keys raise ``ValueError`` naming them."""
    if data is None:
        return cls()
    if isinstance(data, cls):
        return data
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s): {sorted(unknown)}")
    return cls(**dict(data))


@dataclass(frozen=True)
class NVFP4Recipe:
    """Configuration of emulated NVFP4 training (immutable; validated on construction).

    The numerics fields have the names and defaults of TE's ``NVFP4BlockScaling``
    (``transformer_engine/common/recipe/__init__.py``); the layer-selection fields are not in TE
    and follow the paper (arXiv 2509.25149, appendix A.1) as closely as a small model allows.

    Attributes:
        disable_rht: skip the 16-point random Hadamard transform on the Wgrad operands (the
            columnwise copies of the input and of grad_output). Default False.
        disable_stochastic_rounding: round grad_output to nearest-even instead of
            stochastically (both copies). Default False.
        disable_2d_quantization: quantize weights with 1x16 blocks (rowwise for Fprop, an
            independent columnwise quantization for Dgrad) instead of one 16x16 tile scale
            shared by W and W^T. Default False.
        bf16_first_layers: leading transformer blocks whose linear layers stay in high
            precision. Default 1.
        bf16_last_layers: trailing transformer blocks whose linear layers stay in high
            precision. Default 1. The paper keeps mostly the *last* blocks (for its 12B model the
            first 2 and last 8 of 62, about 16% of the linear layers); with 4-12 blocks, one block
            at each end is the closest round number.
        quantize_lm_head: whether linear layers outside the numbered blocks (the LM head) are
            quantized. Default False: the paper keeps the output head in BF16.
        row_scaled_activation: one FP32 amax per row (token) for the forward activation
            (the rowwise input copy) instead of one per tensor (TE ``NVFP4BlockScaling``,
            env ``NVTE_NVFP4_ROW_SCALED_ACTIVATION``). Needs ``disable_rht=True``. Default False.
            nvfp4lab row-scales the Fprop copy only, as TE's reference quantizer does (spec section
            2: "Row-scaled mode is rowwise only"). TE 2.20's native kernels also row-scale the
            columnwise (Wgrad) copy (TE PR #3206), and reject row scaling together with 4over6 on
            activations wherever they make that copy, i.e. in training
            (``common/cast/dispatch/quantize.cuh``: "Row-scaled NVFP4 transpose quantization is
            not supported with 4over6 mode"); nvfp4lab runs that combination, in emulation only.
        nvfp4_4over6: where 4over6 runs: ``"none"``, ``"weights"``, ``"activations"`` or
            ``"all"`` (TE field, env ``NVTE_NVFP4_4OVER6``). Per block, the map-to-6 scale
            (``amax/6``) and the map-to-4 scale (``1.5x``, block max on FP4 value 4) are both
            tried and the one with the lower error kept (arXiv 2512.02010). Never gradients.
            ``"activations"``/``"all"`` need ``disable_rht=True``. Default ``"none"``.
        nvfp4_4over6_e4m3_use_256: where (same scopes) the global scale uses 256 instead of 448
            as E4M3 bound, leaving room for the 1.5x map-to-4 scale (env
            ``NVTE_NVFP4_4OVER6_E4M3_USE_256``). Only matters where 4over6 is on. Default ``"all"``.
        nvfp4_4over6_err_mode: ``"MAE"`` or ``"MSE"``, the error 4over6 compares (env
            ``NVTE_NVFP4_4OVER6_ERR_MODE``). Default ``"MAE"``.
        backward_override: ``None`` (backward GEMMs quantized as above), ``"high_precision"``
            or ``"dequantized"`` (TE field, env ``NVTE_BACKWARD_OVERRIDE``). Validated and kept for
            TE; nvfp4lab's emulated layers do not act on it yet (see :meth:`quantize_options`).

    Raises:
        ValueError: a field has the wrong type (booleans must be ``bool``, layer counts
            non-negative ``int``), or the combination is invalid: see :meth:`validate`.
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    bf16_first_layers: int = 1
    bf16_last_layers: int = 1
    quantize_lm_head: bool = False
    row_scaled_activation: bool = False
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    backward_override: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def four_over_six(self, operand: str) -> bool:
        """Whether 4over6 is on for ``operand`` (``"weights"`` or ``"activations"``)."""
        return self.nvfp4_4over6 in (operand, "all")

    def e4m3_max(self, operand: str) -> int:
        """The E4M3 bound of ``operand``'s global scale: 256 where 4over6 is on and
        ``nvfp4_4over6_e4m3_use_256`` covers the operand, else 448 (TE reference
        ``NVFP4QuantizerRef``: ``nvfp4_e4m3_max if nvfp4_use_4over6 else 448``)."""
        if self.four_over_six(operand) and self.nvfp4_4over6_e4m3_use_256 in (operand, "all"):
            return 256
        return 448

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every field; raise ``ValueError`` naming the first problem found."""
        for name in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization",
                     "quantize_lm_head"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"NVFP4Recipe.{name} must be a bool, got {value!r}")
        for name in ("bf16_first_layers", "bf16_last_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"NVFP4Recipe.{name} must be an int, got {value!r}")
            if value < 0:
                raise ValueError(f"NVFP4Recipe.{name} must be >= 0, got {value}")
        if not isinstance(self.row_scaled_activation, bool):
            raise ValueError(f"NVFP4Recipe.row_scaled_activation must be a bool, got {self.row_scaled_activation!r}")
        for name in ("nvfp4_4over6", "nvfp4_4over6_e4m3_use_256"):
            value = getattr(self, name)
            if value not in FOUR_OVER_SIX_SCOPES:
                raise ValueError(f"NVFP4Recipe.{name} must be one of {FOUR_OVER_SIX_SCOPES}, got {value!r}")
        if self.nvfp4_4over6_err_mode not in FOUR_OVER_SIX_ERR_MODES:
            raise ValueError(f"NVFP4Recipe.nvfp4_4over6_err_mode must be one of {FOUR_OVER_SIX_ERR_MODES}, "
                             f"got {self.nvfp4_4over6_err_mode!r}")
        if self.backward_override not in BACKWARD_OVERRIDES:
            raise ValueError(f"NVFP4Recipe.backward_override must be one of {BACKWARD_OVERRIDES}, "
                             f"got {self.backward_override!r}")
        # TE 2.20 implements neither 4over6 nor row scaling together with the RHT: the recipe raises
        # "NVFP4 4over6 quantization does not support RHT." for inputs with input RHT on, and the C++
        # quantizer rejects row-scaled mode with RHT (spec sections 2 and 6). The RHT only touches the
        # columnwise (Wgrad) copy of the activation, which these modes would also quantize.
        if self.four_over_six("activations") and not self.disable_rht:
            raise ValueError(
                f"NVFP4Recipe.nvfp4_4over6={self.nvfp4_4over6!r} quantizes activations with 4over6, which TE 2.20 "
                "does not support together with the RHT: set disable_rht=True (or nvfp4_4over6='weights')")
        if self.row_scaled_activation and not self.disable_rht:
            raise ValueError(
                "NVFP4Recipe.row_scaled_activation=True is rejected by TE 2.20 together with the RHT: "
                "set disable_rht=True")

    def check_num_blocks(self, num_blocks: int) -> None:
        """Check the layer selection against a model with ``num_blocks`` transformer blocks.

        Raises ``ValueError`` if ``bf16_first_layers + bf16_last_layers`` exceeds the number of
        blocks (the two ranges would overlap), or if the selection quantizes nothing at all
        (every block kept in BF16 and the LM head not quantized), which would silently turn an
        "NVFP4" run into a BF16 run.
        """
        keep = self.bf16_first_layers + self.bf16_last_layers
        if keep > num_blocks:
            raise ValueError(
                f"NVFP4Recipe keeps bf16_first_layers={self.bf16_first_layers} + "
                f"bf16_last_layers={self.bf16_last_layers} = {keep} blocks in BF16, but the model "
                f"has only {num_blocks} blocks")
        if keep == num_blocks and not self.quantize_lm_head:
            raise ValueError(
                f"NVFP4Recipe keeps all {num_blocks} blocks in BF16 and does not quantize the LM "
                "head: no linear layer would be NVFP4. Lower bf16_first_layers/bf16_last_layers.")

    def block_is_quantized(self, index: int, num_blocks: int) -> bool:
        """True if block ``index`` (0-based) of ``num_blocks`` runs its linear layers in NVFP4."""
        if not 0 <= index < num_blocks:
            raise ValueError(f"block index {index} out of range for {num_blocks} blocks")
        return self.bf16_first_layers <= index < num_blocks - self.bf16_last_layers

    # ------------------------------------------------------------------ numerics per role
    def quantize_options(self, role: str) -> dict[str, Any]:
        """Keyword arguments for :func:`nvfp4lab.quantize.quantize` for one tensor role.

        ``role`` is one of :data:`QUANTIZATION_ROLES`. Columnwise roles are meant for the
        transposed tensor (tokens on the last axis). Source: TE's ``NVFP4BlockScaling.__post_init__``
        (``fp4_quant_fwd_inp``, ``fp4_quant_fwd_weight``, ``fp4_quant_bwd_grad``) and spec 3-5.
        """
        sr = "nearest" if self.disable_stochastic_rounding else "stochastic"
        rht = not self.disable_rht
        weight_block = "1d" if self.disable_2d_quantization else "2d"
        table = {
            "input_rowwise": dict(block="1d", rht=False, rounding="nearest"),
            "input_columnwise": dict(block="1d", rht=rht, rounding="nearest"),
            "weight": dict(block=weight_block, rht=False, rounding="nearest"),
            "weight_columnwise": dict(block=weight_block, rht=False, rounding="nearest"),
            "grad_output_rowwise": dict(block="1d", rht=False, rounding=sr),
            "grad_output_columnwise": dict(block="1d", rht=rht, rounding=sr),
        }
        try:
            options = dict(table[role])
        except KeyError:
            raise ValueError(f"unknown quantization role {role!r}; expected one of "
                             f"{QUANTIZATION_ROLES}") from None
        # 4over6: TE's quantizer factory turns it on for the weight and input quantizers of the
        # scope, never for gradients (spec section 2, "Never applied to gradients").
        operand = {"input_rowwise": "activations", "input_columnwise": "activations",
                   "weight": "weights", "weight_columnwise": "weights"}.get(role)
        if operand is not None and self.four_over_six(operand):
            options.update(four_over_six=True, e4m3_max=self.e4m3_max(operand),
                           err_mode=self.nvfp4_4over6_err_mode)
        # Row-scaled: one FP32 amax per row for the forward (rowwise, Fprop) activation only;
        # TE's row-scaled mode is rowwise only and 1x16 only (reference ``_quantize``).
        if role == "input_rowwise" and self.row_scaled_activation:
            options.update(row_scaled=True)
        return options

    # ------------------------------------------------------------------ (de)serialisation
    def replace(self, **changes: Any) -> "NVFP4Recipe":
        """A copy with some fields changed (validated again)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown NVFP4Recipe field(s): {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "NVFP4Recipe":
        """Inverse of :meth:`to_dict`; ``None`` gives the defaults. Unknown keys raise ``ValueError``."""
        return recipe_from_dict(cls, data)

    @classmethod
    def from_te_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "NVFP4Recipe":
        """Defaults taken from TE's environment variables (``NVTE_NVFP4_DISABLE_RHT=1`` etc.).

        TE reads these once, when ``NVFP4BlockScaling`` is defined; here they are read when this
        is called. A value other than ``"0"``/``"1"`` raises ``ValueError``.
        """
        environ = os.environ if environ is None else environ
        fields: dict[str, Any] = {}
        for field, var in _TE_ENV.items():
            raw = environ.get(var)
            if raw is None:
                continue
            if raw not in ("0", "1"):
                raise ValueError(f"{var} must be '0' or '1', got {raw!r}")
            fields[field] = raw == "1"
        for field, var in _TE_ENV_STR.items():
            raw = environ.get(var)
            if raw is not None:
                fields[field] = raw.upper() if field == "nvfp4_4over6_err_mode" else raw
        fields.update(overrides)
        return cls.from_dict(fields)

    def describe(self) -> str:
        """One line summary, e.g. ``'RHT+SR+2D, BF16 blocks first 1/last 1, head BF16'``."""
        parts = [name for name, off in (("RHT", self.disable_rht),
                                        ("SR", self.disable_stochastic_rounding),
                                        ("2D", self.disable_2d_quantization)) if not off]
        head = "head NVFP4" if self.quantize_lm_head else "head BF16"
        return (f"{'+'.join(parts) or 'no RHT/SR/2D'}, BF16 blocks first "
                f"{self.bf16_first_layers}/last {self.bf16_last_layers}, {head}")


#: Where a module name carries its transformer-block index: ``blocks.3.mlp.fc`` (nvfp4lab's GPT),
#: ``h.3.`` (GPT-2 in Hugging Face), ``layers.3.`` (LLaMA); group 1 is the index.
DEFAULT_BLOCK_PATTERN = r"(?:^|\.)(?:blocks|h|layers)\.(\d+)\."


def block_index(name: str, block_pattern: str = DEFAULT_BLOCK_PATTERN) -> int | None:
    """The transformer-block index in a module name (``"blocks.3.mlp.fc"`` -> 3), or ``None``
    for a layer outside the blocks (the LM head)."""
    m = re.search(block_pattern, name + ".")
    return int(m.group(1)) if m else None


def layer_is_quantized(name: str, precision: str, num_blocks: int, recipe: "NVFP4Recipe | None" = None, *,
                       block_pattern: str = DEFAULT_BLOCK_PATTERN) -> bool:
    """Whether the linear layer ``name`` runs its GEMMs in ``precision``'s low-precision format.

    The one rule for which layers are quantized, used by :func:`nvfp4lab.convert_model`, the TE
    model (:func:`nvfp4lab.te_model.quantized_blocks`) and the book's memory count:

    * ``fp32`` / ``bf16``: none;
    * FP8, MXFP8 and MXFP4 recipes: every linear layer inside the transformer blocks (TE quantizes every
      ``te.Linear`` under its autocast; the LM head is plain torch and stays high precision);
    * ``nvfp4`` / ``nvfp4-reference``: the layers of the blocks the recipe quantizes (all but its
      ``bf16_first_layers`` and ``bf16_last_layers``; paper §4.1 keeps about 15% of the linear layers,
      mostly the last blocks, in BF16), and the LM head only if ``recipe.quantize_lm_head``.

    Args:
        name: module name (``"blocks.3.attn.qkv"``; see :func:`block_index`).
        precision: a name of :mod:`nvfp4lab.precisions` (aliases accepted).
        num_blocks: transformer blocks in the model.
        recipe: the NVFP4 recipe (default ``NVFP4Recipe()``); ignored for other precisions.
        block_pattern: regex whose group 1 is the block index.

    Raises:
        ValueError: unknown precision, or (NVFP4 precisions, whose recipe chooses blocks by
            index) a block index outside ``num_blocks``.
    """
    p = canonical_name(precision)
    if not get_precision(p).quantized:
        return False
    b = block_index(name, block_pattern)
    if p not in ("nvfp4", "nvfp4-reference"):
        return b is not None
    recipe = NVFP4Recipe() if recipe is None else recipe
    return recipe.quantize_lm_head if b is None else recipe.block_is_quantized(b, num_blocks)
