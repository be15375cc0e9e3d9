"""E2M1 encoding, packing and E4M3 rounding: known answers and brute-force properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nvfp4lab.formats import (
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    decode_e2m1,
    encode_e2m1,
    pack_fp4,
    to_e4m3,
    unpack_fp4,
)


def test_constants():
    assert E2M1_VALUES.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert E2M1_MAX == 6.0 and E4M3_MAX == 448.0
    assert torch.finfo(torch.float8_e4m3fn).max == E4M3_MAX


def test_decode_all_sixteen_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = decode_e2m1(codes)
    assert vals[:8].tolist() == E2M1_VALUES.tolist()
    assert vals[8:].tolist() == (-E2M1_VALUES).tolist()
    assert math.copysign(1.0, vals[8].item()) == -1.0  # code 8 is -0


def test_ties_go_to_even_code():
    # TE cast_to_fp4x2: ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 -> 0, 1, 1, 2, 2, 4, 4
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert decode_e2m1(encode_e2m1(ties)).tolist() == [0, 1, 1, 2, 2, 4, 4]
    assert decode_e2m1(encode_e2m1(-ties)).tolist() == [-0.0, -1, -1, -2, -2, -4, -4]
    assert (encode_e2m1(ties) % 2 == 0).all()  # the mantissa bit of every tie result is 0


def test_just_off_the_ties():
    eps = 1e-6
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert decode_e2m1(encode_e2m1(t + eps)).tolist() == [0.5, 1, 1.5, 2, 3, 4, 6]
    assert decode_e2m1(encode_e2m1(t - eps)).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4]


def test_saturation_signed_zero_and_infinities():
    x = torch.tensor([6.0, 7.0, 1e30, float("inf"), -float("inf"), -0.0, 0.0, -0.1, -0.25, -0.26])
    assert encode_e2m1(x).tolist() == [7, 7, 7, 7, 15, 0, 0, 8, 8, 9]


def test_encode_accepts_bf16_and_half():
    x = torch.tensor([0.74, 0.76, 4.9])
    for dt in (torch.bfloat16, torch.float16):
        assert torch.equal(encode_e2m1(x.to(dt)), encode_e2m1(x.to(dt).float()))


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_encode_rejects_non_float(dtype):
    with pytest.raises(TypeError, match=str(dtype)):
        encode_e2m1(torch.zeros(4, dtype=dtype))


def test_encode_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        encode_e2m1(torch.tensor([1.0, float("nan")]))


def _brute_force_rne(v: float) -> int:
    """Nearest E2M1 magnitude, ties to the even code, by exhaustive comparison."""
    a = min(abs(v), 6.0)
    dists = [abs(a - g) for g in E2M1_VALUES.tolist()]
    best = min(dists)
    cands = [i for i, d in enumerate(dists) if d == best]
    mag = next((i for i in cands if i % 2 == 0), cands[0])
    return mag | (8 if v < 0 else 0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=1, max_size=64))
def test_encode_matches_brute_force(values):
    x = torch.tensor(values, dtype=torch.float32)
    assert encode_e2m1(x).tolist() == [_brute_force_rne(v) for v in x.tolist()]


def test_pack_known_byte_and_layout():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_fp4(codes).tolist() == [[0x21, 0x0F]]  # element 0 low nibble, element 1 high
    assert unpack_fp4(pack_fp4(codes)).tolist() == codes.tolist()


@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda v: len(v) % 2 == 0))
def test_pack_roundtrip(values):
    codes = torch.tensor(values, dtype=torch.uint8).reshape(1, -1)
    assert torch.equal(unpack_fp4(pack_fp4(codes)), codes)


def test_pack_errors():
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError):
        pack_fp4(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="0..15"):
        pack_fp4(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match="unpack_fp4"):
        decode_e2m1(torch.tensor([0x21], dtype=torch.uint8))


# All 126 non-negative finite E4M3 values (codes 0x00..0x7E), for brute-force rounding.
_E4M3_GRID = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _brute_force_e4m3(v: float) -> float:
    a = min(abs(v), 448.0)
    d = (_E4M3_GRID - a).abs()
    best = d.min()
    idx = torch.nonzero(d == best).flatten().tolist()
    i = next((j for j in idx if j % 2 == 0), idx[0])  # ties to even mantissa
    return math.copysign(_E4M3_GRID[i].item(), v)


@settings(max_examples=300, deadline=None)
@given(st.floats(-600, 600, allow_nan=False, width=32) | st.floats(-2.0**-6, 2.0**-6, allow_nan=False, width=32))
def test_to_e4m3_is_rne_with_saturation_and_subnormals(v):
    got = to_e4m3(torch.tensor([v])).float().item()
    assert got == _brute_force_e4m3(v)


def test_to_e4m3_edges():
    x = torch.tensor([1000.0, 448.0, 2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 0.0, float("inf")])
    assert to_e4m3(x).float().tolist() == [448.0, 448.0, 2.0**-9, 0.0, 2.0**-9, 0.0, 448.0]
