"""Gradient accumulation for `LossScaleOptimizer`: one applied step per window of micro-batches.

Each replica sums its window's unscaled gradients in float32 variables of its own (its copy
of each mirrored sum; nothing crosses replicas during the window). When the window is full,
each replica's mean goes through the optimizer's one finite check and is applied (or skipped)
once: the finite flags and the gradients are all-reduced then, once per applied step, so the
step equals one batch as large as the window's micro-batches on all replicas together. A
micro-batch with an Inf/NaN on any replica spoils the whole window: the mean of each variable
whose gradient was not finite reaches the finite check as a NaN, so every replica skips the
window, the scale backs off once, and the overflow is attributed to those variables. A
variable the optimizer overwrites with its "gradient" (a float8 scale or amax history) gets
the window's largest value instead of the mean, as in Keras's own accumulation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tfmixprec._keras.fit import update_each_copy

# Internal module: the package exports nothing from it (other modules import what they use).
__all__: list[str] = []


def _sum_dtype(dtype: Any) -> str:
    """float64 variables are summed in float64, everything narrower in float32."""
    return "float64" if str(getattr(dtype, "name", dtype)) == "float64" else "float32"


def _add(copy: Any, value: Any) -> Any:
    if isinstance(value, tf.IndexedSlices):
        return copy.scatter_add(value)
    return copy.assign_add(value)


def _assign_max(copy: Any, value: Any) -> Any:
    return copy.assign(tf.maximum(copy.read_value(), value))


def _overwritten(variable: Any) -> bool:
    """Whether the optimizer overwrites `variable` with its "gradient" (a float8 layer's new
    scale or amax history): a window keeps the largest of its micro-batches' values, as
    Keras's own gradient accumulation does, not their mean."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def _clear(copy: Any) -> Any:
    return copy.assign(tf.zeros_like(copy.read_value()))


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
        apply_when: Callable[..., None],
        variables: Sequence[Any],
    ) -> None:
        """Adds one micro-batch of this replica; at the end of the window, applies the mean
        and starts over.

        Each call is one micro-batch, so it must cover every variable (`None` where a variable
        has no gradient); a call on part of the variables raises.

        Args:
            grads: Unscaled gradients (`None` for a variable without one this micro-batch).
            indices: The position of each gradient's variable (as in `build`'s `var_list`).
            nonfinite: Int vector, one entry a variable (in `build`'s order): 1 where this
                replica's gradient was not finite in this micro-batch.
            apply_when: The optimizer's `apply_when(ready, window, clear)`.
            variables: The optimizer's variables, in `build`'s order.
        """
        self._check_call(indices)
        finite = tf.equal(tf.reduce_max(nonfinite), 0)
        updates = []
        for index, grad in zip(indices, grads):
            if grad is None:
                continue
            total = self.sums[index]
            values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
            values = tf.where(finite, tf.cast(values, total.dtype), tf.zeros((), total.dtype))
            if isinstance(grad, tf.IndexedSlices):
                values = tf.IndexedSlices(values, grad.indices, grad.dense_shape)
            updates.append(
                (total, _assign_max if _overwritten(variables[index]) else _add, (values,))
            )
        window = tf.cast(nonfinite, self.window_nonfinite.dtype)
        one = tf.constant(1, self.micro_step.dtype)
        updates += [
            (self.window_nonfinite, _assign_max, (window,)),
            (self.micro_step, _add, (one,)),
        ]
        update_each_copy(updates)  # one merge_call at the most, per micro-batch
        ready = self.micro_step.value.read_value() >= self.steps
        apply_when(ready, lambda: (self.window_means(variables), list(variables)), self.clear)

    def _check_call(self, indices: Sequence[int]) -> None:
        if sorted(indices) != list(range(len(self.sums))):
            raise ValueError(
                f"With accumulation_steps={self.steps}, each apply() is one micro-batch and "
                f"must cover all {len(self.sums)} variables of the optimizer (pass None for a "
                f"variable without a gradient). Received gradients for {len(indices)} of them."
            )

    def window_means(self, variables: Sequence[Any]) -> list[Any]:
        """This replica's mean gradient of the window, one a variable (in `variables`'
        dtype); NaN for a variable whose gradient was not finite in the window, so that the
        one finite check skips the window and blames it."""
        window = self.window_nonfinite.value.read_value()
        nan = float("nan")
        return [
            tf.cast(
                tf.where(
                    window[i] > 0,
                    tf.constant(nan, total.dtype),
                    total.value.read_value() / (1 if _overwritten(variable) else self.steps),
                ),
                variable.dtype,
            )
            for i, (total, variable) in enumerate(zip(self.sums, variables))
        ]

    def clear(self) -> None:
        """Starts a new window (on this replica, or on all of them in cross-replica context)."""
        update_each_copy(
            [(v, _clear, ()) for v in (*self.sums, self.window_nonfinite, self.micro_step)]
        )
