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


def test_non_finite_inputs_follow_ieee_and_never_raise():
    """An Inf only in the approximation made sqnr_db's ratio 0 and math.log10 raise 'math domain
    error'; it is -inf, as the docstring says."""
    inf, nan = math.inf, math.nan
    x = torch.tensor([1.0, 2.0])
    y_inf = torch.tensor([1.0, inf])
    assert metrics.sqnr_db(x, y_inf) == -inf
    assert metrics.mse(x, y_inf) == inf and metrics.relative_error(x, y_inf) == inf
    assert math.isnan(metrics.sqnr_db(y_inf, x))   # inf signal over inf noise
    assert math.isnan(metrics.mse(y_inf, y_inf))   # inf - inf
    y_nan = torch.tensor([nan, 2.0])
    for f in (metrics.mse, metrics.sqnr_db, metrics.relative_error, metrics.max_abs_error):
        assert math.isnan(f(x, y_nan)) and math.isnan(f(y_nan, x))
        assert "Raises:" in f.__doc__ and "Args:" in f.__doc__
