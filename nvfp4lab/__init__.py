"""nvfp4lab: NVFP4 training from first principles, bit-exact with Transformer Engine 2.20.

The numerics live in one module per concept:

* :mod:`nvfp4lab.formats`   E2M1 codes, packing, E4M3 rounding
* :mod:`nvfp4lab.quantize`  two-level scaling, 1D/2D blocks, ``NVFP4Tensor``, GEMM emulation
* :mod:`nvfp4lab.hadamard`  the 16-point random Hadamard transform (RHT)
* :mod:`nvfp4lab.rounding`  stochastic rounding (SR)
* :mod:`nvfp4lab.metrics`   error metrics
* :mod:`nvfp4lab.variants`  comparison quantizers (per-tensor FP4, any block size, MXFP4)
* :mod:`nvfp4lab.recipe`, :mod:`nvfp4lab.linear`, :mod:`nvfp4lab.fp8`   the NVFP4 recipe, the
  emulated NVFP4 linear layer (Fprop/Dgrad/Wgrad as TE), FP8 current-scaling emulation
* :mod:`nvfp4lab.fp8_recipes`, :mod:`nvfp4lab.mx`, :mod:`nvfp4lab.emulated`   FP8 block and delayed
  scaling, MXFP8 and MXFP4 emulation, and the block-scaled tensor, GEMM and linear layer they share
* :mod:`nvfp4lab.model`, :mod:`nvfp4lab.data`, :mod:`nvfp4lab.training`   a small GPT, the corpus, training
* :mod:`nvfp4lab.capabilities` (the function ``nvfp4lab.probe``), :mod:`nvfp4lab.te`, :mod:`nvfp4lab.te_model`   hardware probe, Transformer Engine
* :mod:`nvfp4lab.kernels`   Triton kernels used automatically on CUDA
* :mod:`nvfp4lab.provenance`, :mod:`nvfp4lab.precisions`, :mod:`nvfp4lab.testing`   result-file environment,
  the precision table, bit-equality assertions

Nothing imported here needs a GPU or Transformer Engine.
"""

from . import metrics, variants
from .formats import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    decode_e2m1,
    encode_e2m1,
    pack_fp4,
    to_e4m3,
    unpack_fp4,
)
from .hadamard import WGRAD_SIGNS, inverse_random_hadamard_transform, random_hadamard_transform
from .quantize import NVFP4Tensor, fake_quantize, nvfp4_matmul, quantize
from .rounding import stochastic_round_e2m1
from .recipe import NVFP4Recipe
from .linear import NVFP4Linear, convert_model
from .training import RunResult, TrainConfig, compare, train
from .capabilities import Capabilities, probe
from .provenance import package_version

__version__ = package_version()

__all__ = [
    "Capabilities",
    "NVFP4Linear",
    "NVFP4Recipe",
    "RunResult",
    "TrainConfig",
    "compare",
    "convert_model",
    "probe",
    "train",
    "variants",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "NVFP4Tensor",
    "WGRAD_SIGNS",
    "decode_e2m1",
    "encode_e2m1",
    "fake_quantize",
    "inverse_random_hadamard_transform",
    "metrics",
    "nvfp4_matmul",
    "pack_fp4",
    "quantize",
    "random_hadamard_transform",
    "stochastic_round_e2m1",
    "to_e4m3",
    "unpack_fp4",
]
