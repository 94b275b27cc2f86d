"""What `LossScaleOptimizer`'s constructor accepts: the inner optimizer given or named, the
knobs under their own names and Keras's and TensorFlow 2's aliases, mapped onto one validated
`LossScaleConfig`, and `on_min_scale`. Nothing is built or changed before all of it is checked."""

from __future__ import annotations

from typing import Any

import keras

from tfmixprec._common.validate import is_number
from tfmixprec.scaling.loss_scale import LossScaleConfig

__all__: list[str] = []  # `LossScaleOptimizer`'s arguments: its module offers them

_ON_MIN_SCALE = ("warn", "raise", "ignore")


def resolve_optimizer(optimizer: Any, arg: str = "inner_optimizer") -> keras.optimizers.Optimizer:
    """The Keras 3 optimizer `optimizer` is or names (`keras.optimizers.get`), or an error
    naming the argument `arg` the caller was given it as (`optimizer` for `compile`)."""
    if isinstance(optimizer, str):
        try:
            optimizer = keras.optimizers.get(optimizer)
        except ValueError as err:
            raise ValueError(
                f"{arg} must be a Keras 3 optimizer or the name of one "
                f"(e.g. 'adam'). Received: {arg}={optimizer!r}"
            ) from err
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise TypeError(
            f"{arg} is already a LossScaleOptimizer "
            f"({type(optimizer).__name__}); wrapping it again would scale the loss "
            "twice. Use it as it is, or wrap its `inner_optimizer`. Received: "
            f"{arg}={optimizer!r}"
        )
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return optimizer
    module = type(optimizer).__module__ or ""
    if module.startswith(("tf_keras", "tensorflow", "keras.optimizers.legacy")) or hasattr(
        optimizer, "compute_gradients"
    ):
        raise TypeError(
            f"{arg} must be a Keras 3 optimizer, but received a tf-keras / "
            f"Keras 2 / TF1 optimizer of type {module}.{type(optimizer).__name__}. "
            "Create it with Keras 3 instead, e.g. keras.optimizers.Adam(...)."
        )
    raise TypeError(
        f"{arg} must be a Keras 3 optimizer (keras.optimizers.Optimizer), "
        f"e.g. keras.optimizers.Adam(). Received: {arg}={optimizer!r} "
        f"of type {type(optimizer).__name__}"
    )


def check_on_min_scale(on_min_scale: Any) -> str:
    if on_min_scale not in _ON_MIN_SCALE:
        raise ValueError(
            f"on_min_scale must be one of {list(_ON_MIN_SCALE)}. "
            f"Received: on_min_scale={on_min_scale!r}"
        )
    return on_min_scale


def config_from_arguments(
    initial_scale: Any,
    growth_interval: Any,
    dynamic: Any,
    dynamic_growth_steps: Any,
    loss_scale: Any,
    **knobs: Any,
) -> LossScaleConfig:
    """Maps the constructor's arguments, with Keras's and TF 2's aliases, onto a config."""
    if loss_scale is not None:
        if initial_scale is not None or dynamic is not None:
            raise ValueError(
                "Pass either the TensorFlow 2 argument `loss_scale` or `initial_scale`/"
                f"`dynamic`, not both. Received: loss_scale={loss_scale!r}, "
                f"initial_scale={initial_scale!r}, dynamic={dynamic!r}"
            )
        if loss_scale != "dynamic" and (isinstance(loss_scale, str) or not is_number(loss_scale)):
            raise ValueError(
                'loss_scale must be "dynamic" or a number (a fixed scale). '
                f"Received: loss_scale={loss_scale!r}"
            )
        initial_scale, dynamic = (None, True) if loss_scale == "dynamic" else (loss_scale, False)
    if dynamic_growth_steps is not None:
        if growth_interval is not None and growth_interval != dynamic_growth_steps:
            raise ValueError(
                "growth_interval and its Keras alias dynamic_growth_steps disagree; pass "
                f"one of them. Received: growth_interval={growth_interval!r}, "
                f"dynamic_growth_steps={dynamic_growth_steps!r}"
            )
        growth_interval = dynamic_growth_steps
    return LossScaleConfig(
        initial_scale=LossScaleConfig.initial_scale if initial_scale is None else initial_scale,
        dynamic=LossScaleConfig.dynamic if dynamic is None else dynamic,
        growth_interval=(
            LossScaleConfig.growth_interval if growth_interval is None else growth_interval
        ),
        **knobs,
    )
