"""Transformer Engine 2.20 wrappers: recipe builders, a checked ``autocast``, actionable errors.

Everything here imports Transformer Engine (TE) lazily, inside the functions, so
``import nvfp4lab.te`` works on a machine without TE or a GPU; only calling
:func:`require_te`, :func:`make_recipe` or :func:`autocast` needs TE.

Recipe names (:data:`RECIPE_NAMES`) and the TE 2.20 objects they build
(TE file ``transformer_engine/common/recipe/__init__.py``):

* ``nvfp4``: ``NVFP4BlockScaling(disable_rht, disable_stochastic_rounding,
  disable_2d_quantization)``, flags from nvfp4lab's ``NVFP4Recipe``; native on SM >= 10.0.
* ``nvfp4-reference``: ``CustomRecipe(qfactory=nvfp4_ref_rht_2d_factory)``, TE's
  pure-PyTorch NVFP4 emulation (``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``);
  runs wherever TE's FP8 check passes (SM >= 8.9), slowly, and only with bias-free modules
  (``bias=False``), K % 32 == 0 for every GEMM and tokens % 16 == 0 (TE custom_recipes/reference_nvfp4.py::qgemm).
* ``fp8-current``: ``Float8CurrentScaling()``; SM >= 8.9.
* ``fp8-delayed``: ``DelayedScaling()``; SM >= 8.9.
* ``fp8-block``: ``Float8BlockScaling()``; SM >= 9.0 and CUDA >= 12.9.
* ``mxfp8``: ``MXFP8BlockScaling()``; SM 10.x and 11.x.

``fp8`` is accepted as an alias of ``fp8-current`` (the CLI's ``--precision fp8``).

:func:`autocast` checks the recipe against this machine with the probe
(:func:`nvfp4lab.capabilities.recipe_support`, i.e. TE's own ``is_*_available``) *before*
entering ``te.autocast``, so an unsupported recipe raises :class:`NVFP4NotSupported`
or :class:`RecipeNotSupported` with the probe's reason and the fallbacks, never an
assertion from inside TE.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from .precisions import ALIASES, PRECISIONS
from .capabilities import TE_INSTALL_COMMAND, TE_PINNED_VERSION, import_transformer_engine, recipe_support

__all__ = [
    "TE_INSTALL_COMMAND",
    "TE_PINNED_VERSION",
    "RECIPE_NAMES",
    "RECIPE_ALIASES",
    "FALLBACKS",
    "TransformerEngineUnavailable",
    "RecipeNotSupported",
    "NVFP4NotSupported",
    "require_te",
    "te_available",
    "make_recipe",
    "nvfp4_reference_factory",
    "recipe_format",
    "check_recipe",
    "autocast",
]

#: Names accepted by :func:`make_recipe`: the TE recipes of the precision table.
RECIPE_NAMES = tuple(p.name for p in PRECISIONS if p.te_recipe is not None)
#: Extra spellings accepted by :func:`make_recipe` (the precision table's aliases).
RECIPE_ALIASES = dict(ALIASES)

#: What to do instead when NVFP4 cannot run natively (FP8 runs on this GPU).
FALLBACKS = "use --precision fp8 with --backend te, or nvfp4lab's emulated NVFP4 with --backend nvfp4lab"
_FALLBACK_NO_FP8 = "use nvfp4lab's emulated NVFP4 with --backend nvfp4lab"

# NVFP4Recipe field -> NVFP4BlockScaling field (same names on both sides, by design).
_NVFP4_FLAGS = ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization")
# Later NVFP4BlockScaling fields (TE 2.20: 4over6, row-scaled activation, backward override), passed only
# when they differ from TE's defaults, so that a TE without them still takes the base recipe.
_NVFP4_OPTION_DEFAULTS = {"row_scaled_activation": False, "nvfp4_4over6": "none", "nvfp4_4over6_e4m3_use_256": "all",
                          "nvfp4_4over6_err_mode": "MAE", "backward_override": None}


class TransformerEngineUnavailable(ImportError):
    """Transformer Engine is not installed or does not import. The message has the
    cause and the install command (:data:`TE_INSTALL_COMMAND`)."""


class RecipeNotSupported(RuntimeError):
    """A TE recipe cannot run on this machine.

    Attributes:
        format_key: the probe's format key (``"fp8-block"``, ``"mxfp8"``, ``"nvfp4"``, ...).
        reason: the probe's reason (TE's own words when TE answered).
    """

    def __init__(self, message: str, *, format_key: str, reason: str):
        super().__init__(message)
        self.format_key = format_key
        self.reason = reason


class NVFP4NotSupported(RecipeNotSupported):
    """``NVFP4BlockScaling`` requested where NVFP4 is not native (compute capability < 10.0,
    or no GPU). The message has the probe's reason and the fallbacks (:data:`FALLBACKS`)."""


def require_te() -> Any:
    """Import Transformer Engine's PyTorch API or explain how to get it.

    Returns:
        the ``transformer_engine.pytorch`` module.

    Raises:
        TransformerEngineUnavailable: TE is not installed, or its import failed (the
            exception is quoted); the message has ``pip install --no-build-isolation
            "transformer-engine[pytorch]==2.20.2"``.
    """
    module, _version, error = import_transformer_engine()
    if module is None:
        raise TransformerEngineUnavailable(
            f"{error}\nTE needs a CUDA GPU, CUDA >= 12.1 and torch installed first; "
            "nvfp4lab's own NVFP4 emulation (--backend nvfp4lab) works without it."
        )
    return module


def te_available() -> bool:
    """True when ``transformer_engine.pytorch`` imports (quietly); never raises."""
    return import_transformer_engine()[0] is not None


def _te_recipe_module() -> Any:
    require_te()
    import transformer_engine.common.recipe as te_recipe  # noqa: PLC0415 - lazy by design

    return te_recipe


def _reference_quantizer(role: Any, *, with_rht: bool, weight_2d: bool) -> Any:
    """Same roles as TE's ``nvfp4_ref_rht_2d_factory`` with RHT / 2D weight tiles switchable."""
    from transformer_engine.pytorch.custom_recipes import reference_utils  # noqa: PLC0415
    from transformer_engine.pytorch.custom_recipes.reference_nvfp4 import NVFP4QuantizerRef  # noqa: PLC0415

    is_weight = (
        role is not None
        and getattr(role, "module_type", "") in ("linear", "grouped_linear")
        and getattr(role, "tensor_type", "") == "weight"
    )
    if is_weight:
        return NVFP4QuantizerRef(
            dtype=reference_utils.Fp4Formats.E2M1,
            quant_tile_shape=(16, 16) if weight_2d else (1, 16),
            pow_2_scales=False,
            with_rht=False,
        )
    return NVFP4QuantizerRef(
        dtype=reference_utils.Fp4Formats.E2M1,
        quant_tile_shape=(1, 16),
        pow_2_scales=False,
        with_rht=with_rht,
    )


def nvfp4_reference_factory(disable_rht: bool = False, disable_2d_quantization: bool = False) -> Callable[[Any], Any]:
    """Quantizer factory for ``CustomRecipe``: TE's NVFP4 reference emulation.

    With both flags False this *is* TE's ``nvfp4_ref_rht_2d_factory``
    (``transformer_engine/pytorch/custom_recipes/reference_nvfp4.py``): weights of
    ``linear``/``grouped_linear`` modules get 16x16 tiles without RHT; every other role
    gets 1x16 tiles with RHT (applied by the reference to the columnwise/wgrad copy).
    ``disable_rht`` turns RHT off for those roles; ``disable_2d_quantization`` gives
    weights 1x16 tiles — the same meaning as in ``NVFP4BlockScaling``.

    The reference has no stochastic rounding; gradients are always rounded to nearest.

    Raises:
        TransformerEngineUnavailable: without TE.
    """
    require_te()
    if not disable_rht and not disable_2d_quantization:
        from transformer_engine.pytorch.custom_recipes.reference_nvfp4 import (  # noqa: PLC0415
            nvfp4_ref_rht_2d_factory,
        )

        return nvfp4_ref_rht_2d_factory
    return functools.partial(_reference_quantizer, with_rht=not disable_rht, weight_2d=not disable_2d_quantization)


def make_recipe(name: str, nvfp4_recipe: Any = None, **overrides: Any) -> Any:
    """Build a TE 2.20 recipe from nvfp4lab's name and (for NVFP4) an :class:`NVFP4Recipe`.

    Args:
        name: one of :data:`RECIPE_NAMES` (or an alias in :data:`RECIPE_ALIASES`).
        nvfp4_recipe: for ``"nvfp4"`` / ``"nvfp4-reference"``: any object with the
            boolean attributes ``disable_rht``, ``disable_stochastic_rounding`` and
            ``disable_2d_quantization`` (nvfp4lab's ``NVFP4Recipe``); they are passed
            explicitly, so TE's ``NVTE_NVFP4_*`` environment defaults do not apply. ``None``
            keeps TE's defaults (RHT, SR and 2D weights on, unless those variables say
            otherwise). Model-level fields (``bf16_first_layers``, ``bf16_last_layers``,
            ``quantize_lm_head``) are not recipe settings: the model applies them with
            nested :func:`autocast`. Ignored for the FP8 names.
        **overrides: extra keyword arguments for the TE recipe's constructor (e.g.
            ``amax_history_len=16`` for ``"fp8-delayed"``); they win over ``nvfp4_recipe``.
            Not accepted for ``"nvfp4-reference"``.

    Returns:
        a ``transformer_engine.common.recipe.Recipe`` instance. ``"nvfp4-reference"``
        ignores ``disable_stochastic_rounding`` (the reference never rounds stochastically).

    Raises:
        ValueError: unknown name, or overrides for ``"nvfp4-reference"``.
        TypeError: ``nvfp4_recipe`` lacks one of the three flags.
        TransformerEngineUnavailable: without TE.
    """
    key = RECIPE_ALIASES.get(name, name)
    if key not in RECIPE_NAMES:
        accepted = ", ".join(RECIPE_NAMES + tuple(RECIPE_ALIASES))
        raise ValueError(f"unknown TE recipe name {name!r}; expected one of: {accepted}")
    flags: dict[str, bool] = {}
    if nvfp4_recipe is not None and key in ("nvfp4", "nvfp4-reference"):
        missing = [f for f in _NVFP4_FLAGS if not hasattr(nvfp4_recipe, f)]
        if missing:
            raise TypeError(f"nvfp4_recipe {type(nvfp4_recipe).__name__} lacks {missing}; expected an NVFP4Recipe")
        flags = {f: bool(getattr(nvfp4_recipe, f)) for f in _NVFP4_FLAGS}
        flags.update({f: getattr(nvfp4_recipe, f) for f, d in _NVFP4_OPTION_DEFAULTS.items()
                      if getattr(nvfp4_recipe, f, d) != d})
    r = _te_recipe_module()
    if key == "nvfp4":
        return r.NVFP4BlockScaling(**{**flags, **overrides})
    if key == "nvfp4-reference":
        if overrides:
            raise ValueError(f"'nvfp4-reference' takes no recipe overrides, got {sorted(overrides)}")
        extra = sorted(set(flags) - set(_NVFP4_FLAGS))
        if extra:
            raise ValueError(f"'nvfp4-reference' (nvfp4lab's factory of TE's NVFP4QuantizerRef) does not pass "
                             f"the NVFP4Recipe field(s) {extra}; use 'nvfp4' or the emulated backend")
        factory = nvfp4_reference_factory(
            disable_rht=flags.get("disable_rht", False),
            disable_2d_quantization=flags.get("disable_2d_quantization", False),
        )
        return r.CustomRecipe(qfactory=factory)
    cls = {
        "fp8-current": r.Float8CurrentScaling,
        "fp8-delayed": r.DelayedScaling,
        "fp8-block": r.Float8BlockScaling,
        "mxfp8": r.MXFP8BlockScaling,
    }[key]
    return cls(**overrides)


def recipe_format(recipe: Any) -> str:
    """The probe's format key for a TE recipe instance.

    ``NVFP4BlockScaling`` → ``"nvfp4"``, ``MXFP8BlockScaling`` → ``"mxfp8"``,
    ``Float8BlockScaling`` → ``"fp8-block"``, ``DelayedScaling`` → ``"fp8-delayed"``,
    ``Float8CurrentScaling`` → ``"fp8-current"``; ``CustomRecipe`` and anything else →
    ``"fp8-current"``, because TE gates those on its generic FP8 check (SM >= 8.9;
    TE ``quantization.py::check_recipe_support``).
    """
    r = _te_recipe_module()
    for cls_name, key in (
        ("NVFP4BlockScaling", "nvfp4"),
        ("MXFP8BlockScaling", "mxfp8"),
        ("Float8BlockScaling", "fp8-block"),
        ("DelayedScaling", "fp8-delayed"),
        ("Float8CurrentScaling", "fp8-current"),
    ):
        cls = getattr(r, cls_name, None)
        if cls is not None and isinstance(recipe, cls):
            return key
    return "fp8-current"


def _raise_unsupported(te: Any, key: str, name: str) -> None:
    """Raise NVFP4NotSupported / RecipeNotSupported if format ``key`` is not native here."""
    support = recipe_support(key, te)
    if support.native:
        return
    if key == "nvfp4":
        fp8 = recipe_support("fp8-current", te)
        if fp8.native:
            fallbacks = f"{FALLBACKS}."
        else:
            fallbacks = f"{_FALLBACK_NO_FP8} (FP8 through TE is unavailable too: {fp8.reason})"
        raise NVFP4NotSupported(
            f"{name} cannot run here: {support.reason} Fallbacks: {fallbacks}",
            format_key=key,
            reason=support.reason,
        )
    raise RecipeNotSupported(
        f"{name} cannot run here: {support.reason} Run `nvfp4lab probe` to see which formats this "
        f"machine runs natively; BF16 (--precision bf16) or {_FALLBACK_NO_FP8} work everywhere.",
        format_key=key,
        reason=support.reason,
    )


def check_recipe(recipe: Any) -> None:
    """Raise if ``recipe`` cannot run natively on the current CUDA device.

    Uses :func:`nvfp4lab.capabilities.recipe_support` (TE's ``is_*_available(return_reason=True)``
    for the recipe's format, the compute-capability rules without a GPU).

    Raises:
        NVFP4NotSupported: ``NVFP4BlockScaling`` below compute capability 10.0 (or no GPU);
            the message is ``"NVFP4BlockScaling cannot run here: <probe reason> Fallbacks: <FALLBACKS>."``
        RecipeNotSupported: any other recipe the probe says cannot run here.
        TransformerEngineUnavailable: without TE.
    """
    te = require_te()
    _raise_unsupported(te, recipe_format(recipe), type(recipe).__name__)


def _default_recipe(te: Any) -> Any:
    """TE's default recipe for this GPU (``get_default_recipe``, or ``get_default_fp8_recipe``)."""
    fn = getattr(te, "get_default_recipe", None)
    if fn is None:
        from transformer_engine.pytorch.quantization import get_default_fp8_recipe as fn  # noqa: PLC0415
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


@contextlib.contextmanager
def autocast(recipe: Any = None, enabled: bool = True, amax_reduction_group: Any = None) -> Iterator[Any]:
    """``te.autocast`` with the recipe checked first (not the deprecated ``fp8_autocast``).

    Run the forward pass inside the context and call ``.backward()`` outside it, as with
    ``te.autocast``. Nest ``autocast(recipe, enabled=False)`` around layers that must
    stay in BF16 (the inner context wins).

    Args:
        recipe: a TE recipe, or a name for :func:`make_recipe`; ``None`` means TE's default
            (``te.get_default_recipe()``: DelayedScaling on Hopper, MXFP8 on SM 10.x).
        enabled: False runs TE modules in high precision (BF16), without any check.
        amax_reduction_group: forwarded to ``te.autocast`` (distributed amax reduction).

    Yields:
        the recipe in use (``None`` stays ``None`` when ``enabled`` is False).

    Raises (on entry, before ``te.autocast`` is entered):
        TransformerEngineUnavailable: without TE (the message has the install command).
        NVFP4NotSupported: NVFP4 requested below compute capability 10.0 (probe's reason + fallbacks).
        RecipeNotSupported: another recipe this machine cannot run.
    """
    te = require_te()
    if isinstance(recipe, str):
        recipe = make_recipe(recipe)
    if enabled:
        if recipe is None:
            # TE's default needs a GPU to be resolved; every default is an FP8 recipe.
            _raise_unsupported(te, "fp8-current", "The default TE recipe")
            recipe = _default_recipe(te)
        check_recipe(recipe)
    with te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=amax_reduction_group):
        yield recipe
