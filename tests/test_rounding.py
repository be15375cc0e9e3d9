"""Tests for nvfp4lab.rounding.stochastic_round_e2m1: known answers from given draws, and its checks."""

import pytest
import torch

from nvfp4lab.rounding import stochastic_round_e2m1


def test_given_draws_round_up_exactly_below_the_fraction():
    # 0.25 lies halfway between 0 (code 0) and 0.5 (code 1): up iff u < 0.5. 5.0 between 4 (code 6)
    # and 6 (code 7): up iff u < 0.5. -2.75 between 2 and 3 with fraction 0.75: code 4 or 5, sign 8.
    # 7.0 saturates to 6 (code 7); a grid value (1.5, code 3) never moves.
    x = torch.tensor([0.25, 0.25, 5.0, 5.0, -2.75, -2.75, 7.0, 1.5])
    u = torch.tensor([0.49, 0.5, 0.4999, 0.5, 0.74, 0.75, 0.99, 0.0])
    assert stochastic_round_e2m1(x, uniform=u).tolist() == [1, 0, 7, 6, 8 | 5, 8 | 4, 7, 3]


@pytest.mark.parametrize("bad, err, match", [
    (torch.full((4,), 1.0), ValueError, r"\[0, 1\)"),
    (torch.full((4,), -0.25), ValueError, r"\[0, 1\)"),
    (torch.tensor([0.1, float("nan"), 0.2, 0.3]), ValueError, "NaN"),
    (torch.zeros(4, dtype=torch.int32), TypeError, "float tensor"),
    (torch.zeros(5), ValueError, "shape"),
    (torch.zeros(4, device="meta"), ValueError, "meta"),
])
def test_bad_draws_are_refused(bad, err, match):
    with pytest.raises(err, match=match):
        stochastic_round_e2m1(torch.tensor([0.1, 0.2, 0.3, 0.4]), uniform=bad)
