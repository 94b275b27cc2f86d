"""float8 made safe and visible: which layers to quantize, and what quantizing does to them.

Keras 3 trains in float8 through `layer.quantize("float8")`, for `Dense` and `EinsumDense`
only, as quantize-dequantize with delayed scaling: each quantized tensor (the inputs and the
kernel in e4m3, the output gradient in e5m2) is divided by a scale kept in a variable and
clipped at the format's largest value (448, 57344), and the scale follows the largest
magnitude (amax) seen over a history of steps. Keras's `Model.quantize("float8")` quantizes
every such layer, the float32 output layer included, and shows nothing of what happens.

- `float8_layers` quantizes the layers Transformer Engine's recipe keeps in float8: matmul
  dimensions that are multiples of 16, neither the model's first matmul layer nor an output
  or softmax layer, nor a layer the policy leaves in float32.
- In each training step, a quantized layer counts the values of each quantized tensor that
  saturate (Transformer Engine's "overflows": |x| / scale past the format's largest value)
  and that are zero once quantized (its "underflows": the float8 value is 0), in variables,
  with no host read; `float8_stats` reads them with the scales and the amax."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._common.layers import (
    check_built_model,
    forget_traced_functions,
    iter_layers,
    layer_names,
)
from tfmixprec._common.observe import Observation, observe
from tfmixprec._keras.float8 import (
    float8_call_watched,
    float8_counts,
    float_kernel,
    unwatch_float8_call,
    watch_float8_call,
)
from tfmixprec.precision import float8_recipe
from tfmixprec.precision.cpu_route import unroute
from tfmixprec.precision.float8_recipe import (  # and `tfmixprec.float8.X`, as in 0.4.0
    RECIPE,  # noqa: F401 (`tfmixprec.float8.RECIPE`; this module reads float8_recipe.RECIPE)
    ROLES,
    Float8LayerStats,
    Float8Recipe,  # noqa: F401
    Float8Tensor,  # noqa: F401
    Float8TensorStats,
    quantization_counts,
)
from tfmixprec.precision.policy import LOW_PRECISION, float32_reason

__all__ = [
    "Float8Change",
    "float8_layers",
    "float8_stats",
    "quantization_counts",  # float8_recipe's, offered here as in 0.4.0
]


@dataclasses.dataclass(frozen=True)
class Float8Change:
    """One layer `float8_layers` quantized.

    Attributes:
        layer: String. The layer's name, or its path (the layers it is nested in, then its
            name: `replay.layer_names`) where the model has another layer of that name (a
            KerasHub model has a `query` in every block).
        old: String. Its policy before (`mixed_bfloat16`, ...).
        new: String. Its policy now (`float8_from_mixed_bfloat16`, ...).
        dims: Tuple `(K, N)`. Its matmul's contracted and output dimensions.
    """

    layer: str
    old: str
    new: str
    dims: tuple[int, int]


def is_float8(layer: Any) -> bool:
    """Whether `layer` computes in float8 (Keras's `quantize("float8")`)."""
    return getattr(layer, "quantization_mode", None) == "float8"


def matmul_dims(layer: Any) -> tuple[int, int] | None:
    """The contracted (K) and output (N) dimensions of `layer`'s matmul (for `EinsumDense`,
    of the matmul its equation lowers to), or None for other layers."""
    kernel = float_kernel(layer)
    if kernel is None or not isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
        return None
    shape = [int(d) for d in kernel.shape]
    if isinstance(layer, keras.layers.Dense):
        return shape[0], shape[-1]
    inputs, rest = layer.equation.replace(".", "").split(",")
    kernel_letters, output = rest.split("->")
    k = math.prod(d for c, d in zip(kernel_letters, shape) if c in inputs and c not in output)
    n = math.prod(d for c, d in zip(kernel_letters, shape) if c in output and c not in inputs)
    return k, n


def has_matmul(layer: Any) -> bool:
    """Whether `layer` multiplies by a weight matrix or looks one up (a kernel, an embedding
    table): the layers that count as a model's first layer."""
    return any(v.name in ("kernel", "embeddings", "depthwise_kernel") for v in layer.weights)


def first_matmul_layer(observation: Observation) -> Any:
    """The model's first layer: the first layer with a kernel or an embedding table that the
    observed call ran (None when the call could not run)."""
    return next((c.layer for c in observation.calls if has_matmul(c.layer)), None)


def float8_reason(layer: Any, first: set[int], outputs: set[int]) -> str | None:
    """Why `layer` stays out of float8 (None: it may be quantized). `first` and `outputs`: the
    ids of the model's first matmul layer and of the layers that make its outputs."""
    if type(layer) not in (keras.layers.Dense, keras.layers.EinsumDense):
        return "not a Dense or EinsumDense (Keras quantizes only those to float8)"
    if getattr(layer, "quantization_mode", None) is not None:
        return f"already quantized ({layer.quantization_mode})"
    if getattr(layer, "lora_enabled", False):
        return "LoRA is enabled (Keras's float8 layers do not support LoRA)"
    if layer.dtype_policy.compute_dtype not in LOW_PRECISION:
        return f"computes in {layer.dtype_policy.compute_dtype} (the policy leaves it out)"
    role = float8_recipe.RECIPE.excluded_role(
        layer, output=id(layer) in outputs, first=id(layer) in first
    )
    if role == "softmax":
        return f"a softmax-like layer ({float32_reason(layer)})"
    if role is not None:
        return ROLES[role]
    k, n = matmul_dims(layer)
    if float8_recipe.RECIPE.misaligned((k, n)):
        return f"matmul dimensions {k} x {n} are not multiples of {float8_recipe.RECIPE.alignment}"
    return None


def float8_plan(model: keras.Model, exclude: Sequence[str] = ()) -> list[tuple[Any, str | None]]:
    """Every `Dense` / `EinsumDense` of `model` that ran in one observed call, with why it
    stays out of float8 (None: `float8_layers` quantizes it)."""
    observation = observe(model)
    outputs = {id(o.layer) for o in observation.outputs if o.layer is not None}
    first = {id(first_matmul_layer(observation))}
    called = {id(c.layer) for c in observation.calls}
    plan = []
    for layer in iter_layers(model):
        if not isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
            continue
        if id(layer) not in called:
            continue
        reason = float8_reason(layer, first, outputs)
        if reason is None and (layer.name in exclude or layer.path in exclude):
            reason = "excluded"
        plan.append((layer, reason))
    return plan


def _check_exclude(model: keras.Model, exclude: Any) -> tuple[str, ...]:
    if isinstance(exclude, str) or not isinstance(exclude, (list, tuple, set, frozenset)):
        raise TypeError(
            "exclude must be a list of layer names. Received: "
            f"exclude={exclude!r}. Pass e.g. exclude=['dense_1']."
        )
    known = {name for layer in iter_layers(model) for name in (layer.name, layer.path)}
    unknown = [name for name in exclude if name not in known]
    if unknown:
        raise ValueError(
            f"exclude names layers that model {model.name!r} does not have: {unknown!r}. "
            "Use the names in model.summary() (or layer.path)."
        )
    return tuple(exclude)


def _check_can_quantize(model: keras.Model) -> None:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        raise ValueError(
            f"float8_layers adds variables to model {model.name!r}, whose optimizer is "
            "already built (it has trained). Call float8_layers before the first fit, or "
            "compile the model again afterwards."
        )
    distributed = any(isinstance(v.value, tf.distribute.DistributedValues) for v in model.weights)
    if distributed and not tf.distribute.has_strategy():
        raise ValueError(
            f"model {model.name!r} was built under a tf.distribute strategy: call "
            "float8_layers inside the same strategy.scope(), so the new float8 variables are "
            "mirrored too."
        )
    if not any(x.dtype_policy.compute_dtype in LOW_PRECISION for x in iter_layers(model)):
        raise ValueError(
            f"float8_layers quantizes layers that compute in float16 or bfloat16, and model "
            f"{model.name!r} computes in float32. Build it under a mixed policy first: "
            "tfmixprec.set_policy('mixed_bfloat16') (or 'auto')."
        )


def float8_layers(model: keras.Model, exclude: Sequence[str] = ()) -> list[Float8Change]:
    """Quantizes the layers of `model` that float8 suits, and counts what it does to them.

    Follows Transformer Engine's recipe. A `Dense` or `EinsumDense` is quantized when both
    dimensions of its matmul are multiples of 16 and it computes in float16 or bfloat16 (a
    layer the policy leaves in float32 stays there), unless it is the model's first layer
    (the first layer with a kernel or an embedding table that a call runs), makes a model
    output, has a softmax-like activation or LoRA, or is in `exclude`. Each is quantized
    with Keras's own `layer.quantize("float8")`, and then counts, in every training step, the
    values it saturates and rounds to zero (`float8_stats`). A second call changes nothing. Decided
    from one real call of the model on a batch of zeros; on an error nothing is changed.

    Args:
        model: `keras.Model`. A built model under `mixed_float16` or `mixed_bfloat16`, not
            trained yet (call it before the first `fit`; under a `tf.distribute` strategy,
            inside its scope).
        exclude: List of strings. Paths (or names: a name leaves out every layer of that
            name, e.g. `query` in each block of a KerasHub model) of layers to leave as they
            are.

    Returns:
        List of `Float8Change(layer, old, new, dims)`, one per quantized layer.

    Raises:
        TypeError: If `exclude` is not a list of names.
        ValueError: If the model is not built, computes in float32, has a built optimizer,
            or `exclude` names a layer it does not have.

    Example:

    >>> tfmixprec.set_policy("mixed_bfloat16")
    >>> model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, name="a"),
    ...     keras.layers.Dense(64, name="b"), keras.layers.Dense(10, name="out")])
    >>> [c.layer for c in tfmixprec.float8_layers(model)]
    ['b']
    """
    check_built_model(model, "float8_layers")
    exclude = _check_exclude(model, exclude)
    _check_can_quantize(model)
    chosen = [layer for layer, reason in float8_plan(model, exclude) if reason is None]
    changes, labels = [], layer_names(model, short=True)
    for layer in chosen:
        old, dims = layer.dtype_policy.name, matmul_dims(layer)
        unroute(layer)  # a float16 CPU route would compute it without float8
        layer.quantize("float8")
        changes.append(Float8Change(labels[id(layer)], old, layer.dtype_policy.name, dims))
    watch_float8(model)
    forget_traced_functions(model)
    return changes


def gradient_watched(x: Any, seen: Any) -> Any:
    """`x` as it is, whose gradient is handed to `seen` on its way back (unchanged): the
    output gradient a float8 layer quantizes, where `watch_float8_call` puts it."""

    @tf.custom_gradient
    def watched(x: Any) -> Any:
        def grad(upstream: Any) -> Any:
            seen(upstream)
            return upstream

        return tf.identity(x), grad

    return watched(x)


class _Counts:
    """One float8 layer's counters: per quantized tensor, `quantization_counts` summed
    over its training steps (sync-on-read variables: each replica adds its own)."""

    def __init__(self, layer: Any) -> None:
        self.variables = {
            name: tf.Variable(
                tf.zeros([4], tf.int64),
                trainable=False,
                name=f"float8_counts_{name}",
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM,
            )
            for name in (t.name for t in float8_recipe.RECIPE.tensors)
        }
        self.layer = layer

    def scale(self, name: str) -> tf.Tensor:
        return tf.convert_to_tensor(getattr(self.layer, float8_recipe.RECIPE.tensor(name).scale))

    def add(self, name: str, x: Any, scale: Any) -> None:
        counts = quantization_counts(x, scale, float8_recipe.RECIPE.tensor(name).format)
        self.variables[name].assign_add(counts)

    def forward(self, inputs: Any, kernel: Any) -> None:
        self.add("inputs", inputs, self.scale("inputs"))
        self.add("kernel", tf.convert_to_tensor(kernel), self.scale("kernel"))

    def output(self, x: Any) -> Any:
        scale = self.scale("outputs_grad")  # as the forward reads it
        return gradient_watched(x, lambda g: self.add("outputs_grad", g, scale))

    def read(self) -> dict[str, np.ndarray]:
        """The counts summed over this process's replicas (no collective: across workers,
        each worker reads its own)."""
        strategy = tf.distribute.get_strategy()
        return {
            name: sum(v.numpy() for v in strategy.experimental_local_results(variable))
            for name, variable in self.variables.items()
        }


def _strategy_of(model: keras.Model) -> Any:
    if tf.distribute.has_strategy():
        return tf.distribute.get_strategy()
    return getattr(model, "distribute_strategy", tf.distribute.get_strategy())


def watch_float8(model: keras.Model) -> list[str]:
    """Makes every float8 layer of `model` count its saturated and zero values in training
    steps (layers `Model.quantize("float8")` quantized included); returns the names of the
    layers it started watching (the model's traced functions are dropped then)."""
    started = []
    with _strategy_of(model).scope():
        for layer in iter_layers(model):
            if is_float8(layer) and not float8_call_watched(layer):
                watch_float8_call(layer, _Counts(layer))  # the counters: a patch, undone below
                started.append(layer.path)
    if started:
        forget_traced_functions(model)
    return started


def unwatch_float8(model: keras.Model) -> list[str]:
    """Takes out what `watch_float8` made on every layer of `model` (the watched forward and
    the counter variables: each layer is as Keras made it again); returns the names of the
    layers it stopped watching (the model's traced functions are dropped then)."""
    stopped = [layer.path for layer in iter_layers(model) if unwatch_float8_call(layer)]
    if stopped:
        forget_traced_functions(model)
    return stopped


def applied_steps(model: keras.Model) -> int:
    optimizer = getattr(model, "optimizer", None)
    return 0 if optimizer is None else int(optimizer.iterations.numpy())


def _layer_stats(layer: Any, label: str, applied: int) -> Float8LayerStats:
    watched = float8_counts(layer)
    counts = {} if watched is None else watched.read()
    tensors = {}
    for tensor in float8_recipe.RECIPE.tensors:
        amax = np.asarray(getattr(layer, tensor.amax_history).numpy(), np.float64)
        values, saturated, zero, flushed = (int(v) for v in counts.get(tensor.name, (0,) * 4))
        moved = bool(np.any(amax != 0)) or applied == 0
        tensors[tensor.name] = Float8TensorStats(
            tensor.format,
            float(getattr(layer, tensor.scale).numpy()),
            float(np.max(amax)),
            values,
            saturated,
            zero,
            flushed,
            moved,
        )
    return Float8LayerStats(label, **tensors)


def float8_stats(model: keras.Model) -> list[Float8LayerStats]:
    """What float8 quantization did to each float8 layer of `model` (one host read).

    The counts are totals over the layer's calls with `training=True` (the training steps,
    and any such call outside `fit`) since the layer was watched (`float8_layers`, or a
    tfmixprec callback at the start of `fit` for layers quantized otherwise). A reader that
    wants an interval subtracts an earlier read (`Float8LayerStats.since`). Under a
    `tf.distribute` strategy the counts sum this process's replicas; across workers each
    worker counts its own.

    Args:
        model: `keras.Model`.

    Returns:
        List of `Float8LayerStats`, one per float8 layer, in the model's layer order (empty
        when it has none).

    Example:

    >>> tfmixprec.set_policy("mixed_bfloat16")
    >>> model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, name="a"),
    ...     keras.layers.Dense(64, name="b"), keras.layers.Dense(10, name="out")])
    >>> _ = tfmixprec.float8_layers(model)
    >>> [s.layer for s in tfmixprec.float8_stats(model)]
    ['b']
    >>> tfmixprec.float8_stats(model)[0].inputs.values  # no training step yet
    0
    """
    applied = applied_steps(model)
    labels = layer_names(model, short=True)
    return [
        _layer_stats(layer, labels[id(layer)], applied)
        for layer in iter_layers(model)
        if is_float8(layer)
    ]
