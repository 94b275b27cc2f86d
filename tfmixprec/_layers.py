"""Walking a model's layer graph: all layers, output layers, watching calls, the compiled loss,
and the checks that come first.

Private: used by `policy` and `audit` (and by `training` and `cpu_float16` to walk a model's
layers). The Keras internals it needs (the layer walk, a tensor's producing layer, a subclassed
model's build shapes) live in `_keras_compat`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._keras_compat import (
    all_sublayers,
    build_shapes,
    producing_layer,
    producing_output_index,
)

__all__: list[str] = []  # private module: nothing here is part of the package's API


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


def is_container(layer: Any) -> bool:
    """True for a layer that holds layers of its own (a nested model), False for a leaf."""
    return bool(getattr(layer, "layers", None))


def variable_owners(model: keras.Model) -> dict[int, Any]:
    """`id(variable) -> the innermost layer that holds it` (a nested layer is walked after the
    layer around it, so it wins), for the trainable variables of a built model."""
    owners = {}
    for layer in [model, *iter_layers(model)]:
        for variable in layer.trainable_variables:
            owners[id(variable)] = layer
    return owners


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """One call of a leaf layer in an observed call: the dtype and the last dimension of each
    floating-point tensor it returned, and whether its first argument was floating-point."""

    layer: Any
    output_dtypes: tuple[str, ...]
    output_last_dims: tuple[int | None, ...]
    float_input: bool


@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """One output of a model: the leaf layer that produced it (None: an operation outside any
    layer) and its dtype as a real call returns it."""

    layer: Any
    dtype: str


@dataclasses.dataclass(frozen=True)
class Observation:
    """What one inference call of a model on a batch of zeros showed.

    Attributes:
        outputs: Tuple of `ModelOutput`, in the order of the model's outputs.
        calls: Tuple of `LayerCall`, in the order the leaf calls ended (empty when the call
            could not run and the outputs were read from the functional graph instead).
        error: String or None. None when the call ran; else why it failed (a functional
            model that cannot take inputs of zeros, e.g. sizes it checks), and the outputs'
            dtypes are the ones Keras inferred symbolically.
    """

    outputs: tuple[ModelOutput, ...]
    calls: tuple[LayerCall, ...]
    error: str | None = None

    def calls_of(self, layer: Any) -> list[LayerCall]:
        return [call for call in self.calls if call.layer is layer]


def _floating(tensor: Any) -> bool:
    dtype = getattr(tensor, "dtype", None)
    return dtype is not None and keras.backend.standardize_dtype(dtype).startswith(
        ("float", "bfloat")
    )


def _dtype_name(tensor: Any) -> str:
    return keras.backend.standardize_dtype(tensor.dtype)


def observe(model: keras.Model) -> Observation:
    """Calls `model` once, in inference mode, on a batch of zeros (unknown sizes 2) while its
    leaf layers' calls are watched, and returns what ran and in which dtype.

    Keras's symbolic dtypes can differ from a real call's (a layer's `compute_output_spec`
    says its compute dtype where its `call` returns float32, as Keras's
    `ReversibleEmbedding` does for KerasHub's GPT-2, Llama and Gemma logits), so readers that
    judge dtypes read this. A functional model that cannot take the batch of zeros is read
    from its graph instead (`error` says why).

    Args:
        model: `keras.Model`. A built model.

    Returns:
        An `Observation`.

    Raises:
        ValueError: For a subclassed model not built from one input (a tensor, a list or a
            dict of tensors), or whose call fails on the batch of zeros.
    """
    graph_outputs = _graph_outputs(model)
    recorder = _CallRecorder()
    inputs = _zeros_like_inputs(model)
    try:
        # Keras's own warnings about a batch of zeros (a softmax over a size-1 axis, say) are
        # not the user's to see; a warnings filter set to "error" must not end the call either.
        with watch_leaf_calls(model, recorder.record), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = keras.tree.flatten(model(inputs, training=False))
    except Exception as err:  # any failure of the user's model: read its graph instead
        if graph_outputs is None:
            raise ValueError(
                f"Cannot observe subclassed model {model.name!r}: calling it on a batch of "
                f"zeros failed ({type(err).__name__}: {err}). Build it with "
                "model.build(input_shape) or call it on one batch first, with inputs it accepts."
            ) from err
        return Observation(tuple(graph_outputs), (), f"{type(err).__name__}: {err}")
    outputs = []
    for index, tensor in enumerate(result):
        layer = recorder.produced.get(id(tensor), (None, None))[0]
        if layer is None and graph_outputs is not None and index < len(graph_outputs):
            layer = graph_outputs[index].layer
        outputs.append(ModelOutput(layer, _dtype_name(tensor)))
    return Observation(tuple(outputs), tuple(recorder.calls))


class _CallRecorder:
    """Records each watched leaf call (`LayerCall`) and which layer produced which tensor."""

    def __init__(self) -> None:
        self.calls: list[LayerCall] = []
        self.produced: dict[int, tuple[Any, Any]] = {}  # id -> (layer, tensor kept alive)

    def record(self, layer: Any, args: tuple, result: Any) -> None:
        floats = [t for t in keras.tree.flatten(result) if _floating(t)]
        first = keras.tree.flatten(args[0]) if args and args[0] is not None else []
        self.calls.append(
            LayerCall(
                layer,
                tuple(_dtype_name(t) for t in floats),
                tuple(t.shape[-1] if len(t.shape) else None for t in floats),
                bool(first) and _floating(first[0]),
            )
        )
        for tensor in keras.tree.flatten(result):
            self.produced[id(tensor)] = (layer, tensor)


def _graph_outputs(model: keras.Model) -> list[ModelOutput] | None:
    """A functional (or Sequential) model's outputs as its graph records them: the leaf layer
    that produced each (inside nested models too) and the symbolic dtype; None for a
    subclassed model."""
    try:
        tensors = model.outputs
    except (AttributeError, ValueError):
        tensors = None
    if not tensors:
        return None
    return [ModelOutput(_leaf_producer(t), _dtype_name(t)) for t in keras.tree.flatten(tensors)]


def _leaf_producer(tensor: Any) -> Any:
    """The leaf layer that produced a symbolic tensor of a functional graph (inside nested
    models too), or None (an input, or an operation that is not a layer)."""
    layer, index = producing_layer(tensor), producing_output_index(tensor)
    while isinstance(layer, keras.Model) and layer.layers and index is not None:
        inner = keras.tree.flatten(layer.outputs)[index]
        layer, index = producing_layer(inner), producing_output_index(inner)
    if layer is None or isinstance(layer, keras.layers.InputLayer):
        return None
    return layer if isinstance(layer, keras.layers.Layer) else None


_UNKNOWN_SIZE = 2  # a size-1 axis takes other code paths (and Keras warns of some)


def _size(dim: int | None) -> int:
    return _UNKNOWN_SIZE if dim is None else dim


def _zeros_like_inputs(model: keras.Model) -> Any:
    """A batch of zeros in the structure, shapes and dtypes of the model's inputs (unknown
    sizes `_UNKNOWN_SIZE`)."""
    try:
        specs = model.input
    except (AttributeError, ValueError):
        specs = None
    if specs is not None and keras.tree.flatten(specs):
        return keras.tree.map_structure(
            lambda spec: keras.ops.zeros([_size(d) for d in spec.shape], spec.dtype),
            specs,
        )
    shapes = build_shapes(model)
    if not shapes or len(shapes) != 1:
        raise ValueError(
            f"Cannot observe subclassed model {model.name!r}: it was not built from one input "
            "(a tensor, a list or a dict of tensors). Build it with model.build(input_shape) "
            "or call it on one batch first."
        )
    return keras.tree.map_shape_structure(
        lambda shape: np.zeros([_size(dim) for dim in shape], "float32"),
        next(iter(shapes.values())),
    )


def output_layers(model: keras.Model) -> list[Any]:
    """The leaf layers whose outputs are the model's outputs, each once, in order
    (`observe`'s; an output made outside any layer has none)."""
    found: list[Any] = []
    for output in observe(model).outputs:
        if output.layer is not None and output.layer not in found:
            found.append(output.layer)
    return found


@contextlib.contextmanager
def watch_leaf_calls(
    model: keras.Model, record: Callable[[Any, tuple, Any], None]
) -> Iterator[None]:
    """Within the block, every call of a leaf layer of `model` calls `record(layer, args,
    result)` after it (in the order the calls end: inner layers before the layer around them).

    Each leaf's `call` is replaced by a watcher and restored after the block: back to the
    class method, or to an instance `call` another part had set (e.g. `cpu_float16`'s).
    """
    leaves = [layer for layer in iter_layers(model) if not is_container(layer)]
    own_calls = {id(layer): vars(layer).get("call") for layer in leaves}
    for layer in leaves:

        def watched(*args, __layer=layer, __call=layer.call, **kwargs):
            result = __call(*args, **kwargs)
            record(__layer, args, result)
            return result

        layer.call = watched
    try:
        yield
    finally:
        for layer in leaves:
            if own_calls[id(layer)] is None:
                del layer.call  # back to the class method
            else:
                layer.call = own_calls[id(layer)]


def compiled_loss(model: Any, who: str) -> Callable[..., Any]:
    """The model's compiled loss as a callable `(y_true, y_pred[, sample_weight])`.

    Raises:
        ValueError: If the model was compiled without one single loss (`who` names the caller).
    """
    loss = getattr(model, "loss", None)
    if isinstance(loss, (str, keras.losses.Loss)) or callable(loss):
        return keras.losses.get(loss) if isinstance(loss, str) else loss
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
    per-sample losses, weighted here."""
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
