"""The small GPT of :mod:`nvfp4lab.model` built from Transformer Engine modules (``--backend te``).

Same :class:`~nvfp4lab.model.GPTConfig` and presets, same ``forward(idx, targets) -> (logits,
loss)`` contract, same top-level parameter names (``wte``, ``wpe``, ``blocks.<i>``, ``ln_f``,
``lm_head``) as :class:`nvfp4lab.model.GPT`, so the trainer can use either. Structure::

    tokens [B, T] -> wte + wpe                                  plain torch (BF16 under autocast)
    with te.autocast(recipe):                                    nvfp4lab.te.autocast (checked first)
        for i, block in enumerate(blocks):                       TE block (below), "bshd" layout
            block(x)            if block i is quantized
            else: with te.autocast(enabled=False): block(x)     first/last N blocks stay BF16
    ln_f -> lm_head (tied to wte)                                plain torch (BF16 under autocast)

Two block implementations (``block_impl``), both pre-LayerNorm causal self-attention with fused
QKV and a GELU MLP, bias-free unless ``config.bias``:

* ``"transformer_layer"`` (default for every precision but ``nvfp4-reference``): one
  ``te.TransformerLayer`` per block, created with ``fuse_qkv_params=True`` and
  ``qkv_weight_interleaved=False`` so that its fused QKV weight has nanoGPT's row layout.
* ``"modules"`` (default for ``nvfp4-reference``): the block spelled out with TE's GEMM modules,
  ``attn.qkv = te.LayerNormLinear`` (ln_1 fused in), ``attn.core = te.DotProductAttention``,
  ``attn.proj = te.Linear``, ``mlp.fc = te.LayerNormLinear`` (ln_2 fused in), torch's exact
  GELU, ``mlp.proj = te.Linear``. Parameter names then follow nvfp4lab's GPT. This is the
  variant that trains under TE's NVFP4 reference recipe (see "nvfp4-reference" below); it runs
  every recipe (the GPU tests train both variants under FP8 current scaling).

The ``"transformer_layer"`` weights map onto nanoGPT's as follows::

    nvfp4lab.model.GPT                  TEGPT (TE 2.20 parameter names)
    blocks.i.ln_1.weight                blocks.i.self_attention.layernorm_qkv.layer_norm_weight
    blocks.i.attn.qkv.weight [3C, C]    blocks.i.self_attention.layernorm_qkv.weight   (q|k|v rows)
    blocks.i.attn.proj.weight           blocks.i.self_attention.proj.weight
    blocks.i.ln_2.weight                blocks.i.layernorm_mlp.layer_norm_weight
    blocks.i.mlp.fc.weight              blocks.i.layernorm_mlp.fc1_weight
    blocks.i.mlp.proj.weight            blocks.i.layernorm_mlp.fc2_weight

and for ``"modules"``: ``blocks.i.attn.qkv.{layer_norm_weight, weight}`` (ln_1, attn.qkv),
``blocks.i.attn.proj.weight``, ``blocks.i.mlp.fc.{layer_norm_weight, weight}`` (ln_2, mlp.fc),
``blocks.i.mlp.proj.weight``. (:data:`GPT_TO_TE` and :data:`GPT_TO_TE_MODULES` have the full
tables; :func:`gpt_to_te_state_dict` converts a state dict.)
:func:`build_te_model` first builds an :class:`nvfp4lab.model.GPT` on the CPU and copies its
weights in, so with the same ``torch.manual_seed`` both backends start from the same weights.

What differs from :class:`nvfp4lab.model.GPT` (TE's modules fix it):

* LayerNorms have a bias (``layer_norm_bias``, initialised to 0 and trained) even when
  ``config.bias`` is False; TE's LayerNorm always has one.
* With ``"transformer_layer"`` the MLP activation is TE's ``"gelu"``, the tanh approximation of
  GELU (torch's ``F.gelu`` default is the exact erf form; they differ by < 1e-3 absolute).
  ``"modules"`` uses torch's exact GELU, as nvfp4lab's GPT.
* The attention core runs in TE's ``DotProductAttention`` (cuDNN / flash backends) in the
  activation dtype (BF16 under autocast), whatever ``config.attn_precision`` says. It is never
  quantized (TE recipes have ``fp8_dpa=False``).
* Under ``torch.autocast`` the residual stream is cast to the autocast dtype before the first
  block (TE's fused bias-dropout-add expects one dtype); nvfp4lab's GPT keeps it in FP32.
* Dropout is TE's (``hidden_dropout`` / ``attention_dropout`` = ``config.dropout``).

Precisions (:data:`TE_PRECISIONS`, the ``precision`` argument):

* ``"fp32"`` / ``"bf16"``: no TE autocast; the trainer's ``torch.autocast`` (or its absence)
  decides the dtype. Parameters are FP32 master weights either way.
* ``"fp8"`` (= ``"fp8-current"``), ``"fp8-delayed"``, ``"fp8-block"``, ``"mxfp8"``: every block
  under that TE recipe (as :func:`nvfp4lab.linear.convert_model` does for ``"fp8"``).
* ``"nvfp4"``: ``NVFP4BlockScaling`` with the :class:`~nvfp4lab.recipe.NVFP4Recipe` flags;
  the recipe's ``bf16_first_layers`` / ``bf16_last_layers`` blocks run under a nested
  ``autocast(enabled=False)``. Needs compute capability >= 10.0: on Hopper
  :func:`build_te_model` raises :class:`~nvfp4lab.te.NVFP4NotSupported` before anything runs.
* ``"nvfp4-reference"``: TE's pure-PyTorch NVFP4 emulation (``CustomRecipe`` with
  ``nvfp4_ref_rht_2d_factory``'s quantizers), same layer selection; runs on Hopper but is very
  slow and needs bias-free GEMMs, K % 32 == 0 and tokens % 16 == 0 (TE custom_recipes/reference_nvfp4.py::qgemm).
  In TE 2.20.2 ``te.LayerNormMLP`` (hence ``te.TransformerLayer``) cannot be trained with it;
  both failures seen on an H100/H200, 2026-11-22, in ``module/layernorm_mlp.py``'s backward:

  1. FC2 Wgrad: the FC2-input quantizer is asked for a columnwise copy only when it is one of
     TE's native block quantizers (``fc2_input_quantizer.set_usage(columnwise=isinstance(...))``),
     so the reference quantizer skips it and ``NVFP4TensorRef._create_transpose`` later transposes
     the *packed* FP4 bytes (our reading of the code; 512 = 2 x 256 tokens fits it): "K dimension
     mismatch between qx and qw: qx has K=256, qw has K=512".
     (Quantizers that always make their columnwise copy would avoid this one, but not the next.)
  2. FC1 Wgrad: the GEMM is called with ``grad=fuse_gemm_and_bias_fc1_wgrad``, False without a
     bias, and ``custom_recipes/gemm.py::custom_gemm`` takes ``grad=False`` to mean Fprop, so it
     runs its Fprop branch on the Wgrad operands: "K dimension mismatch between qx and qw: qx has
     K=256, qw has K=64" (traceback through ``fc1_wgrad_gemm`` and ``custom_gemm``'s Fprop call).

  So ``nvfp4-reference`` uses the ``"modules"`` blocks (``te.LayerNormLinear`` / ``te.Linear``,
  the modules TE's own test ``test_custom_recipe_sanity_modules_nvfp4`` runs with this factory);
  ``block_impl="transformer_layer"`` is refused for it.

Transformer Engine is imported lazily (inside :func:`build_te_model` / :class:`TEGPT`), never
by ``import nvfp4lab`` or ``import nvfp4lab.te_model``. TE's modules need a CUDA device.

Sources: TE 2.20 ``transformer_engine/pytorch/transformer.py`` (TransformerLayer arguments),
``attention/multi_head_attention.py`` (QKV layout with ``qkv_weight_interleaved=False``:
``[3, heads, head_dim]``), ``module/layernorm_mlp.py`` (``fc1_weight``/``fc2_weight``, GELU),
``module/base.py::set_activation_dtype`` (torch.autocast gives the activation dtype);
TE common/recipe/__init__.py and pytorch/quantization.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .precisions import TE_BACKEND, canonical_name, get_precision
from .model import GPT, GPTConfig
from .recipe import NVFP4Recipe, layer_is_quantized

__all__ = [
    "TE_PRECISIONS",
    "TE_RECIPE_FOR_PRECISION",
    "GPT_TO_TE",
    "GPT_TO_TE_MODULES",
    "BLOCK_IMPLS",
    "TEGPT",
    "TEBlock",
    "build_te_model",
    "te_recipe_name",
    "quantized_blocks",
    "gpt_to_te_state_dict",
    "copy_gpt_weights",
]

#: Precision -> nvfp4lab.te.make_recipe name (None: no TE autocast).
TE_RECIPE_FOR_PRECISION: dict[str, str | None] = {
    name: None if get_precision(name).te_recipe is None else canonical_name(name) for name in TE_BACKEND}
#: Precisions accepted by :func:`build_te_model`.
TE_PRECISIONS = tuple(TE_RECIPE_FOR_PRECISION)
_NVFP4_NAMES = ("nvfp4", "nvfp4-reference")

#: Per-block parameter names: nvfp4lab GPT suffix -> TE suffix (bias rows only when config.bias).
GPT_TO_TE: dict[str, str] = {
    "ln_1.weight": "self_attention.layernorm_qkv.layer_norm_weight",
    "ln_1.bias": "self_attention.layernorm_qkv.layer_norm_bias",
    "attn.qkv.weight": "self_attention.layernorm_qkv.weight",
    "attn.qkv.bias": "self_attention.layernorm_qkv.bias",
    "attn.proj.weight": "self_attention.proj.weight",
    "attn.proj.bias": "self_attention.proj.bias",
    "ln_2.weight": "layernorm_mlp.layer_norm_weight",
    "ln_2.bias": "layernorm_mlp.layer_norm_bias",
    "mlp.fc.weight": "layernorm_mlp.fc1_weight",
    "mlp.fc.bias": "layernorm_mlp.fc1_bias",
    "mlp.proj.weight": "layernorm_mlp.fc2_weight",
    "mlp.proj.bias": "layernorm_mlp.fc2_bias",
}
#: Per-block names for ``block_impl="modules"`` (nvfp4lab GPT suffix -> TE-modules suffix).
GPT_TO_TE_MODULES: dict[str, str] = {
    "ln_1.weight": "attn.qkv.layer_norm_weight",
    "ln_1.bias": "attn.qkv.layer_norm_bias",
    "attn.qkv.weight": "attn.qkv.weight",
    "attn.qkv.bias": "attn.qkv.bias",
    "attn.proj.weight": "attn.proj.weight",
    "attn.proj.bias": "attn.proj.bias",
    "ln_2.weight": "mlp.fc.layer_norm_weight",
    "ln_2.bias": "mlp.fc.layer_norm_bias",
    "mlp.fc.weight": "mlp.fc.weight",
    "mlp.fc.bias": "mlp.fc.bias",
    "mlp.proj.weight": "mlp.proj.weight",
    "mlp.proj.bias": "mlp.proj.bias",
}
#: Block implementations accepted by :func:`build_te_model` (``"auto"`` picks per precision).
BLOCK_IMPLS = ("auto", "transformer_layer", "modules")
_TOP_LEVEL = ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight")


def _block_impl(block_impl: str, precision: str) -> str:
    if block_impl not in BLOCK_IMPLS:
        raise ValueError(f"block_impl must be one of {BLOCK_IMPLS}, got {block_impl!r}")
    if block_impl == "auto":
        return "modules" if te_recipe_name(precision) == "nvfp4-reference" else "transformer_layer"
    if block_impl == "transformer_layer" and te_recipe_name(precision) == "nvfp4-reference":
        raise ValueError("TE 2.20.2's NVFP4 reference recipe cannot train te.TransformerLayer "
                         "(te.LayerNormMLP backward fails; see nvfp4lab.te_model); use block_impl='modules'")
    return block_impl


def te_recipe_name(precision: str) -> str | None:
    """The :func:`nvfp4lab.te.make_recipe` name for a precision, ``None`` for fp32/bf16.

    Raises ``ValueError`` (listing :data:`TE_PRECISIONS`) for an unknown precision. Pure.
    """
    try:
        return TE_RECIPE_FOR_PRECISION[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r} for --backend te; choose one of {TE_PRECISIONS}") from None


def quantized_blocks(precision: str, n_layer: int, recipe: NVFP4Recipe | None = None) -> list[bool]:
    """Which of ``n_layer`` blocks run under the TE recipe (True) or in BF16 (False). Pure.

    fp32/bf16: none. FP8/MXFP8: all (as :func:`nvfp4lab.linear.convert_model` for ``"fp8"``).
    nvfp4 / nvfp4-reference: all but the recipe's ``bf16_first_layers`` and ``bf16_last_layers``.

    Raises ``ValueError`` for an unknown precision, for ``recipe.quantize_lm_head`` with an
    NVFP4 precision (the TE model's LM head is plain torch and stays BF16), and for a layer
    selection that does not fit (:meth:`NVFP4Recipe.check_num_blocks`).
    """
    name = te_recipe_name(precision)
    if name is None:
        return [False] * n_layer
    if name not in _NVFP4_NAMES:
        return [True] * n_layer
    recipe = NVFP4Recipe() if recipe is None else NVFP4Recipe.from_dict(recipe)
    if recipe.quantize_lm_head:
        raise ValueError("--backend te keeps the LM head in plain-torch BF16 (outside TE); "
                         "quantize_lm_head=True needs --backend nvfp4lab")
    recipe.check_num_blocks(n_layer)
    return [layer_is_quantized(f"blocks.{i}", precision, n_layer, recipe) for i in range(n_layer)]


def gpt_to_te_state_dict(state_dict: Mapping[str, torch.Tensor],
                         block_impl: str = "transformer_layer") -> dict[str, torch.Tensor]:
    """Rename an :class:`nvfp4lab.model.GPT` state dict to :class:`TEGPT` names. Pure (no TE).

    Tensors are passed through unchanged (the fused QKV weight already has TE's
    ``qkv_weight_interleaved=False`` layout: rows ``[q | k | v]``, each ``[heads, head_dim]``;
    the ``"modules"`` blocks split it the same way). ``blocks.<i>.<suffix>`` is renamed with
    :data:`GPT_TO_TE` (``block_impl="transformer_layer"``) or :data:`GPT_TO_TE_MODULES`
    (``"modules"``); top-level names are kept. Raises ``KeyError`` for a name it does not know,
    ``ValueError`` for an unknown ``block_impl``.
    """
    if block_impl not in ("transformer_layer", "modules"):
        raise ValueError(f"block_impl must be 'transformer_layer' or 'modules', got {block_impl!r}")
    table = GPT_TO_TE if block_impl == "transformer_layer" else GPT_TO_TE_MODULES
    out: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        if name in _TOP_LEVEL:
            out[name] = value
            continue
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] in table:
            out[f"blocks.{parts[1]}.{table[parts[2]]}"] = value
            continue
        raise KeyError(f"no TE counterpart for GPT parameter {name!r}")
    return out


def _normal_init(std: float):
    def init(weight: torch.Tensor) -> None:
        nn.init.normal_(weight, mean=0.0, std=std)

    return init


class _Group(nn.Module):
    """A plain container (``attn`` / ``mlp``) so parameter names read like nvfp4lab's GPT."""


class TEBlock(nn.Module):
    """One pre-LayerNorm block from TE's GEMM modules (``block_impl="modules"``).

    ``attn.qkv`` (``te.LayerNormLinear``: ln_1 + QKV projection), ``attn.core``
    (``te.DotProductAttention``, causal, ``bshd``), ``attn.proj`` (``te.Linear``), ``mlp.fc``
    (``te.LayerNormLinear``: ln_2 + FC1), torch's exact GELU, ``mlp.proj`` (``te.Linear``).
    ``forward(x [B, T, C]) -> [B, T, C]``. The four GEMMs are what a TE recipe quantizes; the
    attention core is not quantized (``fp8_dpa=False``).
    """

    def __init__(self, te: Any, cfg: GPTConfig, layer_number: int, init: Any, proj_init: Any,
                 params_dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        C, H = cfg.n_embd, cfg.n_head
        self.n_head, self.head_dim = H, C // H
        common = dict(params_dtype=params_dtype, device=device)
        self.attn = _Group()
        self.attn.qkv = te.LayerNormLinear(C, 3 * C, eps=1e-5, bias=cfg.bias, init_method=init,
                                           normalization="LayerNorm", **common)
        self.attn.core = te.DotProductAttention(H, C // H, attention_dropout=cfg.dropout, qkv_format="bshd",
                                                attn_mask_type="causal", layer_number=layer_number)
        self.attn.proj = te.Linear(C, C, bias=cfg.bias, init_method=proj_init, **common)
        self.mlp = _Group()
        self.mlp.fc = te.LayerNormLinear(C, cfg.mlp_ratio * C, eps=1e-5, bias=cfg.bias, init_method=init,
                                         normalization="LayerNorm", **common)
        self.mlp.proj = te.Linear(cfg.mlp_ratio * C, C, bias=cfg.bias, init_method=proj_init, **common)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.attn.qkv(x).view(B, T, 3, self.n_head, self.head_dim)  # rows [q | k | v]
        q, k, v = qkv.unbind(dim=2)  # [B, T, H, hd] each
        y = self.attn.core(q, k, v)  # [B, T, C]
        x = x + self.drop(self.attn.proj(y))
        return x + self.drop(self.mlp.proj(F.gelu(self.mlp.fc(x))))


class TEGPT(nn.Module):
    """The small GPT with ``te.TransformerLayer`` blocks; see the module docstring.

    Args:
        config: model shape (:class:`~nvfp4lab.model.GPTConfig`).
        precision: one of :data:`TE_PRECISIONS`.
        recipe: the :class:`~nvfp4lab.recipe.NVFP4Recipe` (NVFP4 flags and layer selection;
            default ``NVFP4Recipe()``); only the selection is used for FP8 names (ignored).
        te_recipe: a ready TE recipe object overriding the one made from ``precision`` (for
            experiments, e.g. ``DelayedScaling(amax_history_len=16)``); ``precision`` still
            decides the layer selection.
        device: CUDA device for the parameters (TE modules need CUDA).
        params_dtype: dtype of the parameters (default FP32 master weights, as nvfp4lab's GPT).
        block_impl: ``"auto"`` (``"modules"`` for ``nvfp4-reference``, else ``"transformer_layer"``),
            ``"transformer_layer"`` or ``"modules"``; see the module docstring.

    ``forward(idx, targets=None)``: ``idx`` int64 ``[B, T]`` (``T <= block_size``) ->
    ``(logits [B, T, vocab], loss)``; ``loss`` is the mean FP32 cross-entropy (nats/token)
    against ``targets`` ``[B, T]``, or None. Logits are in the autocast dtype under
    ``torch.autocast``, else ``params_dtype``.

    Attributes:
        te_recipe: the TE recipe (None for fp32/bf16). block_quantized: list of bools.
        quantize_enabled: set False to run every block in high precision (BF16 cooldown).

    Raises (at construction): :class:`~nvfp4lab.te.TransformerEngineUnavailable` without TE;
    :class:`~nvfp4lab.te.NVFP4NotSupported` / :class:`~nvfp4lab.te.RecipeNotSupported` when
    the recipe cannot run on this GPU (checked with the probe, before any TE call);
    ``ValueError`` for an unknown precision, a non-CUDA device, ``config.bias`` with
    ``"nvfp4-reference"`` (the reference GEMM has no bias), ``"nvfp4-reference"`` with
    ``block_impl="transformer_layer"`` (TE 2.20.2 bug) or a bad layer selection.
    """

    def __init__(self, config: GPTConfig, precision: str = "bf16", recipe: NVFP4Recipe | None = None, *,
                 te_recipe: Any = None, device: torch.device | str = "cuda",
                 params_dtype: torch.dtype = torch.float32, block_impl: str = "auto") -> None:
        super().__init__()
        from . import te as T  # noqa: PLC0415 - light; TE itself is imported by require_te

        te = T.require_te()
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"--backend te runs Transformer Engine modules, which need a CUDA device; got {device}")
        name = te_recipe_name(precision)
        self.block_impl = _block_impl(block_impl, precision)
        recipe = NVFP4Recipe() if recipe is None else NVFP4Recipe.from_dict(recipe)
        self.block_quantized = quantized_blocks(precision, config.n_layer, recipe)
        if name == "nvfp4-reference" and config.bias:
            raise ValueError("TE's NVFP4 reference recipe (CustomRecipe) cannot run GEMMs with a bias "
                             "('Bias is not supported in NVFP4QuantizerRef.qgemm'); use GPTConfig(bias=False)")
        if te_recipe is None and name is not None:
            te_recipe = T.make_recipe(name, recipe)
        if te_recipe is not None:
            T.check_recipe(te_recipe)  # NVFP4NotSupported on Hopper, before anything runs
        self.config = config
        self.precision = precision
        self.recipe = recipe
        self.te_recipe = te_recipe
        self.quantize_enabled = True

        cfg = config
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd, device=device, dtype=params_dtype)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd, device=device, dtype=params_dtype)
        self.drop = nn.Dropout(cfg.dropout)
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        if self.block_impl == "modules":
            self.blocks = nn.ModuleList(
                TEBlock(te, cfg, i + 1, _normal_init(0.02), _normal_init(proj_std), params_dtype, device)
                for i in range(cfg.n_layer))
        else:
            self.blocks = self._transformer_layers(te, cfg, proj_std, params_dtype, device)
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias, device=device, dtype=params_dtype)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False, device=device, dtype=params_dtype)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        for emb in (self.wte, self.wpe):
            nn.init.normal_(emb.weight, mean=0.0, std=0.02)
        if not cfg.tie_weights:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.02)

    @staticmethod
    def _transformer_layers(te: Any, cfg: GPTConfig, proj_std: float, params_dtype: torch.dtype,
                            device: torch.device) -> nn.ModuleList:
        return nn.ModuleList(
            te.TransformerLayer(
                cfg.n_embd,
                cfg.mlp_ratio * cfg.n_embd,
                cfg.n_head,
                layernorm_epsilon=1e-5,
                hidden_dropout=cfg.dropout,
                attention_dropout=cfg.dropout,
                init_method=_normal_init(0.02),
                output_layer_init_method=_normal_init(proj_std),
                layer_number=i + 1,
                self_attn_mask_type="causal",
                params_dtype=params_dtype,
                fuse_qkv_params=True,
                qkv_weight_interleaved=False,
                bias=cfg.bias,
                activation="gelu",
                normalization="LayerNorm",
                device=device,
                attn_input_format="bshd",
            )
            for i in range(cfg.n_layer)
        )

    # ------------------------------------------------------------------ bookkeeping
    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameter count (tied weights once; TE's LayerNorm biases included)."""
        from .model import count_parameters

        return count_parameters(self, exclude_embeddings)

    def layer_precisions(self) -> dict[str, str]:
        """``{GEMM layer name: "nvfp4" | "fp8" | "mxfp8" | "high"}`` for the 4 GEMMs per block and the head.

        Names follow nvfp4lab's GPT (``blocks.1.attn.qkv`` ...) so tables line up across backends.
        ``"nvfp4"`` also covers ``nvfp4-reference``; disabled quantization counts as ``"high"``.
        """
        name = te_recipe_name(self.precision)
        kind = "high" if name is None else ("nvfp4" if name in _NVFP4_NAMES else name.split("-")[0])
        out = {}
        for i, q in enumerate(self.block_quantized):
            for layer in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"):
                out[f"blocks.{i}.{layer}"] = kind if (q and self.quantize_enabled) else "high"
        out["lm_head"] = "high"
        return out

    def layer_counts(self) -> dict[str, int]:
        """``{"nvfp4": n, "fp8": n, "high": n}`` (+ ``"mxfp8"`` if used), as the trainer reports."""
        counts = {"nvfp4": 0, "fp8": 0, "high": 0}
        for v in self.layer_precisions().values():
            counts[v] = counts.get(v, 0) + 1
        return counts

    # ------------------------------------------------------------------ forward
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        from .model import embed_tokens, lm_head_and_loss

        x = embed_tokens(self, idx)  # [B, T, C]
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            x = x.to(torch.get_autocast_dtype(dev))
        if self.te_recipe is None or not self.quantize_enabled:
            for block in self.blocks:
                x = block(x)
        else:
            from .te import autocast  # noqa: PLC0415 - nvfp4lab.te is light; TE is already imported

            with autocast(self.te_recipe):
                for block, quantized in zip(self.blocks, self.block_quantized):
                    if quantized:
                        x = block(x)
                    else:
                        with autocast(self.te_recipe, enabled=False):  # kept in BF16
                            x = block(x)
        return lm_head_and_loss(self, x, targets)

    def extra_repr(self) -> str:
        sel = "".join("q" if q else "-" for q in self.block_quantized)
        return (f"precision={self.precision!r}, te_recipe={type(self.te_recipe).__name__}, "
                f"block_impl={self.block_impl!r}, blocks=[{sel}]")


@torch.no_grad()
def copy_gpt_weights(te_model: TEGPT, gpt: GPT) -> TEGPT:
    """Copy every parameter of an :class:`nvfp4lab.model.GPT` into ``te_model`` (in place).

    TE-only parameters (the LayerNorm biases when ``config.bias`` is False) are set to 0, which
    is what the bias-free LayerNorm computes. Returns ``te_model``.

    Raises ``ValueError`` if the configs differ and ``KeyError`` / ``RuntimeError`` if a name
    or shape does not match (a TE version with other parameter names).
    """
    if gpt.config != te_model.config:
        raise ValueError(f"config mismatch: GPT {gpt.config} vs TEGPT {te_model.config}")
    mapped = gpt_to_te_state_dict(dict(gpt.state_dict()), te_model.block_impl)
    params = dict(te_model.named_parameters(remove_duplicate=False))
    for name, p in params.items():
        if name in mapped:
            src = mapped[name]
            if tuple(src.shape) != tuple(p.shape):
                raise RuntimeError(f"shape mismatch for {name}: GPT {tuple(src.shape)} vs TE {tuple(p.shape)}")
            p.copy_(src.to(device=p.device, dtype=p.dtype))
        elif name.endswith("layer_norm_bias"):
            p.zero_()
        else:
            raise KeyError(f"TE parameter {name!r} has no GPT counterpart")
    missing = set(mapped) - set(params)
    if missing:
        raise KeyError(f"GPT parameters without a TE counterpart: {sorted(missing)}")
    return te_model


def build_te_model(config: GPTConfig, precision: str = "bf16", recipe: NVFP4Recipe | None = None, *,
                   device: torch.device | str = "cuda", params_dtype: torch.dtype = torch.float32,
                   te_recipe: Any = None, init_from_gpt: bool = True, block_impl: str = "auto") -> TEGPT:
    """Build the ``--backend te`` model: a :class:`TEGPT` ready to train.

    Args:
        config: :class:`~nvfp4lab.model.GPTConfig` (a preset's, possibly with overrides).
        precision: one of :data:`TE_PRECISIONS` (the trainer's ``fp32``/``bf16``/``fp8``/``nvfp4``
            included; ``fp8`` means TE's ``Float8CurrentScaling``).
        recipe: :class:`~nvfp4lab.recipe.NVFP4Recipe` (NVFP4 flags and BF16 first/last blocks).
        device: CUDA device. params_dtype: parameter dtype (FP32 master weights by default).
        te_recipe: optional TE recipe object overriding the one made from ``precision``.
        init_from_gpt: build :class:`nvfp4lab.model.GPT` on the CPU (consuming the CPU RNG exactly
            as ``GPT(config)`` does in the nvfp4lab backend) and copy its weights, so the same seed
            gives the same initial weights in both backends. False: TE's own initialisation
            with GPT-2's standard deviations (0.02, and 0.02/sqrt(2 n_layer) for output projections).
        block_impl: ``"auto"``, ``"transformer_layer"`` or ``"modules"`` (see the module docstring).

    Returns:
        :class:`TEGPT` on ``device``, in training mode.

    Raises:
        TransformerEngineUnavailable: TE does not import (message has the install command).
        NVFP4NotSupported: ``precision="nvfp4"`` below compute capability 10.0 (Hopper); the
            message gives the probe's reason and the fallbacks (``--precision fp8 --backend te``
            or ``--backend nvfp4lab``).
        RecipeNotSupported: another recipe this GPU cannot run (e.g. ``mxfp8`` on Hopper).
        ValueError: unknown precision or block_impl, non-CUDA device, bad layer selection, bias
            with the reference, the reference with ``block_impl="transformer_layer"``.
    """
    _block_impl(block_impl, precision)  # fail fast on a typo, before TE is imported
    gpt = GPT(config) if init_from_gpt else None
    model = TEGPT(config, precision, recipe, te_recipe=te_recipe, device=device, params_dtype=params_dtype,
                  block_impl=block_impl)
    if gpt is not None:
        copy_gpt_weights(model, gpt)
    return model.train()
