"""Fault injection for testing mixed-precision training: make chosen steps non-finite.

`FaultInjector` decides, once, which steps are faulty (chosen ones or a random fraction), and
corrupts those steps' gradients or inputs with NaN or Inf, in the graph, by step index.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfmixprec._validate import check_int_at_least_one

__all__ = ["FaultInjector"]


class FaultInjector:
    """Makes chosen or random steps non-finite.

    Args:
        total_steps: Int. How many steps the schedule covers (steps beyond it are clean).
        steps: Iterable of ints. The 0-based steps to corrupt.
        rate: Float in [0, 1]. Instead of `steps`: corrupt each step with this probability
            (drawn once, with `seed`).
        seed: Int. Seed for `rate`.
        value: Float. `nan`, `inf` or `-inf`: what the corrupted values become.

    Raises:
        ValueError: For a bad count, rate, step or value, or both/neither of `steps`/`rate`.

    Example:

    >>> faults = tfmixprec.testing.FaultInjector(1000, rate=0.1, seed=0)
    >>> grads = faults.corrupt_gradients(grads)          # in a custom training step
    >>> dataset = faults.corrupt_dataset(dataset)        # or the inputs, for model.fit
    """

    def __init__(
        self,
        total_steps: int,
        steps: Iterable[int] | None = None,
        rate: float | None = None,
        seed: int = 0,
        value: float = float("nan"),
    ) -> None:
        total_steps = check_int_at_least_one("total_steps", total_steps)
        if (steps is None) == (rate is None):
            raise ValueError(
                "Pass exactly one of steps (which steps to corrupt) or rate (a random "
                f"fraction). Received: steps={steps!r}, rate={rate!r}"
            )
        if not isinstance(value, (int, float)) or math.isfinite(value):
            raise ValueError(f"value must be nan, inf or -inf. Received: value={value!r}")
        schedule = np.zeros(total_steps, dtype=bool)
        if steps is not None:
            steps = list(steps)
            bad = [
                s for s in steps if not isinstance(s, (int, np.integer)) or not 0 <= s < total_steps
            ]
            if bad:
                raise ValueError(
                    f"steps must be integers in [0, {total_steps}). Received: steps "
                    f"containing {bad[0]!r}"
                )
            schedule[steps] = True
        else:
            if not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
                raise ValueError(f"rate must be in [0, 1]. Received: rate={rate!r}")
            schedule = np.random.default_rng(seed).random(total_steps) < rate
        self.total_steps = total_steps
        self.value = float(value)
        self.schedule = schedule
        self._schedule = tf.constant(np.concatenate([schedule, [False]]))
        self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="fault_step")

    @property
    def injected_steps(self) -> list[int]:
        """The 0-based steps that are corrupted."""
        return [int(s) for s in np.flatnonzero(self.schedule)]

    def is_faulty(self, step: int) -> bool:
        """Whether 0-based `step` is corrupted."""
        return 0 <= step < self.total_steps and bool(self.schedule[step])

    def _flag(self, step: tf.Tensor) -> tf.Tensor:
        index = tf.minimum(tf.cast(step, tf.int64), self.total_steps)
        return tf.gather(self._schedule, index)

    def _poison(self, tensor: Any, flag: tf.Tensor) -> Any:
        if isinstance(tensor, tf.IndexedSlices):
            return tf.IndexedSlices(
                self._poison(tensor.values, flag), tensor.indices, tensor.dense_shape
            )
        tensor = tf.convert_to_tensor(tensor)
        if not tensor.dtype.is_floating:
            return tensor
        bad = tf.fill(tf.shape(tensor), tf.constant(self.value, tensor.dtype))
        return tf.where(flag, bad, tensor)

    def corrupt_gradients(self, grads: Sequence[Any]) -> list[Any]:
        """Returns `grads` with the first gradient made non-finite on a faulty step.

        Each call is one step (an internal counter advances, in the graph).

        Args:
            grads: List of gradients (tensors, `tf.IndexedSlices` or `None`).

        Returns:
            The list, corrupted or not.
        """
        flag = self._flag(self._step.assign_add(1) - 1)
        grads = list(grads)
        for i, grad in enumerate(grads):
            if grad is not None:
                grads[i] = self._poison(grad, flag)
                break
        return grads

    def corrupt_inputs(self, x: Any, step: Any) -> Any:
        """Returns the batch `x` (a tensor or nest), all float values non-finite on a faulty
        `step`.

        Args:
            x: Tensor or nest of tensors. One batch of inputs.
            step: Int tensor. The 0-based step of this batch.
        """
        flag = self._flag(step)
        return tf.nest.map_structure(lambda t: self._poison(t, flag), x)

    def corrupt_dataset(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """Corrupts the inputs of the faulty batches of a batched `(x, y, ...)` dataset.

        Args:
            dataset: `tf.data.Dataset` of batches whose first element is the inputs.

        Returns:
            A dataset with the same structure.
        """

        def corrupt(step, batch):
            if isinstance(batch, tuple):
                return (self.corrupt_inputs(batch[0], step),) + batch[1:]
            return self.corrupt_inputs(batch, step)

        return dataset.enumerate().map(corrupt)

    def reset(self) -> None:
        """Starts counting steps from 0 again (for `corrupt_gradients`)."""
        self._step.assign(0)
