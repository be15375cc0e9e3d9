"""The 16-point random Hadamard transform: the matrix, signs, orthogonality, rounding."""

import pytest
import torch

from nvfp4lab.hadamard import (
    WGRAD_SIGN_MASK,
    WGRAD_SIGNS,
    hadamard_matrix,
    inverse_random_hadamard_transform,
    random_hadamard_transform,
    rht_matrix,
)


def test_sylvester_entries():
    h = hadamard_matrix(16)
    for i in range(16):
        for j in range(16):
            assert h[i, j].item() == (-1) ** bin(i & j).count("1")


def test_sign_vector_matches_te_mask():
    mask = sum(1 << i for i, s in enumerate(WGRAD_SIGNS.tolist()) if s < 0)
    assert mask == WGRAD_SIGN_MASK == 0xD7E8


def test_rht_matrix_is_orthogonal_and_exact():
    r = rht_matrix()
    assert torch.equal(r @ r.T, torch.eye(16))
    assert set(r.abs().unique().tolist()) == {0.25}
    assert torch.equal(rht_matrix(dtype=torch.bfloat16).float(), r)
    assert torch.equal(rht_matrix(None), hadamard_matrix(16) / 4)


def test_transform_is_x_times_r_per_chunk():
    x = torch.randn(3, 32, dtype=torch.float64)
    y = random_hadamard_transform(x)
    r = rht_matrix().double()
    assert torch.allclose(y[:, 16:], x[:, 16:] @ r)
    assert torch.allclose(y.reshape(-1, 16), (x.reshape(-1, 16) * WGRAD_SIGNS.double()) @ hadamard_matrix(16).double() / 4)


def test_bf16_result_is_fp32_sum_rounded_once():
    """TE accumulates in fp32 and rounds to BF16 (TE nvfp4_tensor.py RHT); for randn BF16 that sum is exact."""
    x = torch.randn(64, 64).to(torch.bfloat16)
    want = (x.float().reshape(-1, 16) @ rht_matrix()).to(torch.bfloat16).reshape(x.shape)
    assert torch.equal(random_hadamard_transform(x), want)


def test_inverse_roundtrip():
    x = torch.randn(8, 48, dtype=torch.float64)
    assert torch.allclose(inverse_random_hadamard_transform(random_hadamard_transform(x)), x)


def test_rht_flattens_outlier_blocks():
    """One outlier per block: the transform spreads it over all 16 entries, cutting the
    block's crest factor (amax / rms) from ~4 to ~1."""
    x = torch.randn(128, 64) * 0.1
    x[:, ::16] = 8.0
    crest = lambda t: (t.reshape(-1, 16).abs().amax(-1) / t.reshape(-1, 16).pow(2).mean(-1).sqrt())
    assert crest(x).mean() > 3.5
    assert crest(random_hadamard_transform(x)).mean() < 1.5


def test_errors():
    with pytest.raises(ValueError, match="multiple of 16"):
        random_hadamard_transform(torch.randn(4, 20))
    with pytest.raises(ValueError, match="±1"):
        random_hadamard_transform(torch.randn(4, 16), signs=torch.ones(8))
    with pytest.raises(TypeError):
        random_hadamard_transform(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)
