"""Gradient accumulation for `LossScaleOptimizer`: one applied step per window of micro-batches.

The window's unscaled gradients are summed in float32 variables; when the window is full their
mean goes through the optimizer's one finite check and is applied (or skipped) once. A
micro-batch with an Inf/NaN spoils the whole window: the mean of each variable whose gradient
was not finite in the window reaches the finite check as a NaN, so the window is skipped, the
scale backs off once, and the overflow is attributed to those variables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

# Internal module: the package exports nothing from it (other modules import what they use).
__all__: list[str] = []


def _sum_dtype(dtype: Any) -> str:
    """float64 variables are summed in float64, everything narrower in float32."""
    return "float64" if str(getattr(dtype, "name", dtype)) == "float64" else "float32"


class GradientAccumulator(tf.Module):
    """The accumulation state (variables) and the per-micro-batch update.

    Args:
        steps: Int >= 2. Micro-batches per applied step.
        add_variable: Callable `(name, shape, dtype, initial_value) -> variable`, the
            optimizer's (so checkpoints carry a half-full window).
        var_list: List of variables. One float32 sum is made for each.
    """

    def __init__(
        self, steps: int, add_variable: Callable[..., Any], var_list: Sequence[Any]
    ) -> None:
        super().__init__(name="gradient_accumulator")
        self.steps = steps
        self.micro_step = add_variable("micro_step", (), "int", 0)
        self.window_nonfinite = add_variable("window_nonfinite", (len(var_list),), "int", 0)
        self.sums = [
            add_variable("accumulated_gradient", tuple(v.shape), _sum_dtype(v.dtype), 0.0)
            for v in var_list
        ]

    def add(
        self,
        grads: Sequence[Any],
        indices: Sequence[int],
        nonfinite: tf.Tensor,
        apply_window: Callable[[list[Any]], None],
    ) -> None:
        """Adds one micro-batch; at the end of the window, applies the mean and starts over.

        Each call is one micro-batch, so it must cover every variable (`None` where a variable
        has no gradient); a call on part of the variables raises.

        Args:
            grads: Unscaled gradients (`None` for a variable without one this micro-batch).
            indices: The position of each gradient's variable (as in `build`'s `var_list`).
            nonfinite: Int vector, one entry a variable (in `build`'s order): 1 where this
                micro-batch's gradient was not finite (the optimizer's `check_step`).
            apply_window: Called with the window's mean gradient of every variable, in the
                order of `build`'s `var_list`, at the end of the window.
        """
        self._check_call(indices)
        finite = tf.equal(tf.reduce_max(nonfinite), 0)
        for index, grad in zip(indices, grads):
            if grad is None:
                continue
            total = self.sums[index]
            values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
            values = tf.where(finite, tf.cast(values, total.dtype), tf.zeros((), total.dtype))
            if isinstance(grad, tf.IndexedSlices):
                total.value.scatter_add(tf.IndexedSlices(values, grad.indices, grad.dense_shape))
            else:
                total.assign_add(values)
        window = self.window_nonfinite.value
        self.window_nonfinite.assign(tf.maximum(window, tf.cast(nonfinite, window.dtype)))
        self.micro_step.assign_add(1)
        keras.ops.cond(
            self.micro_step.value >= self.steps,
            lambda: self._end_window(apply_window),
            lambda: None,
        )

    def _check_call(self, indices: Sequence[int]) -> None:
        strategy = tf.distribute.get_strategy()
        if strategy.num_replicas_in_sync > 1:
            raise ValueError(
                "accumulation_steps > 1 is not supported under a tf.distribute strategy with "
                f"{strategy.num_replicas_in_sync} replicas yet. Use accumulation_steps=1 and a "
                f"larger global batch instead. Received: accumulation_steps={self.steps!r}"
            )
        if sorted(indices) != list(range(len(self.sums))):
            raise ValueError(
                f"With accumulation_steps={self.steps}, each apply() is one micro-batch and "
                f"must cover all {len(self.sums)} variables of the optimizer (pass None for a "
                f"variable without a gradient). Received gradients for {len(indices)} of them."
            )

    def _end_window(self, apply_window: Callable[[list[Any]], None]) -> None:
        window = self.window_nonfinite.value
        # A variable whose gradient was not finite in the window reaches the one finite check
        # as a NaN mean: the window is skipped, backs off once, and is attributed to it.
        nan = float("nan")
        means = [
            tf.where(window[i] > 0, tf.constant(nan, total.dtype), total.value / self.steps)
            for i, total in enumerate(self.sums)
        ]
        apply_window(means)
        for total in self.sums:
            total.assign(tf.zeros_like(total.value))
        self.micro_step.assign(0)
        self.window_nonfinite.assign(tf.zeros_like(window))
