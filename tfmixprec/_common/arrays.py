"""Host copies of the values a replay looks at (diagnosis, calibration): the floating-point
arrays of a nested structure as float32 NumPy arrays, and their NaN/Inf count."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__: list[str] = []  # private module: nothing here is part of the package's API


def float_array(value: Any) -> np.ndarray:
    """One tensor, `tf.IndexedSlices` (its values) or array as a float32 NumPy array."""
    if isinstance(value, tf.IndexedSlices):
        value = value.values
    if tf.is_tensor(value):
        return tf.cast(value, tf.float32).numpy()
    return np.asarray(value).astype(np.float32)


def float_arrays(value: Any) -> list[np.ndarray]:
    """The floating-point arrays (float16, bfloat16, float32, float64) in a nested structure of
    tensors, arrays and numbers, as float32 NumPy arrays; anything else is left out."""
    arrays = []
    for item in keras.tree.flatten(value):
        if item is None:
            continue
        if tf.is_tensor(item):
            floating = item.dtype.is_floating
        else:
            dtype = np.asarray(item).dtype
            floating = np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"
        if floating:
            arrays.append(float_array(item))
    return arrays


def nonfinite_count(value: Any) -> int:
    """How many NaN/Inf values the floating-point arrays in `value` hold."""
    return sum(int((~np.isfinite(array)).sum()) for array in float_arrays(value))
