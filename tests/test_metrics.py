import math

import pytest
import torch

from nvfp4lab import metrics


def test_known_answers():
    x = torch.tensor([3.0, 4.0])
    y = torch.tensor([3.0, 3.0])
    assert metrics.mse(x, y) == 0.5
    assert metrics.max_abs_error(x, y) == 1.0
    assert metrics.relative_error(x, y) == pytest.approx(1 / 5)
    assert metrics.sqnr_db(x, y) == pytest.approx(10 * math.log10(25 / 1))
    assert metrics.sqnr_db(x, x) == math.inf
    assert metrics.relative_error(torch.zeros(2), torch.zeros(2)) == 0.0


def test_errors():
    with pytest.raises(ValueError, match="shapes differ"):
        metrics.mse(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="empty"):
        metrics.mse(torch.zeros(0), torch.zeros(0))
