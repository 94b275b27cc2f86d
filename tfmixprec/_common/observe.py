"""Observing one real call of a model: what ran, in which dtype, and which layer made each output.

Private: read by `audit` and `policy.float32_outputs`. Keras's symbolic dtypes can differ from
a real call's (a layer's `compute_output_spec` says its compute dtype where its `call` returns
float32, as Keras's `ReversibleEmbedding` does for KerasHub's GPT-2, Llama and Gemma logits),
so whoever judges dtypes reads an `Observation`: the model called once, in inference mode, on
a batch of zeros, its leaf layers' calls watched, and its state put back as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._common.arrays import nonfinite_count
from tfmixprec._common.layers import CALLS_LOCK, all_layers, is_container, watch_leaf_calls
from tfmixprec._keras.graph import (
    build_shapes,
    call_losses,
    node_outputs,
    producing_layer,
    producing_output_index,
    set_call_losses,
)
from tfmixprec._keras.op_watch import first_nonfinite_op
from tfmixprec._keras.settings import global_seeds_kept

__all__: list[str] = []  # private module: nothing here is part of the package's API

# Layers that move or copy values without arithmetic that rounding could change (a dropout or
# noise layer is the identity in inference mode): behind one, the layer that computed a model
# output is the one before it.
_PASS_THROUGH = (
    keras.layers.Reshape,
    keras.layers.Flatten,
    keras.layers.Permute,
    keras.layers.RepeatVector,
    keras.layers.Identity,
    keras.layers.Dropout,
    keras.layers.SpatialDropout1D,
    keras.layers.SpatialDropout2D,
    keras.layers.SpatialDropout3D,
    keras.layers.GaussianDropout,
    keras.layers.GaussianNoise,
    keras.layers.AlphaDropout,
    keras.layers.Cropping1D,
    keras.layers.Cropping2D,
    keras.layers.Cropping3D,
)


def is_pass_through(layer: Any) -> bool:
    """Whether `layer` only moves values (a reshape, a dropout, a linear `Activation`)."""
    if isinstance(layer, keras.layers.Activation):
        return getattr(layer.activation, "__name__", None) == "linear"
    return isinstance(layer, _PASS_THROUGH)


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """One call of a leaf layer in an observed call.

    Attributes:
        layer: The layer.
        output_dtypes: Tuple of strings. The dtype of each floating-point tensor it returned.
        output_last_dims: Tuple. The last dimension of each of them.
        float_input: Bool. Whether its first argument was floating-point.
        input_sources: Tuple of `(layer, call index)` or None, one for each floating-point
            tensor of its first argument: the leaf call that made it (None: a model input,
            or an operation outside any layer).
        input_last_dims: Tuple. The last dimension of each of those tensors.
        finite: Bool. Whether every value it returned was finite.
    """

    layer: Any
    output_dtypes: tuple[str, ...]
    output_last_dims: tuple[int | None, ...]
    float_input: bool
    input_sources: tuple[tuple[Any, int] | None, ...] = ()
    input_last_dims: tuple[int | None, ...] = ()
    finite: bool = True


@dataclasses.dataclass(frozen=True)
class ModelOutput:
    """One output of a model and the layer that computed it.

    Attributes:
        layer: The leaf layer whose arithmetic made the output (behind pass-through layers, see
            `is_pass_through`), or None: an operation outside any layer.
        dtype: String. The output's dtype as a real call returns it.
        through: Tuple of layers. The pass-through layers between `layer` and the output, in
            order (empty when `layer` made the output itself).
    """

    layer: Any
    dtype: str
    through: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class Observation:
    """What one inference call of a model on a batch of zeros showed.

    Attributes:
        outputs: Tuple of `ModelOutput`, in the order of the model's outputs.
        calls: Tuple of `LayerCall`, in the order the leaf calls ended (empty when the call
            could not run and the outputs were read from the functional graph instead).
        error: String or None. None when the call ran; else why it failed (a functional
            model that cannot take inputs of zeros, e.g. sizes it checks) or was not made,
            and the outputs' dtypes are the ones Keras inferred symbolically.
        called: Bool. False when the call was not made (`unobserved`: `error` says why).
        nonfinite: `NonfiniteOp` or None. Where the model's outputs held NaN/Inf and are
            finite with every layer in float32: the first float16/bfloat16 operation whose
            output was not finite (`_keras.op_watch`, from a second call); else None.
    """

    outputs: tuple[ModelOutput, ...]
    calls: tuple[LayerCall, ...]
    error: str | None = None
    called: bool = True
    nonfinite: Any = None

    @property
    def finite(self) -> bool:
        """Whether every leaf call returned finite values (True where none was watched)."""
        return all(call.finite for call in self.calls)

    def calls_of(self, layer: Any) -> list[LayerCall]:
        return [call for call in self.calls if call.layer is layer]

    def reads_model_inputs(self, call: LayerCall, through: Callable[[LayerCall], bool]) -> bool:
        """Whether `call` reads the model's inputs: each of its floating-point inputs is one,
        or was made from them by earlier leaf calls that each satisfy `through`."""
        pending, seen = list(call.input_sources), set()
        while pending:
            source = pending.pop()
            if source is None or source[1] in seen:
                continue
            seen.add(source[1])
            earlier = self.calls[source[1]]
            if not through(earlier):
                return False
            pending += earlier.input_sources
        return True


def observe(model: keras.Model) -> Observation:
    """Calls `model` once, in inference mode, on a batch of zeros (unknown sizes 2) while its
    leaf layers' calls are watched, and returns what ran and in which dtype. The model's
    variables (a stateful RNN's states, say) and its layers' losses (`add_loss`) are put back
    as they were; one observation at a time per process (a lock), so threads cannot see each
    other's watchers.

    Args:
        model: `keras.Model`. A built model.

    Returns:
        An `Observation`. A functional model that cannot take the batch of zeros is read
        from its graph instead (`error` says why).

    Raises:
        ValueError: For a subclassed model not built from one input (a tensor, a list or a
            dict of tensors), or whose call fails on the batch of zeros.
    """
    graph_outputs = _graph_outputs(model)
    inputs = zeros_like_inputs(model)
    recorder = _CallRecorder()
    with CALLS_LOCK, state_put_back(model):
        try:
            # Keras's own warnings about a batch of zeros are not the user's to see, and a
            # warnings filter set to "error" must not end the call either.
            with watch_leaf_calls(model, recorder.record), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = keras.tree.flatten(model(inputs, training=False))
        except Exception as err:  # any failure of the user's model: read its graph instead
            if graph_outputs is None:
                raise ValueError(
                    f"Cannot observe subclassed model {model.name!r}: calling it on a batch "
                    f"of zeros failed ({type(err).__name__}: {err}). Build it with "
                    "model.build(input_shape) or call it on one batch first, with inputs it "
                    "accepts."
                ) from err
            return Observation(tuple(graph_outputs), (), f"{type(err).__name__}: {err}")
    outputs = [recorder.output(tensor) for tensor in result]
    for index, output in enumerate(outputs):
        if output.layer is None and graph_outputs is not None and index < len(graph_outputs):
            outputs[index] = dataclasses.replace(output, layer=graph_outputs[index].layer)
    nonfinite = _precision_nonfinite(model, inputs) if nonfinite_count(result) else None
    return Observation(tuple(outputs), tuple(recorder.calls), nonfinite=nonfinite)


def _precision_nonfinite(model: keras.Model, inputs: Any) -> Any:
    """Where a call's outputs held NaN/Inf: the first float16/bfloat16 operation that was not
    finite (a second call, each operation watched), where a third call with every layer in
    float32 (quantized ones as they are) is finite; else None: not the precision's."""
    plain = [
        layer for layer in all_layers(model) if getattr(layer, "quantization_mode", None) is None
    ]
    with CALLS_LOCK, state_put_back(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = first_nonfinite_op(lambda: model(inputs, training=False))
        if found is None:
            return None
        with policies_swapped(plain, "float32"):
            finite32 = nonfinite_count(model(inputs, training=False)) == 0
    return found if finite32 else None


def unobserved(model: keras.Model, reason: str) -> Observation:
    """What `observe` would have shown of a functional model, without calling it: its
    outputs' dtypes as Keras infers them symbolically (`reason`: why not called).

    Raises:
        ValueError: For a subclassed model, whose outputs only a call shows.
    """
    outputs = _graph_outputs(model)
    if outputs is None:
        raise ValueError(
            f"{reason}; a subclassed model ({model.name!r}) shows its outputs only in a call."
        )
    return Observation(tuple(outputs), (), reason, called=False)


def call_bytes(model: keras.Model) -> tuple[int, str]:
    """The bytes of the tensors one `observe` of a built model keeps until it returns: its
    batch of zeros and each leaf layer's outputs in the model's graph, unknown sizes
    `UNKNOWN_SIZE` (what a layer computes inside, such as attention's scores, not counted);
    and the inputs' shapes and dtypes as text (`"(None, 6000, 6000) float32"`). Reads the
    graph only: for a model whose variables hold no values too."""
    inputs = _input_specs(model)
    outputs = [
        (tensor.shape, _dtype_name(tensor))
        for layer in all_layers(model)
        if not is_container(layer) and not isinstance(layer, keras.layers.InputLayer)
        for tensor in node_outputs(layer)
    ]
    total = sum(tensor_bytes(shape, dtype) for shape, dtype in inputs + outputs)
    return total, ", ".join(f"{tuple(shape)} {dtype}" for shape, dtype in inputs)


def tensor_bytes(shape: Any, dtype: str) -> int:
    """The bytes of a tensor of `shape` (unknown sizes `UNKNOWN_SIZE`) and `dtype`."""
    try:
        itemsize = tf.as_dtype(dtype).size
    except TypeError:  # a dtype TensorFlow does not name: counted as float32
        itemsize = 4
    return math.prod(_size(dim) for dim in shape) * itemsize


def _input_specs(model: keras.Model) -> list[tuple[Any, str]]:
    """`(shape, dtype)` of each input `observe` makes zeros for (see `zeros_like_inputs`)."""
    try:
        specs = keras.tree.flatten(model.input)
    except (AttributeError, ValueError):
        specs = []
    if specs:
        return [(spec.shape, _dtype_name(spec)) for spec in specs]
    found: list[tuple[Any, str]] = []
    for shapes in (build_shapes(model) or {}).values():
        keras.tree.map_shape_structure(lambda shape: found.append((shape, "float32")), shapes)
    return found


@contextlib.contextmanager
def state_put_back(model: keras.Model) -> Iterator[None]:
    """The model's state and its layers' `add_loss` losses as they were, after the block: a
    call changes no weight, but a stateful RNN's states, a random layer's seed, a layer's own
    counters or metrics, and Keras's global seed generator (an unseeded `keras.random.normal`
    draws from it) it may. Only variables that are not trainable are copied (a large model's
    weights are not doubled): see `_state_variables`. Under a strategy each replica's own
    copy is read and put back (a metric's or an `ON_READ` counter's value read as one would be
    summed over the workers, a collective that only some workers' replays would run)."""
    layers = all_layers(model)
    local = getattr(model, "distribute_strategy", tf.distribute.get_strategy())
    local = local.experimental_local_results
    variables = [
        part
        for variable in _state_variables(model, layers)
        for part in local(variable.value if isinstance(variable, keras.Variable) else variable)
    ]
    values = [np.array(variable.numpy(), copy=True) for variable in variables]
    losses = [call_losses(layer) for layer in layers]
    try:
        with global_seeds_kept():
            yield
    finally:
        for variable, value in zip(variables, values):
            if not np.array_equal(np.asarray(variable.numpy()), value, equal_nan=True):
                variable.assign(value)
        for layer, kept in zip(layers, losses):
            set_call_losses(layer, kept)


def _state_variables(model: keras.Model, layers: Sequence[Any]) -> list[Any]:
    """Every variable a call of `model` (and the loss and gradients after it) may write that is
    not trainable, once each: the layers' non-trainable variables and seed generators
    (`model.variables`), a stateful RNN's states (Keras does not track them), the metrics'
    variables wherever they live (`Layer.variables` leaves them out: a layer's own metrics, the
    model's compiled ones), and the optimizer's own state (its step counters, learning rate and
    loss scale), but not its slots, one a weight (a call never writes them, and copying them
    would double a large model's memory as the weights would)."""
    trainable = {id(variable) for variable in model.trainable_variables}
    found = [v for v in model.variables if id(v) not in trainable]
    for layer in layers:
        states = getattr(layer, "states", None)  # a stateful RNN's (`reset_states()`)
        if isinstance(states, (list, tuple)):
            found += [v for v in states if isinstance(v, keras.Variable)]
        found += list(getattr(layer, "metrics_variables", ()))
    optimizer = getattr(model, "optimizer", None)
    small = max(1, len(trainable))  # at most one value a trainable variable: not a slot
    found += [v for v in getattr(optimizer, "variables", ()) if math.prod(v.shape) <= small]
    unique = {id(v): v for v in found if id(v) not in trainable}
    return list(unique.values())


class _CallRecorder:
    """Records each watched leaf call (`LayerCall`), and every call that returned each tensor:
    the first made it, the others returned it as it was (a dropout in inference mode returns
    its input itself; a layer that returns its sublayer's output did not compute it)."""

    def __init__(self) -> None:
        self.calls: list[LayerCall] = []
        self.inputs: list[list[int]] = []  # per call: the ids of its floating-point inputs
        self.made: dict[int, tuple[list[tuple[Any, int]], Any]] = {}  # id -> (calls, tensor)

    def record(self, layer: Any, args: tuple, result: Any) -> None:
        floats = [t for t in keras.tree.flatten(result) if _floating(t)]
        first = keras.tree.flatten(args[0]) if args and args[0] is not None else []
        inputs = [t for t in first if _floating(t)]
        sources = tuple(self._maker(id(t)) for t in inputs)
        index = len(self.calls)
        self.calls.append(
            LayerCall(
                layer,
                tuple(_dtype_name(t) for t in floats),
                tuple(_last_dim(t) for t in floats),
                bool(first) and _floating(first[0]),
                sources,
                tuple(_last_dim(t) for t in inputs),
                nonfinite_count(floats) == 0,
            )
        )
        self.inputs.append([id(t) for t in inputs])
        for tensor in keras.tree.flatten(result):
            self.made.setdefault(id(tensor), ([], tensor))[0].append((layer, index))

    def _maker(self, tensor_id: int) -> tuple[Any, int] | None:
        made = self.made.get(tensor_id)
        return None if made is None else made[0][0]

    def output(self, tensor: Any) -> ModelOutput:
        """The `ModelOutput` of a tensor the model returned: the layer that computed it, and
        the layers that passed it on (pass-through layers, and layers that returned it as it
        was)."""
        tensor_id, through, seen = id(tensor), [], set()
        while tensor_id in self.made and tensor_id not in seen:
            seen.add(tensor_id)  # an identity layer on a model input returns that input
            calls = self.made[tensor_id][0]
            through[:0] = [layer for layer, _ in calls[1:]]
            maker, index = calls[0]
            inputs = self.inputs[index]
            if is_pass_through(maker) and len(inputs) == 1 and inputs[0] in self.made:
                through.insert(0, maker)
                tensor_id = inputs[0]
                continue
            return ModelOutput(maker, _dtype_name(tensor), tuple(dict.fromkeys(through)))
        return ModelOutput(None, _dtype_name(tensor))


def _floating(tensor: Any) -> bool:
    dtype = getattr(tensor, "dtype", None)
    return dtype is not None and keras.backend.standardize_dtype(dtype).startswith(
        ("float", "bfloat")
    )


def _last_dim(tensor: Any) -> int | None:
    return tensor.shape[-1] if len(tensor.shape) else None


def _dtype_name(tensor: Any) -> str:
    return keras.backend.standardize_dtype(tensor.dtype)


def _graph_outputs(model: keras.Model) -> list[ModelOutput] | None:
    """A functional (or Sequential) model's outputs as its graph records them: the leaf layer
    that produced each (inside nested functional models too) and the symbolic dtype; None for
    a subclassed model."""
    try:
        tensors = model.outputs
    except (AttributeError, ValueError):
        tensors = None
    if not tensors:
        return None
    return [ModelOutput(_leaf_producer(t), _dtype_name(t)) for t in keras.tree.flatten(tensors)]


def _leaf_producer(tensor: Any) -> Any:
    """The leaf layer that produced a symbolic tensor of a functional graph (inside nested
    functional models too), or None (an input, an operation that is not a layer, or a nested
    subclassed model, whose inside the graph does not show)."""
    layer, index = producing_layer(tensor), producing_output_index(tensor)
    while isinstance(layer, keras.Model) and layer.layers and index is not None:
        try:
            inner = keras.tree.flatten(layer.outputs)[index]
        except (AttributeError, ValueError, IndexError):
            return None
        layer, index = producing_layer(inner), producing_output_index(inner)
    if layer is None or isinstance(layer, keras.layers.InputLayer):
        return None
    return layer if isinstance(layer, keras.layers.Layer) else None


UNKNOWN_SIZE = 2  # a size-1 axis takes other code paths (and Keras warns of some)


def _size(dim: int | None) -> int:
    return UNKNOWN_SIZE if dim is None else dim


def zeros_like_inputs(model: keras.Model) -> Any:
    """A batch of zeros in the structure, shapes and dtypes of the model's inputs (unknown
    sizes `UNKNOWN_SIZE`)."""
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


@contextlib.contextmanager
def policies_swapped(layers: Sequence[Any], policy: Any) -> Iterator[None]:
    """Within the block, each of `layers` computes under `policy` (a name or a
    `keras.DTypePolicy`); their own policy objects are back after it, also when it raises.
    Holds the lock `observe` holds, so threads cannot save each other's swapped policies."""
    new = keras.DTypePolicy(policy) if isinstance(policy, str) else policy
    with CALLS_LOCK:
        saved = [layer.dtype_policy for layer in layers]
        try:
            for layer in layers:
                layer.dtype_policy = new
            yield
        finally:
            for layer, own in zip(layers, saved):
                layer.dtype_policy = own
