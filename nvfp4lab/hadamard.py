"""The 16-point random Hadamard transform (RHT) of the NVFP4 recipe.

NVFP4 training rotates both operands of the **Wgrad** GEMM ``dW = dYᵀ X`` along
the token axis, in chunks of 16, before quantizing them. The rotation spreads a
block's outliers over all 16 elements, so one large value no longer forces a
large block scale that flushes its neighbours to zero. Because the rotation is
orthogonal (``R Rᵀ = I``) it cancels inside the GEMM.

The transform (TE ``reference_nvfp4.py::_build_hadamard_matrix`` / ``_apply_rht``,
``pytorch/tensor/nvfp4_tensor.py::get_rht_matrix``):

* ``H16``: Sylvester Hadamard matrix in natural order, ``H[i, j] = (-1)^popcount(i & j)``.
* ``s``: one fixed sign vector for every layer and step (TE ``get_wgrad_sign_vector``),
  ``[1,1,1,-1,1,-1,-1,-1,-1,-1,-1,1,-1,1,-1,-1]`` (bit mask 0xD7E8 where ``s_i = -1``).
* ``R = diag(s) @ H16 / 4`` and each 16-chunk row vector ``x`` maps to ``x @ R``,
  i.e. ``y = ((x ⊙ s) @ H16) / 4``.

TE computes the product with FP32 accumulation and rounds it to BF16 ("downcast to BF16 for
bit-wise compatibility"). Here the 16-term sum is computed in float64, then rounded to
float32 (what an FP32 accumulator that rounds once would hold) and from there to the input
dtype (for float32 input that is the only rounding). A sum of 16 terms of p significant bits
whose largest and smallest non-zero magnitudes are less than 2^r apart is exact in a format
of p + r + 4 significant bits, so the float64 sum (53 bits) is exact for any float16 input,
for bfloat16 blocks spanning less than 2^41 and for float32 blocks spanning less than 2^25.
For BF16 input it equals TE's result whenever TE's FP32 accumulation is exact, which holds
for blocks spanning less than about 2^12 (beyond that TE's result can depend on its
summation order).
"""

from __future__ import annotations

import torch

from .formats import check_float_tensor

__all__ = [
    "RHT_SIZE",
    "WGRAD_SIGNS",
    "WGRAD_SIGN_MASK",
    "hadamard_matrix",
    "rht_matrix",
    "random_hadamard_transform",
    "inverse_random_hadamard_transform",
]

#: The transform length. TE's kernels assert ``hadamard_dimension == 16``.
RHT_SIZE = 16
#: TE 2.20's fixed random sign vector (``get_wgrad_sign_vector``).
WGRAD_SIGNS = torch.tensor(
    [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=torch.float32
)
#: The same signs as a bit mask: bit ``i`` set where ``s_i = -1``.
WGRAD_SIGN_MASK = 0xD7E8


def hadamard_matrix(n: int = RHT_SIZE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unnormalised Sylvester Hadamard matrix ``H[i, j] = (-1)^popcount(i & j)``, shape ``[n, n]``.

    Raises:
        ValueError: ``n`` is not a positive power of two.
    """
    if not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a positive power of two, got {n!r}")
    i = torch.arange(n)
    parity = torch.zeros(n, n, dtype=torch.int64)
    bits = i[:, None] & i[None, :]
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(dtype)


def _check_signs(signs: torch.Tensor | None) -> torch.Tensor:
    if signs is None:
        return torch.ones(RHT_SIZE)
    signs = torch.as_tensor(signs, dtype=torch.float32).flatten()
    if signs.numel() != RHT_SIZE or not bool(((signs == 1) | (signs == -1)).all()):
        raise ValueError(f"signs must be {RHT_SIZE} values of ±1, got {signs.tolist()}")
    return signs


def rht_matrix(signs: torch.Tensor | None = WGRAD_SIGNS, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthogonal 16×16 matrix ``R = diag(signs) @ H16 / 4`` (``signs=None``: plain ``H16/4``).

    Its entries are ±0.25, exact in every float dtype. ``R @ R.T == I``.

    Raises:
        ValueError: ``signs`` is not 16 values of ±1.
    """
    s = _check_signs(signs)
    return (s[:, None] * hadamard_matrix(RHT_SIZE, torch.float32) * 0.25).to(dtype)


def _blockwise(x: torch.Tensor, matrix: torch.Tensor, what: str) -> torch.Tensor:
    check_float_tensor(x, what)
    if x.dim() == 0 or x.shape[-1] % RHT_SIZE:
        raise ValueError(
            f"{what}: the last dimension ({x.shape[-1] if x.dim() else 'scalar'}) must be a multiple of "
            f"{RHT_SIZE}; the RHT works on 16-element chunks (TE rejects other sizes too)"
        )
    blocks = x.reshape(-1, RHT_SIZE).to(torch.float64)
    y = blocks @ matrix.to(device=x.device, dtype=torch.float64)
    if x.dtype != torch.float64:
        # One rounding to float32 (exact sum -> nearest float32), then to the input dtype.
        y = y.to(torch.float32).to(x.dtype)
    return y.reshape(x.shape)


def random_hadamard_transform(x: torch.Tensor, *, signs: torch.Tensor | None = WGRAD_SIGNS) -> torch.Tensor:
    """Apply the RHT along the last dimension in chunks of 16: each chunk ``v`` becomes ``v @ R``.

    Args:
        x: float tensor ``[..., K]`` with ``K % 16 == 0`` (any float dtype, any device).
        signs: the 16 ±1 signs of ``R = diag(signs) H16 / 4``; default TE's fixed
            Wgrad vector; ``None`` for the plain normalised Hadamard matrix.

    Returns:
        Tensor of ``x``'s shape and dtype: the exact transform rounded to float32,
        then to ``x.dtype`` (for BF16 input: TE's FP32-accumulate-then-BF16 result, where
        TE's FP32 sum is exact; see the module docstring for the range).

    Raises:
        TypeError: non-float dtype. ValueError: ``K`` not a multiple of 16, bad signs.

    Source: TE ``reference_nvfp4.py::_apply_rht``.
    """
    return _blockwise(x, rht_matrix(signs), "random_hadamard_transform input")


def inverse_random_hadamard_transform(
    y: torch.Tensor, *, signs: torch.Tensor | None = WGRAD_SIGNS
) -> torch.Tensor:
    """Undo :func:`random_hadamard_transform`: each 16-chunk ``u`` becomes ``u @ Rᵀ``.

    Same shapes, dtypes and errors as the forward transform. The round trip is
    exact up to each direction's rounding (to float32, then to ``y.dtype``).
    """
    return _blockwise(y, rht_matrix(signs).T, "inverse_random_hadamard_transform input")
