"""Where gradients fall against float16's range: Figure 2 of the mixed-precision
paper, as numbers (`gradient_range_stats`, `GradientRangeStats`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfmixprec._common.dtypes import FLOAT16_MAX, FLOAT16_SMALLEST_NORMAL, FLOAT16_TINIEST
from tfmixprec.scaling.unscaling import gradient_values

__all__ = ["GradientRangeStats", "gradient_range_stats"]


@dataclasses.dataclass
class GradientRangeStats:
    """Where gradient magnitudes fall relative to float16's range.

    Fractions are of all values. `histogram` maps `floor(log2|g|)` to a count (zeros are not
    in it; see `zero_fraction`).
    """

    count: int
    zero_fraction: float
    underflow_fraction: float  # 0 < |g| < 2^-24: flushes to zero in float16
    subnormal_fraction: float  # 2^-24 <= |g| < 2^-14: float16 subnormal (lost precision)
    overflow_fraction: float  # |g| > 65504 (or Inf/NaN): overflows float16
    histogram: dict[int, int]
    min_abs_nonzero: float
    max_abs: float
    log2_abs: np.ndarray = dataclasses.field(repr=False)

    def percentile(self, q: float) -> float:
        """The q-th percentile (0-100) of the non-zero |g|."""
        if self.log2_abs.size == 0:
            return 0.0
        return float(2.0 ** np.percentile(self.log2_abs, q))

    def recommend_loss_scale(self, percentile: float = 1.0, max_scale: float = 2.0**24) -> float:
        """The power-of-two scale that lifts the `percentile`-th smallest non-zero |g| into
        float16's normal range (>= 2^-14) without pushing the largest past 65504.

        Args:
            percentile: Float in [0, 100]. Which of the smallest gradients must be normal.
            max_scale: Float. Upper bound on the answer.

        Returns:
            A float power of two (at least 1).

        Raises:
            ValueError: If `percentile` is outside [0, 100].
        """
        if not 0 <= percentile <= 100:
            raise ValueError(f"percentile must be in [0, 100]. Received: percentile={percentile!r}")
        if self.log2_abs.size == 0:
            return 1.0
        small = np.percentile(self.log2_abs, percentile)
        exponent = math.ceil(math.log2(FLOAT16_SMALLEST_NORMAL) - small)
        if self.max_abs > 0 and math.isfinite(self.max_abs):
            exponent = min(exponent, math.floor(math.log2(FLOAT16_MAX / self.max_abs)))
        exponent = min(exponent, math.floor(math.log2(max_scale)))
        return float(2.0 ** max(exponent, 0))


def gradient_range_stats(grads: Sequence[Any]) -> GradientRangeStats:
    """Computes, in float32, where gradient values fall relative to float16's range.

    Args:
        grads: List of tensors, arrays, `tf.IndexedSlices` or `None`.

    Returns:
        A `GradientRangeStats`.

    Example:

    >>> stats = tfmixprec.gradient_range_stats([np.array([0.0, 1e-9, 1e-6, 1.0])])
    >>> stats.underflow_fraction
    0.25
    """
    parts = [
        np.abs(np.asarray(tf.cast(grad, tf.float32)).ravel()) for grad in gradient_values(grads)
    ]
    values = np.concatenate(parts) if parts else np.zeros((0,), np.float32)
    count = int(values.size)
    if count == 0:
        return GradientRangeStats(0, 0.0, 0.0, 0.0, 0.0, {}, 0.0, 0.0, np.zeros((0,), np.float32))
    finite = np.isfinite(values)
    zeros = values == 0
    nonzero = values[(~zeros) & finite]
    log2_abs = np.log2(nonzero).astype(np.float32)
    bins, counts = np.unique(np.floor(log2_abs).astype(np.int64), return_counts=True)
    return GradientRangeStats(
        count=count,
        zero_fraction=float(zeros.sum()) / count,
        underflow_fraction=float((nonzero < FLOAT16_TINIEST).sum()) / count,
        subnormal_fraction=float(
            ((nonzero >= FLOAT16_TINIEST) & (nonzero < FLOAT16_SMALLEST_NORMAL)).sum()
        )
        / count,
        overflow_fraction=float((nonzero > FLOAT16_MAX).sum() + (~finite).sum()) / count,
        histogram={int(b): int(c) for b, c in zip(bins, counts)},
        min_abs_nonzero=float(nonzero.min()) if nonzero.size else 0.0,
        max_abs=float(values[finite].max()) if finite.any() else math.inf,
        log2_abs=log2_abs,
    )
