"""Adoption: what loss scaling and CPU routes the tfmixprec callbacks find on a model in `fit`.

A plain `keras.Model` compiled under `mixed_float16` holds Keras's own
`keras.optimizers.LossScaleOptimizer`. When `fit` sets a tfmixprec callback's model, it is
replaced by a `tfmixprec.LossScaleOptimizer` with the same inner optimizer and settings (a
used one's state carried over), and the model's `train_step` is wrapped in `guard_state` (a
skipped step changes no variable). A model compiled the ordinary way, without
`MixedPrecisionModel`, also gets the CPU routes `MixedPrecisionModel.compile` would give it
(`cpu_bfloat16.fast_bfloat16_layers`, `cpu_float16.fast_float16_layers`); `fit` traces its
train step again only where a layer was routed. Each is said once per model.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import keras
import tensorflow as tf

from tfmixprec._common.layers import all_layers, iter_layers
from tfmixprec._common.text import docs_page
from tfmixprec._keras.fit import make_train_function
from tfmixprec._keras.optimizer_hooks import set_compiled_optimizer
from tfmixprec._keras.patches import patch
from tfmixprec.precision import cpu_bfloat16, cpu_float16
from tfmixprec.precision.cpu_route import route_of
from tfmixprec.scaling.loss_scale import format_scale
from tfmixprec.scaling.optimizer import LossScaleOptimizer, build_before_fit
from tfmixprec.scaling.state_guard import guarded_step

__all__: list[str] = []  # private module: nothing here is part of the package's API

# Host-side, for reporting only: which lines were already said for a model (once per model).
_SAID: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _say_once(model: Any, kind: str, line: str, warn: bool = False) -> None:
    said = _SAID.setdefault(model, set())
    if kind in said:
        return
    said.add(kind)
    if warn:
        warnings.warn(line, RuntimeWarning, stacklevel=3)
    else:
        print(line)


def _compute_dtype(model: Any) -> str:
    """float16 if any layer computes in float16, else bfloat16 if any does, else float32."""
    dtypes = {model.dtype_policy.compute_dtype}
    dtypes.update(layer.dtype_policy.compute_dtype for layer in iter_layers(model))
    return next((d for d in ("float16", "bfloat16") if d in dtypes), "float32")


def loss_scaling_of(model: Any) -> LossScaleOptimizer | None:
    """The model's tfmixprec `LossScaleOptimizer`, or None (read outside `on_train_begin`)."""
    optimizer = getattr(model, "optimizer", None)
    return optimizer if isinstance(optimizer, LossScaleOptimizer) else None


def adopt_at_train_begin(model: Any, who: str) -> LossScaleOptimizer | None:
    """For the callbacks' `on_train_begin`: the model's tfmixprec `LossScaleOptimizer`.

    Keras's own `keras.optimizers.LossScaleOptimizer` is replaced by tfmixprec's (in the
    model's strategy scope; the train step is traced again, so it uses the new one) and that
    is said once per model; a tfmixprec optimizer's variables are made before the step's
    first trace (`build_before_fit`), and so are a plain optimizer's, which gives None, with
    one line per model: no loss scaling needed (bfloat16, float32), or a warning that float16
    without it underflows.
    """
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and not isinstance(
        optimizer, LossScaleOptimizer
    ):
        optimizer = _adopt(model, optimizer, who)
    if optimizer is not None:
        build_before_fit(model)  # the step traced once, not twice
    if isinstance(optimizer, LossScaleOptimizer):
        return optimizer
    dtype, name = _compute_dtype(model), type(optimizer).__name__
    if dtype == "float16":
        line = (
            f"Model {model.name!r} computes in float16 but its optimizer ({name}) does not "
            "scale the loss, so gradients below 2**-24 flush to zero and their weights stop "
            f"learning ({who} runs without loss-scale values). Compile with "
            "optimizer=tfmixprec.LossScaleOptimizer(your_optimizer), or set the mixed_float16 "
            "policy before building the model so that compile() wraps it. "
            f"{docs_page('guides/fit-and-callbacks')}"
        )
        _say_once(model, "float16", line, warn=True)
        return None
    why = ", which has float32's range (no gradient flushes to zero as in float16)"
    line = (
        f"tfmixprec: no loss scaling needed for model {model.name!r}: it computes in {dtype}"
        f"{why if dtype == 'bfloat16' else ''}; the tfmixprec callbacks add no loss-scale values."
    )
    _say_once(model, "unscaled", line)
    return None


def adopt_when_set(model: Any, who: str) -> None:
    """For the callbacks' `set_model`: adopts Keras's own `LossScaleOptimizer` already, before
    any callback's `on_train_begin` (Keras sets every callback's model first), so that a
    `BackupAndRestore` listed before a tfmixprec callback restores into tfmixprec's optimizer.
    A model compiled with tfmixprec's own has Keras's `train_step` guarded (its skipped steps
    put back the state the forward pass wrote); any other is left to `on_train_begin`."""
    route_when_set(model, who)
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, LossScaleOptimizer):
        _guard_train_step(model)
    elif isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        _adopt(model, optimizer, who)


def route_when_set(model: Any, who: str) -> list[str]:
    """Routes the model's layers that run slow CPU kernels, as `MixedPrecisionModel.compile`
    does (a float16 model: `cpu_float16.fast_float16_layers` with the remapper off; bfloat16
    layers: `cpu_bfloat16.fast_bfloat16_layers`; nothing on a GPU or TPU, or where the
    routes are disabled). Where a layer was routed now, the model's traced train, test and
    predict functions are traced again (once) and that is said once per model. Returns the
    names of the layers routed now."""
    dtype = _compute_dtype(model)
    if dtype == "float32":
        return []
    before = {id(layer) for layer in all_layers(model) if route_of(layer) is not None}
    if dtype == "float16":
        cpu_float16.route_around_fused_matmul("mixed_float16")
        cpu_float16.fast_float16_layers(model)
    cpu_bfloat16.fast_bfloat16_layers(model)
    routed = [
        layer
        for layer in all_layers(model)
        if id(layer) not in before and route_of(layer) is not None
    ]
    if not routed:
        return []  # (a routed model's traced functions are traced again by the routing)
    names = ", ".join(f"{layer.name} ({route_of(layer)})" for layer in routed[:3])
    more = f" and {len(routed) - 3} more" if len(routed) > 3 else ""
    line = (
        f"tfmixprec: {who} routed {len(routed)} layer(s) of model {model.name!r} around slow "
        f"{dtype} CPU kernels: {names}{more}. Their outputs, variables and saved file are "
        "unchanged; the values agree within "
        f"{dtype} rounding. tfmixprec.{'cpu_float16' if dtype == 'float16' else 'cpu_bfloat16'}"
        ".disable() before fit leaves a model unrouted."
    )
    _say_once(model, "routed", line)
    return [layer.name for layer in routed]


def _guard_train_step(model: Any) -> None:
    """Wraps the model's `train_step` in `guard_state` once (a skipped step changes no
    variable) and has `fit` trace it again."""
    if not getattr(model.train_step, "tfmixprec_guarded", False):
        patch(model, "train_step", "state guard", lambda step: guarded_step(model, step))
        make_train_function(model)


def _adopt(model: Any, keras_optimizer: Any, who: str) -> LossScaleOptimizer:
    strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    with strategy.scope():
        new = LossScaleOptimizer.from_keras(keras_optimizer)
    model.optimizer = new
    set_compiled_optimizer(model, new)  # so model.save writes the new one
    _guard_train_step(model)  # a skipped step changes no variable
    make_train_function(model)  # traced with the new optimizer
    carried = "; its state carried over" if keras_optimizer.built else ""
    line = (
        f"tfmixprec: {who} replaced the keras.optimizers.LossScaleOptimizer of model "
        f"{model.name!r} with a tfmixprec.LossScaleOptimizer (the same "
        f"{type(new.inner_optimizer).__name__}, loss scale "
        f"{format_scale(float(new.loss_scale.numpy()))}, dynamic_growth_steps="
        f"{new.growth_interval}{carried}) to read and guard the loss scale; a file this model "
        "saves from now on needs `import tfmixprec` to load."
    )
    _say_once(model, f"adopted {id(keras_optimizer)}", line)
    return new
