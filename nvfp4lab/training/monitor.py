"""Loss-spike and gradient-norm-spike detection: a z-score against running (EMA) statistics.

A training step's loss (or gradient norm) is a spike when it lies more than ``z`` standard
deviations above the exponential moving average of the values before it. The mean and variance
are exponentially weighted with weight ``alpha`` per step (an effective window of about
``1/alpha`` steps); the first ``warmup`` values only feed the statistics (early training moves too
fast for a running baseline), and a spike does not feed them (it would raise its own baseline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["SpikeDetector"]


@dataclass
class SpikeDetector:
    """Flags values far above their running mean.

    Attributes:
        z: threshold in standard deviations (> 0).
        alpha: EMA weight of each new value, in (0, 1).
        warmup: values seen before any is judged.

    Raises:
        ValueError: ``z <= 0``, ``alpha`` outside (0, 1) or ``warmup < 2``.
    """

    z: float = 6.0
    alpha: float = 0.05
    warmup: int = 20
    seen: int = field(default=0, init=False)
    mean: float = field(default=0.0, init=False)
    var: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if not self.z > 0 or not 0 < self.alpha < 1 or self.warmup < 2:
            raise ValueError(f"SpikeDetector needs z > 0, 0 < alpha < 1 and warmup >= 2; got z={self.z}, "
                             f"alpha={self.alpha}, warmup={self.warmup}")

    def update(self, value: float) -> float | None:
        """Judge ``value`` (a finite number), then fold it into the statistics unless it is a spike.

        Returns:
            Its z-score when it is a spike, else ``None``.
        """
        if self.seen >= self.warmup and self.var > 0:
            score = (value - self.mean) / math.sqrt(self.var)
            if score > self.z:
                return score
        if self.seen == 0:
            self.mean = value
        else:  # West's exponentially weighted mean and variance
            diff = value - self.mean
            incr = self.alpha * diff
            self.mean += incr
            self.var = (1 - self.alpha) * (self.var + diff * incr)
        self.seen += 1
        return None
