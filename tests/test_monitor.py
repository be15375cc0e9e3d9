"""SpikeDetector: fires on an injected spike, not on a normal (noisy, decaying) loss curve."""

import math
import random

import pytest

from nvfp4lab.training.monitor import SpikeDetector


def _curve(n, seed):
    rng = random.Random(seed)
    return [2.0 + 3.0 * math.exp(-i / 60) + rng.gauss(0, 0.02) for i in range(n)]


def test_normal_runs_do_not_fire():
    """500 noisy decaying curves of 400 steps: no false alarm at z = 6."""
    for seed in range(500):
        det = SpikeDetector(z=6.0)
        assert all(det.update(v) is None for v in _curve(400, seed)), seed


def test_an_injected_spike_fires_and_does_not_move_the_baseline():
    det = SpikeDetector(z=6.0)
    values = _curve(400, 0)
    for v in values[:300]:
        assert det.update(v) is None
    mean_before = det.mean
    score = det.update(values[300] + 1.0)   # a jump of 50 standard deviations of the noise
    assert score is not None and score > 6
    assert det.mean == mean_before
    assert det.update(values[301]) is None


def test_no_judgement_during_warmup_and_bad_parameters():
    det = SpikeDetector(z=3.0, warmup=10)
    assert [det.update(v) for v in [1.0] * 5 + [100.0]] == [None] * 6
    with pytest.raises(ValueError, match="z > 0"):
        SpikeDetector(z=0)
