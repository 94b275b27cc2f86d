"""Argument checks shared by every module: one message per kind of bad value."""

from __future__ import annotations

import math
import numbers
from typing import Any

from tfmixprec._common.dtypes import FLOAT32_MAX, FLOAT32_TINY

__all__: list[str] = []  # private module: nothing here is part of the package's API


def check_bool(name: str, value: Any) -> bool:
    """Returns `value` if it is True or False; anything else (1, "yes") is a `TypeError`, as
    for every bool argument of tfmixprec."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False. Received: {name}={value!r}")
    return value


def is_number(value: Any) -> bool:
    """True for a real number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int_at_least_one(name: str, value: Any) -> int:
    """Returns `value` as an int; integral floats (`2.0`) are accepted, as Keras and TF 2 do."""
    integral = isinstance(value, numbers.Integral) or (
        isinstance(value, float) and math.isfinite(value) and value.is_integer()
    )
    if isinstance(value, bool) or not integral or value < 1:
        raise ValueError(f"{name} must be an integer >= 1. Received: {name}={value!r}")
    return int(value)


def check_update_freq(value: Any) -> str | int:
    """Returns a callback's `update_freq` as Keras's `TensorBoard` takes it: `"epoch"`,
    `"batch"`, or an int >= 1 (an integral float as an int)."""
    if isinstance(value, str) and value in ("epoch", "batch"):
        return value
    try:
        return check_int_at_least_one("update_freq", value)
    except ValueError:
        raise ValueError(
            'update_freq must be "epoch", "batch" or an integer >= 1. '
            f"Received: update_freq={value!r}"
        ) from None


def check_float32_scale(name: str, value: Any) -> float:
    """Returns `value` as a float if it is a finite, positive float32 normal number."""
    if not is_number(value) or not (FLOAT32_TINY <= value <= FLOAT32_MAX):
        raise ValueError(
            f"{name} must be a number in float32's normal range [2**-126, 3.4e38], where the "
            f"device can hold it (a larger value becomes inf, a smaller one 0). "
            f"Received: {name}={value!r}"
        )
    return float(value)
