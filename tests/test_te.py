"""CPU tests for nvfp4lab.te against a fake ``transformer_engine`` package.

The fake copies the *interface* of TE 2.20's recipe classes (field names, defaults and
the QParams that ``NVFP4BlockScaling.__post_init__`` derives, from
``transformer_engine/common/recipe/__init__.py``) and of ``te.autocast`` /
``te.is_*_available`` (``transformer_engine/pytorch/quantization.py``). Unknown keyword
arguments raise TypeError as in TE, so a wrong field name in the mapping fails here.
The same mapping is checked against the real TE on the GPU machine
(tests/gpu/test_te_gpu.py::test_make_recipe_against_real_te).
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import subprocess
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest

T = importlib.import_module("nvfp4lab.te")
P = importlib.import_module("nvfp4lab.capabilities")

NVFP4_REASON = "Device compute capability 10.0 or higher required for NVFP4 execution."
FP8_REASON = "Device compute capability 8.9 or higher required for FP8 execution."
BLOCK_REASON = "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."
MXFP8_REASON = "Device compute capability 10.0 or higher required for MXFP8 execution."
INSTALL = 'pip install --no-build-isolation "transformer-engine[pytorch]==2.20.2"'


# --------------------------------------------------------------------------- the fake TE


class Format(enum.Enum):
    E2M1 = "E2M1"
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


@dataclass(frozen=True)
class QParams:
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


class Recipe:
    pass


@dataclass
class DelayedScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Any = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None


@dataclass
class Float8CurrentScaling(Recipe):
    use_power_2_scales: bool = False
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None


@dataclass
class MXFP8BlockScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None


@dataclass
class Float8BlockScaling(Recipe):
    use_f32_scales: bool = False
    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None


@dataclass
class NVFP4BlockScaling(Recipe):
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    row_scaled_activation: bool = False
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self):  # as TE 2.20
        self.fp4_quant_fwd_inp = QParams(random_hadamard_transform=not self.disable_rht)
        self.fp4_quant_fwd_weight = QParams(fp4_2d_quantization=not self.disable_2d_quantization)
        self.fp4_quant_bwd_grad = QParams(
            random_hadamard_transform=not self.disable_rht,
            stochastic_rounding=not self.disable_stochastic_rounding,
        )


@dataclass
class CustomRecipe(Recipe):
    qfactory: Callable = None


@dataclass(frozen=True)
class QuantizerRole:
    module_type: str = ""
    tensor_type: str = ""
    name: str = ""


class NVFP4QuantizerRef:
    def __init__(self, dtype, rowwise=True, columnwise=True, pow_2_scales=False, eps=0.0,
                 quant_tile_shape=(1, 16), with_rht=False, with_random_sign_mask=True):
        self.dtype = dtype
        self.pow_2_scales = pow_2_scales
        self.quant_tile_shape = quant_tile_shape
        self.with_rht = with_rht


def nvfp4_ref_rht_2d_factory(role):
    raise AssertionError("not called by these tests")


class FakeTE:
    """The fake ``transformer_engine.pytorch`` plus what the tests observe."""

    def __init__(self, cc):
        self.cc = cc
        self.autocast_calls: list[dict] = []
        self.exited = 0
        self.check_calls: list[str] = []

    def checks(self, module):
        fake = self

        def check(name, ok, reason):
            def fn(return_reason=False):
                fake.check_calls.append(name)
                if fake.cc is None:
                    raise RuntimeError("TE needs a CUDA device")  # as get_device_compute_capability
                value = (ok(fake.cc), "" if ok(fake.cc) else reason)
                return value if return_reason else value[0]

            return fn

        module.is_fp8_available = check("fp8", lambda cc: cc >= (8, 9), FP8_REASON)
        module.is_fp8_block_scaling_available = check("fp8_block_scaling", lambda cc: cc >= (9, 0), BLOCK_REASON)
        module.is_mxfp8_available = check("mxfp8", lambda cc: (10, 0) <= cc < (12, 0), MXFP8_REASON)
        module.is_nvfp4_available = check("nvfp4", lambda cc: cc >= (10, 0), NVFP4_REASON)

        class autocast:  # noqa: N801 - TE's name
            def __init__(self, enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
                if enabled and isinstance(recipe, NVFP4BlockScaling) and fake.cc < (10, 0):
                    raise AssertionError(NVFP4_REASON)  # what TE itself would do, deep inside
                fake.autocast_calls.append(dict(enabled=enabled, recipe=recipe, group=amax_reduction_group))

            def __enter__(self):
                return None

            def __exit__(self, *exc):
                fake.exited += 1
                return False

        module.autocast = autocast
        module.get_default_recipe = lambda: DelayedScaling() if fake.cc < (10, 0) else MXFP8BlockScaling()


def _module(name, package=False, **attrs):
    m = types.ModuleType(name)
    if package:
        m.__path__ = []
    m.__dict__.update(attrs)
    return m


@pytest.fixture
def fake_te(monkeypatch):
    """Install the fake TE in sys.modules; returns a function setting the fake GPU's SM."""
    state = FakeTE((9, 0))
    recipe_mod = _module(
        "transformer_engine.common.recipe",
        Format=Format, QParams=QParams, Recipe=Recipe, DelayedScaling=DelayedScaling,
        Float8CurrentScaling=Float8CurrentScaling, MXFP8BlockScaling=MXFP8BlockScaling,
        Float8BlockScaling=Float8BlockScaling, NVFP4BlockScaling=NVFP4BlockScaling, CustomRecipe=CustomRecipe,
    )
    common = _module("transformer_engine.common", package=True, recipe=recipe_mod)
    pytorch = _module("transformer_engine.pytorch", package=True, QuantizerRole=QuantizerRole)
    state.checks(pytorch)
    ref_utils = _module(
        "transformer_engine.pytorch.custom_recipes.reference_utils",
        Fp4Formats=types.SimpleNamespace(E2M1="E2M1"),
    )
    ref = _module(
        "transformer_engine.pytorch.custom_recipes.reference_nvfp4",
        NVFP4QuantizerRef=NVFP4QuantizerRef, nvfp4_ref_rht_2d_factory=nvfp4_ref_rht_2d_factory,
    )
    custom = _module("transformer_engine.pytorch.custom_recipes", package=True, reference_nvfp4=ref,
                     reference_utils=ref_utils)
    pytorch.custom_recipes = custom
    top = _module("transformer_engine", package=True, __version__="2.20.2", common=common, pytorch=pytorch)
    for m in (top, common, recipe_mod, pytorch, custom, ref, ref_utils):
        monkeypatch.setitem(sys.modules, m.__name__, m)

    def gpu():
        cc = state.cc
        return {
            "gpu_available": cc is not None,
            "device_name": "fake" if cc else "cpu",
            "device_count": int(cc is not None),
            "compute_capability": cc,
            "total_memory_bytes": 80 * 2**30 if cc else None,
        }

    monkeypatch.setattr(P, "_gpu_info", gpu)
    monkeypatch.setattr(P, "_cuda_version", lambda: "13.0")
    return state


@dataclass(frozen=True)
class StandInNVFP4Recipe:
    """Duck-typed NVFP4Recipe (nvfp4lab.recipe's fields that matter to TE)."""

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    bf16_first_layers: int = 1
    bf16_last_layers: int = 1
    quantize_lm_head: bool = False


def _nvfp4_recipe_classes():
    classes = [StandInNVFP4Recipe]
    try:
        from nvfp4lab.recipe import NVFP4Recipe  # written by another engineer; used once it exists
    except Exception:  # noqa: BLE001
        pass
    else:
        classes.append(NVFP4Recipe)
    return classes


# --------------------------------------------------------------------------- require_te


def test_require_te_without_te_gives_install_command(monkeypatch):
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(P.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(T.TransformerEngineUnavailable) as info:
        T.require_te()
    assert isinstance(info.value, ImportError)
    assert INSTALL in str(info.value)
    assert "not installed" in str(info.value) and "--backend nvfp4lab" in str(info.value)
    assert T.te_available() is False
    for call in (lambda: T.make_recipe("fp8-current"), lambda: T.autocast("fp8-current").__enter__()):
        with pytest.raises(T.TransformerEngineUnavailable, match="transformer-engine"):
            call()


def test_require_te_import_failure_is_quoted(monkeypatch):
    """An installed TE whose import raises (here OSError, as for a missing core library)."""

    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "transformer_engine":
                return importlib.util.spec_from_loader(name, self)

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            raise OSError("libtransformer_engine.so: cannot open shared object file")

    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    with pytest.raises(T.TransformerEngineUnavailable) as info:
        T.require_te()
    assert "does not import" in str(info.value) and "OSError: libtransformer_engine.so" in str(info.value)
    assert INSTALL in str(info.value)


def test_require_te_returns_te_pytorch(fake_te):
    assert T.require_te() is sys.modules["transformer_engine.pytorch"]
    assert T.te_available()


# --------------------------------------------------------------------------- make_recipe


@pytest.mark.parametrize("cls", _nvfp4_recipe_classes())
@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("sr", [False, True])
@pytest.mark.parametrize("two_d", [False, True])
def test_make_recipe_nvfp4_carries_flags(fake_te, cls, rht, sr, two_d):
    ours = cls(disable_rht=rht, disable_stochastic_rounding=sr, disable_2d_quantization=two_d)
    r = T.make_recipe("nvfp4", ours)
    assert type(r) is NVFP4BlockScaling
    assert (r.disable_rht, r.disable_stochastic_rounding, r.disable_2d_quantization) == (rht, sr, two_d)
    # What TE derives from them (QParams per tensor role):
    assert r.fp4_quant_fwd_inp.random_hadamard_transform is (not rht)
    assert r.fp4_quant_bwd_grad.random_hadamard_transform is (not rht)
    assert r.fp4_quant_bwd_grad.stochastic_rounding is (not sr)
    assert r.fp4_quant_fwd_weight.fp4_2d_quantization is (not two_d)
    assert not r.fp4_quant_fwd_inp.stochastic_rounding and not r.fp4_quant_fwd_weight.random_hadamard_transform


def test_make_recipe_nvfp4_defaults_and_overrides(fake_te):
    r = T.make_recipe("nvfp4")
    assert (r.disable_rht, r.disable_stochastic_rounding, r.disable_2d_quantization) == (False, False, False)
    r = T.make_recipe("nvfp4", StandInNVFP4Recipe(disable_rht=True), disable_rht=False, backward_override="high_precision")
    assert r.disable_rht is False and r.backward_override == "high_precision"
    with pytest.raises(TypeError, match="lacks"):
        T.make_recipe("nvfp4", types.SimpleNamespace(disable_rht=True))


@pytest.mark.parametrize(
    "name,cls",
    [
        ("fp8-current", Float8CurrentScaling),
        ("fp8", Float8CurrentScaling),
        ("fp8-delayed", DelayedScaling),
        ("fp8-block", Float8BlockScaling),
        ("mxfp8", MXFP8BlockScaling),
    ],
)
def test_make_recipe_fp8_names(fake_te, name, cls):
    r = T.make_recipe(name, StandInNVFP4Recipe(disable_rht=True))  # ignored for FP8
    assert type(r) is cls
    assert r == cls()  # TE's defaults, nothing changed


def test_make_recipe_overrides_reach_te(fake_te):
    assert T.make_recipe("fp8-delayed", amax_history_len=16).amax_history_len == 16
    with pytest.raises(TypeError):
        T.make_recipe("fp8-current", no_such_field=1)


def test_make_recipe_unknown_name(fake_te):
    with pytest.raises(ValueError, match="nvfp4-reference"):
        T.make_recipe("fp4")


def test_make_recipe_reference_uses_te_factory(fake_te):
    r = T.make_recipe("nvfp4-reference")
    assert type(r) is CustomRecipe
    assert r.qfactory is nvfp4_ref_rht_2d_factory
    # SR cannot be emulated by the reference; the flag does not change the factory.
    r = T.make_recipe("nvfp4-reference", StandInNVFP4Recipe(disable_stochastic_rounding=True))
    assert r.qfactory is nvfp4_ref_rht_2d_factory
    with pytest.raises(ValueError):
        T.make_recipe("nvfp4-reference", amax_history_len=3)


@pytest.mark.parametrize("rht,two_d", [(True, False), (False, True), (True, True)])
def test_make_recipe_reference_flags_change_quantizers(fake_te, rht, two_d):
    r = T.make_recipe("nvfp4-reference", StandInNVFP4Recipe(disable_rht=rht, disable_2d_quantization=two_d))
    q = r.qfactory
    w = q(QuantizerRole(module_type="linear", tensor_type="weight"))
    assert w.quant_tile_shape == ((1, 16) if two_d else (16, 16))
    assert w.with_rht is False and w.pow_2_scales is False
    for role in (QuantizerRole("linear", "input"), QuantizerRole("linear", "grad_output"), QuantizerRole("dpa", "qkv"), None):
        a = q(role)
        assert a.quant_tile_shape == (1, 16)
        assert a.with_rht is (not rht)
    assert q(QuantizerRole("grouped_linear", "weight")).quant_tile_shape == w.quant_tile_shape


# --------------------------------------------------------------------------- recipe_format, autocast


def test_recipe_format(fake_te):
    assert T.recipe_format(NVFP4BlockScaling()) == "nvfp4"
    assert T.recipe_format(MXFP8BlockScaling()) == "mxfp8"
    assert T.recipe_format(Float8BlockScaling()) == "fp8-block"
    assert T.recipe_format(DelayedScaling()) == "fp8-delayed"
    assert T.recipe_format(Float8CurrentScaling()) == "fp8-current"
    assert T.recipe_format(CustomRecipe(qfactory=nvfp4_ref_rht_2d_factory)) == "fp8-current"


def test_autocast_refuses_nvfp4_on_hopper_before_te(fake_te):
    with pytest.raises(T.NVFP4NotSupported) as info:
        with T.autocast(T.make_recipe("nvfp4")):
            pytest.fail("body must not run")
    msg = str(info.value)
    assert NVFP4_REASON in msg
    assert T.FALLBACKS in msg
    assert "use --precision fp8 with --backend te, or nvfp4lab's emulated NVFP4 with --backend nvfp4lab" in msg
    assert info.value.reason == NVFP4_REASON and info.value.format_key == "nvfp4"
    assert isinstance(info.value, T.RecipeNotSupported) and isinstance(info.value, RuntimeError)
    assert fake_te.autocast_calls == []  # TE's own assertion was never reached
    assert "nvfp4" in fake_te.check_calls  # the answer came from TE's is_nvfp4_available
    # The message is the probe's reason for this machine, word for word.
    assert P.probe().format("nvfp4").reason in msg


def test_autocast_nvfp4_on_ampere_and_without_gpu(fake_te):
    fake_te.cc = (8, 0)
    with pytest.raises(T.NVFP4NotSupported) as info:
        T.autocast("nvfp4").__enter__()
    assert NVFP4_REASON in str(info.value) and FP8_REASON in str(info.value)
    assert "--backend nvfp4lab" in str(info.value) and "--backend te" not in str(info.value)
    fake_te.cc = None
    with pytest.raises(T.NVFP4NotSupported, match="No CUDA GPU"):
        T.autocast("nvfp4").__enter__()
    assert fake_te.autocast_calls == []


def test_autocast_other_recipes_refused_with_reason(fake_te):
    with pytest.raises(T.RecipeNotSupported) as info:
        T.autocast("mxfp8").__enter__()
    assert not isinstance(info.value, T.NVFP4NotSupported)
    assert MXFP8_REASON in str(info.value)
    fake_te.cc = (8, 0)
    for name in ("fp8-current", "fp8-delayed", "nvfp4-reference"):
        with pytest.raises(T.RecipeNotSupported, match="8.9 or higher"):
            T.autocast(name).__enter__()
    with pytest.raises(T.RecipeNotSupported, match="default TE recipe"):
        T.autocast(None).__enter__()
    assert fake_te.autocast_calls == []


@pytest.mark.parametrize(
    "cc,name",
    [((9, 0), "fp8-current"), ((9, 0), "fp8-delayed"), ((9, 0), "fp8-block"), ((9, 0), "nvfp4-reference"),
     ((8, 9), "fp8-current"), ((10, 0), "nvfp4"), ((10, 0), "mxfp8"), ((12, 0), "nvfp4")],
)
def test_autocast_enters_te_autocast_when_supported(fake_te, cc, name):
    fake_te.cc = cc
    recipe = T.make_recipe(name)
    with T.autocast(recipe, amax_reduction_group="g") as used:
        assert used is recipe
        assert fake_te.autocast_calls == [dict(enabled=True, recipe=recipe, group="g")]
    assert fake_te.exited == 1


def test_autocast_string_and_default_recipe(fake_te):
    with T.autocast("fp8-block") as used:
        assert type(used) is Float8BlockScaling
    with T.autocast() as used:
        assert type(used) is DelayedScaling  # TE's default on Hopper
    assert [type(c["recipe"]) for c in fake_te.autocast_calls] == [Float8BlockScaling, DelayedScaling]


def test_autocast_disabled_skips_checks(fake_te):
    recipe = NVFP4BlockScaling()
    with T.autocast(recipe, enabled=False) as used:  # nested BF16 region inside an NVFP4 model
        assert used is recipe
    assert fake_te.autocast_calls == [dict(enabled=False, recipe=recipe, group=None)]
    assert fake_te.check_calls == []


def test_autocast_propagates_body_errors_and_exits(fake_te):
    with pytest.raises(KeyError):
        with T.autocast("fp8-current"):
            raise KeyError("boom")
    assert fake_te.exited == 1


def test_import_nvfp4lab_does_not_need_te():
    """``import nvfp4lab`` (and its probe/te modules) works when importing TE would fail."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'transformer_engine':\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import nvfp4lab, nvfp4lab.capabilities, nvfp4lab.te\n"
        "assert not any(m.split('.')[0] == 'transformer_engine' for m in sys.modules)\n"
    )
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
