"""CPU tests for nvfp4lab.te_model: the parts that need neither TE nor a GPU.

The TE model itself (TransformerLayer blocks, FP8 training, the GPT weight copy through real
TE modules) is tested on the GPU machine in tests/gpu/test_te_gpu.py.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from nvfp4lab.model import GPT, get_preset
from nvfp4lab.recipe import NVFP4Recipe

M = importlib.import_module("nvfp4lab.te_model")
T = importlib.import_module("nvfp4lab.te")


def test_import_is_lazy():
    # Importing the module (and nvfp4lab) must not import Transformer Engine.
    assert "transformer_engine" not in sys.modules or T.te_available()
    assert "transformer_engine.pytorch" not in sys.modules or T.te_available()


@pytest.mark.parametrize("precision, name", [
    ("fp32", None), ("bf16", None), ("fp8", "fp8-current"), ("fp8-current", "fp8-current"),
    ("fp8-delayed", "fp8-delayed"), ("fp8-block", "fp8-block"), ("mxfp8", "mxfp8"),
    ("nvfp4", "nvfp4"), ("nvfp4-reference", "nvfp4-reference"),
])
def test_recipe_names(precision, name):
    assert M.te_recipe_name(precision) == name
    assert name is None or name in T.RECIPE_NAMES


def test_unknown_precision():
    with pytest.raises(ValueError, match="unknown precision 'fp4'"):
        M.te_recipe_name("fp4")
    with pytest.raises(ValueError, match="unknown precision"):
        M.build_te_model(get_preset("ci"), "fp4")  # before TE is even imported


def test_layer_selection():
    assert M.quantized_blocks("bf16", 4) == [False] * 4
    assert M.quantized_blocks("fp8", 4) == [True] * 4  # FP8: every block, as convert_model
    assert M.quantized_blocks("nvfp4", 4) == [False, True, True, False]  # NVFP4Recipe(): first/last BF16
    assert M.quantized_blocks("nvfp4-reference", 5, NVFP4Recipe(bf16_first_layers=0, bf16_last_layers=2)) == [
        True, True, True, False, False]
    with pytest.raises(ValueError, match="LM head"):
        M.quantized_blocks("nvfp4", 4, NVFP4Recipe(quantize_lm_head=True))
    with pytest.raises(ValueError, match="only 2 blocks"):
        M.quantized_blocks("nvfp4", 2, NVFP4Recipe(bf16_first_layers=2, bf16_last_layers=1))


def test_state_dict_mapping_covers_gpt():
    cfg = get_preset("ci")
    gpt = GPT(cfg)
    sd = gpt.state_dict()
    mapped = M.gpt_to_te_state_dict(sd)
    assert len(mapped) == len(sd)
    C = cfg.n_embd
    for i in range(cfg.n_layer):
        qkv = mapped[f"blocks.{i}.self_attention.layernorm_qkv.weight"]
        assert qkv.shape == (3 * C, C)
        assert qkv is sd[f"blocks.{i}.attn.qkv.weight"]  # passed through: rows [q | k | v]
        assert mapped[f"blocks.{i}.layernorm_mlp.fc1_weight"].shape == (cfg.mlp_ratio * C, C)
        assert mapped[f"blocks.{i}.layernorm_mlp.fc2_weight"].shape == (C, cfg.mlp_ratio * C)
        assert f"blocks.{i}.self_attention.proj.weight" in mapped
        assert f"blocks.{i}.layernorm_mlp.layer_norm_weight" in mapped
    for name in ("wte.weight", "wpe.weight", "ln_f.weight", "lm_head.weight"):
        assert name in mapped
    with pytest.raises(KeyError, match="no TE counterpart"):
        M.gpt_to_te_state_dict({"blocks.0.attn.rotary.freq": torch.zeros(1)})


@pytest.mark.skipif(T.te_available(), reason="TE is installed here")
def test_build_without_te_explains():
    with pytest.raises(T.TransformerEngineUnavailable, match="pip install"):
        M.build_te_model(get_preset("ci"), "bf16", device="cuda")


def test_state_dict_mapping_modules_variant():
    cfg = get_preset("ci")
    sd = GPT(cfg).state_dict()
    mapped = M.gpt_to_te_state_dict(sd, "modules")
    assert len(mapped) == len(sd)
    assert mapped["blocks.0.attn.qkv.weight"] is sd["blocks.0.attn.qkv.weight"]
    assert mapped["blocks.0.attn.qkv.layer_norm_weight"] is sd["blocks.0.ln_1.weight"]
    assert mapped["blocks.2.mlp.fc.layer_norm_weight"] is sd["blocks.2.ln_2.weight"]
    assert mapped["blocks.2.mlp.proj.weight"] is sd["blocks.2.mlp.proj.weight"]
    with pytest.raises(ValueError, match="block_impl"):
        M.gpt_to_te_state_dict(sd, "auto")


def test_block_impl_choice():
    assert M._block_impl("auto", "fp8") == "transformer_layer"
    assert M._block_impl("auto", "bf16") == "transformer_layer"
    assert M._block_impl("auto", "nvfp4-reference") == "modules"  # TE 2.20.2 LayerNormMLP bug
    assert M._block_impl("modules", "fp8") == "modules"
    with pytest.raises(ValueError, match="cannot train te.TransformerLayer"):
        M._block_impl("transformer_layer", "nvfp4-reference")
    with pytest.raises(ValueError, match="block_impl must be one of"):
        M.build_te_model(get_preset("ci"), "fp8", block_impl="fused")  # before TE is imported
