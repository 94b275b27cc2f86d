"""The models bench times: the built-in ones (`build_model`: an MLP, a CNN, a Transformer block,
refused before they are built where they would not fit in memory), and for `--model` a zoo
model at its `"bench"` size or the one a user's function builds and compiles
(`MODULE:FUNCTION`, `FILE.py:FUNCTION`, `load_function`), with the data it returns or made-up
inputs and targets its loss accepts (`synthetic_inputs`, `synthetic_targets`); and the
variants to time for such a model (`source_variants`), which `bench.run_model_bench` runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._common.layers import iter_layers
from tfmixprec._common.targets import made_up_targets
from tfmixprec.fit.training import route_slow_cpu_kernels
from tfmixprec.precision.cpu_route import route_of
from tfmixprec.precision.policy import (
    check_policy_name,
    choose_policy,
    float32_outputs,
    policy_scope,
)
from tfmixprec.tools import zoo
from tfmixprec.tools.bench_errors import (
    check_memory,
    free_memory,
    out_of_memory,
    too_large,
    user_code,
)

__all__: list[str] = []


MODELS = ("mlp", "cnn", "transformer")


def builtin_data(model: str, batch: int, size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if model == "mlp":
        x = rng.normal(size=(batch, size)).astype("float32")
    elif model == "cnn":
        x = rng.normal(size=(batch, 32, 32, 3)).astype("float32")
    else:
        x = rng.normal(size=(batch, 64, size)).astype("float32")
    y = rng.integers(0, 10, size=(batch,)).astype("int32")
    return x, y


def build_model(model: str, size: int, cls: type = keras.Model) -> keras.Model:
    """A benchmark model whose matmuls dominate its step time.

    Args:
        model: String. `"mlp"` (4 Dense layers of width `size`), `"cnn"` (3 conv blocks on
            32x32x3 with `size // 8` filters) or `"transformer"` (one encoder block, sequence
            64, model width `size`, 4 heads, feed-forward 4x).
        size: Int. The width.
        cls: `keras.Model` or `MixedPrecisionModel`.

    Returns:
        An uncompiled functional model with a float32 softmax output.
    """
    _check_model_size(model, size)
    layers = keras.layers
    if model == "mlp":
        inputs = keras.Input((size,))
        h = inputs
        for _ in range(4):
            h = layers.Dense(size, activation="relu")(h)
    elif model == "cnn":
        inputs = keras.Input((32, 32, 3))
        h = inputs
        filters = max(size // 8, 8)
        for _ in range(3):
            h = layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
            h = layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
            h = layers.MaxPooling2D()(h)
            filters *= 2
        h = layers.GlobalAveragePooling2D()(h)
    else:
        inputs = keras.Input((64, size))
        attended = layers.MultiHeadAttention(4, key_dim=size // 4)(inputs, inputs)
        h = layers.LayerNormalization()(inputs + attended)
        ff = layers.Dense(4 * size, activation="relu")(h)
        h = layers.LayerNormalization()(h + layers.Dense(size)(ff))
        h = layers.GlobalAveragePooling1D()(h)
    outputs = layers.Dense(10, activation="softmax")(h)
    built = cls(inputs, outputs)
    float32_outputs(built)
    return built


def _check_model_size(model: str, size: int) -> None:
    """Raises `ValueError` for a built-in model name not in `MODELS`, or a width it cannot
    have (the transformer's 4 heads need a width of 4 or more)."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}. Received: model={model!r}")
    if model == "transformer" and size < 4:
        raise ValueError(
            "The transformer's width must be at least 4 (4 attention heads of width "
            f"size // 4). Received: size={size!r}; pass --size 4 or more."
        )


def _footprint(model: str, size: int) -> tuple[int, int]:
    """A built-in model's parameters, and the values one sample's training step keeps (its
    input and each layer's output), from its width: what `check_bench_memory` counts."""
    _check_model_size(model, size)
    if model == "mlp":
        return 4 * size * (size + 1) + 10 * (size + 1), 5 * size
    if model == "cnn":
        f = max(size // 8, 8)
        convolutions = [(3, f), (f, f), (f, 2 * f), (2 * f, 2 * f), (2 * f, 4 * f), (4 * f, 4 * f)]
        parameters = sum(9 * a * b + b for a, b in convolutions) + 10 * (4 * f + 1)
        return parameters, 32 * 32 * 3 + 4032 * f  # convolutions and poolings, 32x32 to 4x4
    heads = 4 * (size // 4)  # 4 heads of key_dim size // 4
    attention = 3 * (size * heads + heads) + heads * size + size
    feed_forward = size * 4 * size + 4 * size + 4 * size * size + size
    parameters = attention + 2 * 2 * size + feed_forward + 10 * (size + 1)
    return parameters, 64 * 15 * size + 4 * 64 * 64  # sequence 64; the scores of 4 heads


def _bench_bytes(model: str, size: int, batch: int, models: int) -> int:
    """At least the memory `models` built-in models side by side take to train: each
    parameter in float32 with its gradient and Adam's two moments, and a batch's values
    kept for the backward pass with their gradients."""
    parameters, values = _footprint(model, size)
    return models * (16 * parameters + 8 * batch * values)


def _largest_size(model: str, size: int, batch: int, models: int, free: int) -> int:
    """The largest width below `size` whose models fit in `free` bytes; 0 if none does."""
    smallest = 4 if model == "transformer" else 1
    low, high = smallest - 1, size  # the answer is in [low, high)
    while high - low > 1:
        middle = (low + high) // 2
        if _bench_bytes(model, middle, batch, models) <= free:
            low = middle
        else:
            high = middle
    return low if low >= smallest else 0


def check_bench_memory(model: str, size: int, batch: int, models: int) -> None:
    """Refuses a built-in model too large for this machine's memory before building it,
    with the largest `size` that fits (or, if none does, a smaller batch to pass).

    Raises:
        ValueError: If `models` models of `size` training on `batch` samples need more than
            `free_memory()`.
    """
    needed = _bench_bytes(model, size, batch, models)
    free = free_memory()
    if free is None or needed <= free:
        return
    largest = _largest_size(model, size, batch, models, free)
    what = (
        f"--model {model} --size {size} --batch-size {batch} "
        f"({_footprint(model, size)[0]:.2g} parameters a model, {models} models side by side)"
    )
    fix = f"Pass --size {largest} or less." if largest else "Pass a smaller --batch-size."
    raise too_large(what, needed, free, fix)


# Benched for a model of the user's when no policies are given.
MODEL_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
_SPEC_HELP = (
    "Pass a built-in model (mlp, cnn, transformer), a zoo model (gpt2, llama, gemma, mistral, "
    "bert, vit, resnet, mobilenet), or a function that builds and compiles yours: "
    "MODULE:FUNCTION or FILE.py:FUNCTION"
)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A model to bench, built afresh under each policy.

    Attributes:
        name: String. The model's name in the table.
        build: Callable `build() -> (model, dataset, batch)`: a compiled model, built under
            the current global policy, and a repeated `tf.data.Dataset` of its batches.
    """

    name: str
    build: Callable[[], tuple[keras.Model, tf.data.Dataset, int]]


def load_function(spec: str) -> Callable[[], Any]:
    """The function `MODULE:FUNCTION` or `FILE.py:FUNCTION` names (a file is run as a module).

    Raises:
        ValueError: If `spec` has another form, or names no importable function.
    """
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise ValueError(f"Unknown model {spec!r}. {_SPEC_HELP}.")
    if where.endswith(".py") and not Path(where).is_file():
        raise ValueError(f"No file {where!r} (from --model {spec!r}). {_SPEC_HELP}.")
    with user_code(spec, f"importing {where!r}"):
        module = _import(where)
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"{where!r} has no function {name!r} (from --model {spec!r}).")
    return function


def _import(where: str) -> Any:
    """A file run as a module, or a module imported as `python -m` would: from the current
    folder first (a console script does not put it on the path)."""
    if where.endswith(".py"):
        path = Path(where)
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(where)
    finally:
        if added:
            sys.path.remove(os.getcwd())


_RETURN_DATA = "Return (model, x, y) from your function."


def _input_bytes(source: str, spec: Any, batch: int) -> int:
    """The bytes of a batch of made-up data for the symbolic input `spec` (float64 as drawn);
    a `ValueError` that names `source` if bench cannot make it (an unknown dimension, not a
    number)."""
    shape, dtype = (batch, *spec.shape[1:]), str(spec.dtype)
    if None in shape:
        raise ValueError(
            f"{source}: its model's input {spec.name!r} has shape {tuple(spec.shape)}: bench "
            "cannot make data for it. Return (model, x, y) from your function."
        )
    if not any(kind in dtype for kind in ("int", "bool", "float")):
        raise ValueError(
            f"{source}: its model's input {spec.name!r} has dtype {dtype}: bench makes "
            "numbers only. Return (model, x, y) from your function."
        )
    return 8 * math.prod(shape)


def synthetic_inputs(model: keras.Model, batch: int, seed: int = 0, source: str = "bench") -> Any:
    """One batch of inputs for `model`, in its inputs' structure: floats from N(0, 1) and
    integer inputs of ones (a valid token and a full mask).

    Args:
        model: `keras.Model`. A functional or `Sequential` model.
        batch: Int. The batch size.
        seed: Int. The floats' seed.
        source: String. Where the model comes from (`--model 'my.py:build'`), to start an
            error's message.

    Raises:
        ValueError: If the model has no symbolic inputs (a subclassed model), one with an
            unknown dimension or of another dtype than numbers, or the batch would not fit
            in memory.
    """
    inputs = _symbolic_inputs(source, model)
    needed = sum(_input_bytes(source, spec, batch) for spec in keras.tree.flatten(inputs))
    what = f"{source} --batch-size {batch}: a batch of made-up inputs for its model"
    check_memory(needed, what, "Pass a smaller --batch-size.")
    rng = np.random.default_rng(seed)

    def value(spec: Any) -> np.ndarray:
        shape, dtype = (batch, *spec.shape[1:]), str(spec.dtype)
        if "int" in dtype or "bool" in dtype:
            return np.ones(shape, dtype)
        return rng.normal(size=shape).astype(dtype)

    with out_of_memory(what, "Pass a smaller --batch-size."):
        return keras.tree.map_structure(value, inputs)


def synthetic_targets(model: keras.Model, x: Any) -> tuple[Any, Any, str]:
    """`model`'s outputs on `x` (one inference call: the model's own code runs, so call it
    where its errors are the user's), targets its compiled loss accepts (`made_up_targets`:
    integer labels for a sparse loss, ...) and what they are in words."""
    outputs = model(x, training=False)
    return outputs, *made_up_targets(model, outputs)


def _symbolic_inputs(source: str, model: keras.Model) -> Any:
    """A functional model's inputs in their structure (a dict for KerasHub's), a
    `Sequential`'s input tensor."""
    try:
        return model.input
    except (AttributeError, ValueError):
        inputs = getattr(model, "inputs", None)  # a Sequential has these only
    if not inputs:
        raise ValueError(
            f"{source}: its model {model.name!r} has no symbolic inputs (a subclassed model): "
            "bench cannot make data for it. Return (model, x, y) from your function."
        )
    return inputs[0] if len(inputs) == 1 else inputs


def _tuples(value: Any) -> Any:
    """Lists as tuples, nested: `tf.data` reads a list as one tensor, a tuple as a structure
    (a model with several inputs)."""
    if isinstance(value, list | tuple):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def _model_and_batches(
    spec: str, returned: Any, batch: int
) -> tuple[keras.Model, tf.data.Dataset, int]:
    model, *data = returned if isinstance(returned, tuple) else (returned,)
    if not isinstance(model, keras.Model) or len(data) not in (0, 2, 3):
        raise TypeError(
            f"{spec} must return a compiled keras.Model, or (model, x, y) or (model, x, y, "
            f"sample_weight). Received: {type(returned).__name__}"
        )
    if not model.compiled:
        raise ValueError(
            f"{spec} returned model {model.name!r} not compiled: compile it in the function "
            "(model.compile(optimizer=..., loss=...)), as you train it."
        )
    if not data:
        x = synthetic_inputs(model, batch, source=f"--model {spec!r}")
        made_up = "calling its model on made-up inputs (floats from N(0, 1), integers of ones)"
        with user_code(spec, made_up, _RETURN_DATA):
            outputs, y, what = synthetic_targets(model, x)
        with user_code(spec, f"computing its loss on made-up targets ({what})", _RETURN_DATA):
            model.compute_loss(x, y, outputs)
        return model, tf.data.Dataset.from_tensors(_tuples((x, y))).repeat(), batch
    data = _tuples(data)
    _check_samples(spec, data, batch)
    batches = tf.data.Dataset.from_tensor_slices(tuple(data)).batch(batch, drop_remainder=True)
    return model, batches.repeat(), batch


def _check_samples(spec: str, data: tuple[Any, ...], batch: int) -> None:
    """Raises `ValueError` unless each array a function returned (x, y, sample_weight, nested)
    has the same number of samples along its first dimension, `batch` or more."""
    arrays = keras.tree.flatten(data)
    counts = sorted({np.shape(array)[0] if np.ndim(array) else 0 for array in arrays})
    if 0 in counts:
        kinds = sorted({type(a).__name__ for a in arrays if not np.ndim(a) or not len(a)})
        raise ValueError(
            f"{spec} returned data without samples (a {', '.join(kinds)}): return x and y "
            "(and sample_weight) as arrays with one row a sample."
        )
    if len(counts) > 1:
        raise ValueError(
            f"{spec} returned arrays of {' and '.join(map(str, counts))} samples: return x and "
            "y (and sample_weight) with as many rows each."
        )
    if counts[0] < batch:
        raise ValueError(
            f"{spec} returned {counts[0]} samples, fewer than the batch size {batch}: return "
            "more, or pass a smaller --batch-size."
        )


def model_source(spec: str, batch: int | None = None) -> ModelSource:
    """What `run_model_bench` benches for `spec`: a zoo model at its `"bench"` size, or the
    model a function builds (`load_function`), with its data or made-up inputs
    (`synthetic_inputs`) and targets its loss accepts."""
    if spec in zoo.MODELS:

        def build_zoo() -> tuple[keras.Model, tf.data.Dataset, int]:
            entry = zoo.build(spec, size="bench")
            entry.model.compile(optimizer="adam", loss=entry.loss)
            return entry.model, entry.dataset(4), entry.batch_size

        return ModelSource(spec, build_zoo)
    function = load_function(spec)
    size = 32 if batch is None else batch

    def build_function() -> tuple[keras.Model, tf.data.Dataset, int]:
        with user_code(spec, "calling it"):
            returned = function()
        return _model_and_batches(spec, returned, size)

    return ModelSource(spec.rpartition(":")[2], build_function)


def source_variants(
    source: ModelSource, policy: str, steps: int, hardware: Any, notes: list[str]
) -> list[dict[str, Any]]:
    """One variant per stack: float32 once; each low precision plain and through tfmixprec's
    CPU routes, the latter only where a route changes a layer (else it is the same step, and
    a line in `notes` says so); float16 on a CPU only through the routes (plain Keras float16
    there takes minutes a step, benchmarks/RESULTS.md 2b)."""
    resolved = choose_policy(hardware).name if policy == "auto" else check_policy_name(policy)
    stacks = ["keras", "tfmixprec"]
    if resolved == "float32":
        stacks = ["keras"]
    elif resolved == "mixed_float16" and not hardware.gpus and not hardware.tpus:
        stacks = ["tfmixprec"]
    variants = []
    for stack in stacks:
        with warnings.catch_warnings():
            # float16 without a GPU: bench measures it on purpose (set_policy's warning).
            warnings.filterwarnings("ignore", "mixed_float16 without a GPU", UserWarning)
            with policy_scope(resolved, hardware):
                keras.utils.set_random_seed(0)
                net, data, batch = source.build()
        if stack == "tfmixprec":
            route_slow_cpu_kernels(net)
            if variants and not any(route_of(layer) for layer in iter_layers(net)):
                notes.append(
                    f"{resolved}, tfmixprec: no layer to route here, the same step as keras"
                )
                continue
        variant = dict(policy=policy, resolved=resolved, stack=stack, net=net, steps=steps)
        variants.append({**variant, "batch": batch, "data": data})
    return variants
