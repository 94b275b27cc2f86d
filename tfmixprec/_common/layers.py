"""Walking a model's layer graph: all layers, output layers, watching calls, the compiled loss,
and the checks that come first.

Private: used by `policy` and `audit` (and by `training` and `cpu_float16` to walk a model's
layers). The Keras internals it needs (the layer walk, a tensor's producing layer, a subclassed
model's build shapes) live in `tfmixprec._keras`.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from tfmixprec._common.validate import check_bool
from tfmixprec._keras.graph import all_sublayers
from tfmixprec._keras.losses import as_compiled
from tfmixprec._keras.patches import patch
from tfmixprec._keras.settings import global_policy

__all__: list[str] = []  # private module: nothing here is part of the package's API


def compute_dtype_of(target: Any, low: str) -> str:
    """The compute dtype that decides for `target`: a model's or layer's (`low` when any of
    its layers computes in `low`, else its own), a policy's or its name's; for `None` the
    global policy's, read without setting an unset one (`keras.config.dtype_policy()` would
    set it)."""
    if isinstance(target, keras.Layer):  # a model too
        dtypes = {layer.compute_dtype for layer in all_layers(target)}
        return low if low in dtypes else target.compute_dtype
    if target is None:
        target = global_policy()
        return keras.config.floatx() if target is None else target.compute_dtype
    return keras.dtype_policies.get(target).compute_dtype


def check_built_model(model: Any, what: str) -> None:
    """Raises a clear error unless `model` is a built Keras model.

    Args:
        model: Any. The value to check.
        what: String. The caller's name, shown in the message (e.g. `"audit"`).

    Raises:
        TypeError: If `model` is not a `keras.Model`.
        ValueError: If the model is not built.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"{what} expects a keras.Model. Received: model of type "
            f"{type(model).__module__}.{type(model).__name__}"
        )
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so its layers have no weights or outputs "
            f"yet. Build it first: call it on a batch, or call model.build(input_shape), "
            f"then call {what} again."
        )


def iter_layers(model: keras.Model) -> list[Any]:
    """All layers of `model`, nested ones included, without the model itself."""
    return all_sublayers(model)


def all_layers(model: Any) -> list[Any]:
    """`model` itself, then all its layers, nested ones included (`iter_layers`); for a plain
    layer, the layer and the layers nested in it."""
    return [model, *iter_layers(model)]


def is_container(layer: Any) -> bool:
    """True for a layer that holds layers of its own (a nested model), False for a leaf."""
    return bool(getattr(layer, "layers", None))


def variable_owners(model: keras.Model) -> dict[int, Any]:
    """`id(variable) -> the innermost layer that holds it` (a nested layer is walked after the
    layer around it, so it wins), for the trainable variables of a built model."""
    owners = {}
    for layer in all_layers(model):
        for variable in layer.trainable_variables:
            owners[id(variable)] = layer
    return owners


@contextlib.contextmanager
def watch_leaf_calls(
    model: keras.Model, record: Callable[[Any, tuple, Any], None]
) -> Iterator[None]:
    """Within the block, every call of a leaf layer of `model` calls `record(layer, args,
    result)` after it (in the order the calls end: inner layers before the layer around them).

    Each leaf's `call` (`quantized_call` for a quantized layer, which Keras calls instead)
    is replaced by a watcher and restored after the block: back to the
    class method, or to an instance `call` another part had set (e.g. `cpu_float16`'s). One
    watcher at a time per process (`CALLS_LOCK`).
    """
    with CALLS_LOCK:
        yield from _watching(model, record)


# One watcher (or policy swap) of a model's calls at a time in this process: a second thread
# would save the first one's watcher as a layer's own `call` and put it back for good.
CALLS_LOCK = threading.RLock()


def _watching(model: keras.Model, record: Callable[[Any, tuple, Any], None]) -> Iterator[None]:
    leaves = [layer for layer in iter_layers(model) if not is_container(layer)]
    with contextlib.ExitStack() as patches:
        for layer in leaves:
            made = patch(layer, _called(layer), "watch_leaf_calls", _watcher(layer, record))
            patches.callback(made.undo)
        yield


def _watcher(layer: Any, record: Callable[[Any, tuple, Any], None]) -> Callable[[Any], Any]:
    """The patch that wraps `layer`'s call (the class's, or a route's) in a watcher."""

    def make(own: Callable[..., Any]) -> Callable[..., Any]:
        def watched(*args: Any, **kwargs: Any) -> Any:
            result = own(*args, **kwargs)
            record(layer, args, result)
            return result

        return watched

    return make


def _called(layer: Any) -> str:
    """The method Keras's `__call__` runs: `quantized_call` for a quantized layer (float8,
    int8, ...), else `call`."""
    return "quantized_call" if getattr(layer, "quantization_mode", None) else "call"


def compiled_loss(model: Any, who: str) -> Callable[..., Any]:
    """The model's compiled loss as a callable `(y_true, y_pred[, sample_weight])`, computed as
    `fit` computes it: a plain function (or a string) as Keras wraps it (`_keras.losses`).

        Raises:
            ValueError: If the model was compiled without one single loss (`who` names the caller).
    """
    loss = getattr(model, "loss", None)
    if isinstance(loss, (str, keras.losses.Loss)) or callable(loss):  # as fit computes it
        return as_compiled(keras.losses.get(loss) if isinstance(loss, str) else loss)
    if loss is None:
        raise ValueError(
            f"{who} needs a loss, but model {model.name!r} is not compiled with one. Compile "
            "it with a loss, or pass loss_fn=... ."
        )
    raise ValueError(
        f"{who} needs a loss: the model's compiled loss {loss!r} is not a single loss. "
        "Pass loss_fn=... ."
    )


def loss_value(loss_fn: Callable[..., Any], y: Any, y_pred: Any, sample_weight: Any) -> Any:
    """The scalar float32 loss, as Keras reduces it ("sum_over_batch_size"): a
    `keras.losses.Loss` weighs the samples itself; a plain function (`"mse"` gives one) returns
    per-sample losses, weighted here. A model with several outputs and one loss: the loss of
    each output, summed (as Keras's `compile(loss="mse")` does for them)."""
    outputs, labels = keras.tree.flatten(y_pred), keras.tree.flatten(y)
    if len(outputs) > 1 and len(labels) == len(outputs):
        if isinstance(y_pred, dict) and isinstance(y, dict):  # matched by key, as Keras does
            labels = [y[key] for key in sorted(y_pred)]
            outputs = [y_pred[key] for key in sorted(y_pred)]
        parts = [loss_value(loss_fn, t, p, sample_weight) for t, p in zip(labels, outputs)]
        return tf.add_n(parts)
    if isinstance(loss_fn, keras.losses.Loss) and sample_weight is not None:
        return tf.cast(loss_fn(y, y_pred, sample_weight), tf.float32)
    values = tf.cast(loss_fn(y, y_pred), tf.float32)
    if sample_weight is None:
        return tf.reduce_mean(values)
    weights = tf.cast(tf.convert_to_tensor(sample_weight), tf.float32)
    weighted = values * tf.reshape(weights, tf.shape(values)) if values.shape.rank else values
    return tf.reduce_sum(weighted) / tf.cast(tf.size(values), tf.float32)


def forget_traced_functions(model: keras.Model) -> None:
    """Drops `model`'s traced train/test/predict functions so a layer change takes effect."""
    for attr in ("train_function", "test_function", "predict_function"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)


# Layers set to float32 on purpose by `CalibrationReport.apply` or `PrecisionRepair`, with why,
# for the audit (an info, not a finding to fix). Held on the model object in this process.
_ON_PURPOSE = "_tfmixprec_float32_on_purpose"


def mark_float32(model: Any, reasons: dict[str, str]) -> None:
    """Records that the layers named in `reasons` (path -> why) compute in float32 on purpose."""
    model.__dict__[_ON_PURPOSE] = {**float32_on_purpose(model), **reasons}


def float32_on_purpose(model: Any) -> dict[str, str]:
    """The layers of `model` set to float32 on purpose (path -> why), oldest first."""
    return dict(vars(model).get(_ON_PURPOSE, {}))


def layer_names(model: keras.Model, short: bool = False) -> dict[int, str]:
    """How reports name each layer of `model` (`id(layer) -> name`), one name per layer.

    The full form (`short=False`; `calibrate`, `PrecisionRepair`): the names of the layers it
    is nested in, then its own (`"gpt2_backbone/transformer_layer_0/feedforward_dropout"`; a
    layer of the model itself: its name). KerasHub's blocks give their sublayers the same
    names in every block, and Keras's own `path` leaves out the parent of a layer made in its
    parent's `__init__`. Names left equal get `#2`, `#3`, ... in the model's order.

    The short form (`short=True`; `explain_overflow`, the float8 reports): the layer's own
    name where no other layer of the model has it, else Keras's `layer.path` where no other
    layer has that (`"gpt2_backbone/transformer_layer_1/self_attention/query"`, as the float8
    reports have always printed it), else its full form.
    """
    check_bool("short", short)
    keys = _full_names(model)
    if not short:
        return keys
    layers = all_layers(model)
    names = collections.Counter(layer.name for layer in layers)
    paths = collections.Counter(getattr(layer, "path", None) for layer in layers)

    def short_name(layer: Any) -> str:
        if names[layer.name] == 1:
            return layer.name
        path = getattr(layer, "path", None)
        return path if path is not None and paths[path] == 1 else keys[id(layer)]

    return {id(layer): short_name(layer) for layer in layers}


def _full_names(model: keras.Model) -> dict[int, str]:
    inner: dict[int, tuple[int, Any]] = {}  # id -> (descendants, innermost parent)
    for outer in iter_layers(model):
        parts = all_sublayers(outer)
        for part in parts:
            if id(part) not in inner or len(parts) < inner[id(part)][0]:
                inner[id(part)] = (len(parts), outer)

    def nested(layer: Any) -> str:  # a layer shared by the model and a nested model: nested
        parent = inner.get(id(layer), (0, None))[1]
        return layer.name if parent is None else f"{nested(parent)}/{layer.name}"

    keys: dict[int, str] = {id(model): model.name}
    seen: dict[str, int] = {}
    for layer in iter_layers(model):
        key = nested(layer)
        seen[key] = seen.get(key, 0) + 1
        keys[id(layer)] = key if seen[key] == 1 else f"{key}#{seen[key]}"
    return keys
