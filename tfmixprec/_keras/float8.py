"""Keras's float8 `Dense` / `EinsumDense` as tfmixprec watches and replays them: the
in-step counters' call, a replay's call, the scale and amax-history variables' roles."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

# Why: keras-team/keras#20585 (see `MultiWorkerFit`): tfmixprec's fix must apply exactly where
# Keras's trainer takes its multi-worker path, so it asks Keras's own test.
# Why: see `in_xla_context`.
from tfmixprec._keras.patches import patch, patches_of

__all__: list[str] = []  # private module: nothing here is part of the package's API


# Why: Keras's float8 `Dense` / `EinsumDense` quantize inside their private `_float8_call`,
# which has no hook to see the tensors it quantizes. `tfmixprec.float8` counts, in the step,
# the values that saturate or round to zero: this replaces `_float8_call` on the instance (the
# class, the config and the saved file are untouched) with one that hands `forward` the
# inputs and the kernel first (read from `_kernel`, as Keras does) and, for that call only,
# puts `output` in front of the layer's activation. `output` then sits after the bias, where
# the gradient is the one Keras quantizes to e5m2 right after its product (adding a bias does
# not change a gradient). Replica threads call it one at a time; the lock makes sure of it.
# The swap lasts one Python call of the layer, i.e. while a training function is traced: a
# `get_config()` from another thread at that moment would see the wrapper (not guarded).
# Keras 3.12 to 3.15 call `self._float8_call(inputs, training=...)` from `quantized_call`.
def watch_float8_call(layer: Any, forward: Any, output: Any) -> None:
    original = type(layer)._float8_call.__get__(layer)
    lock = threading.Lock()

    def call(inputs: Any, training: Any = None, **kwargs: Any) -> Any:
        if not training:
            return original(inputs, training=training, **kwargs)
        forward(inputs, layer._kernel)
        with lock, _before_activation(layer, output):
            return original(inputs, training=training, **kwargs)

    patch(layer, "_float8_call", _FLOAT8_WATCH, lambda _: call, raw=True)


_FLOAT8_WATCH = "float8 counters"  # who patches a float8 layer's `_float8_call` to count


def _before_activation(layer: Any, output: Any) -> Any:
    """A `with` patch: for the block, `output` sits in front of `layer`'s activation (after
    its bias)."""

    def make(activation: Any) -> Any:
        return output if activation is None else (lambda x: activation(output(x)))

    return patch(layer, "activation", "float8 output watch", make, raw=True)


def float8_call_watched(layer: Any) -> bool:
    """Whether `watch_float8_call` replaced `layer`'s `_float8_call`."""
    return bool(patches_of(layer, "_float8_call", _FLOAT8_WATCH))


# Why: a replay outside the step (`diagnosis`, `calibration`) differentiates a float8 layer's
# call eagerly and looks at the tensors it quantizes, and Keras's float8 `Dense` /
# `EinsumDense` allow neither: their private `_float8_call` hands its variables themselves to
# `ops.custom_gradient`, whose eager form then finds variables read inside and asks Keras's
# gradient functions for their gradients (`variables=`), which they do not give ("too many
# values to unpack"; `fit` works: a `tf.function` traces it another way), and the output
# gradient it quantizes exists only inside it. Within the block, each float8 layer of
# `layers` runs the class's `_float8_call` (so the in-step counters of `watch_float8_call`
# count no replay) with those variables read through a `keras.StatelessScope`, mapped to
# their values read under the caller's tape (the gradients reach the variables as in the
# step); `output(layer, x)` sits before the activation, as in `watch_float8_call`, and
# `seen(layer, inputs, result)` follows the call. Keras 3.12 to 3.15 read `_kernel` and the
# six `*_scale` / `*_amax_history` variables there. Callers hold `_layers.CALLS_LOCK` (they
# run inside `watch_leaf_calls`).
FLOAT8_VARIABLES = (
    "inputs_scale",
    "inputs_amax_history",
    "kernel_scale",
    "kernel_amax_history",
    "outputs_grad_scale",
    "outputs_grad_amax_history",
)


@contextlib.contextmanager
def float8_replayed(layers: Sequence[Any], seen: Any, output: Any) -> Iterator[None]:
    quantized = [x for x in layers if getattr(x, "quantization_mode", None) == "float8"]
    with contextlib.ExitStack() as patches:
        for layer in quantized:
            call = _replayed_call(layer, seen, output)
            made = patch(layer, "_float8_call", "float8 replay", lambda _, c=call: c, raw=True)
            patches.callback(made.undo)
        yield


def _replayed_call(layer: Any, seen: Any, output: Any) -> Any:
    original = type(layer)._float8_call.__get__(layer)

    def call(inputs: Any, training: Any = None, **kwargs: Any) -> Any:
        variables = [layer._kernel, *(getattr(layer, name) for name in FLOAT8_VARIABLES)]
        values = [(v, tf.identity(tf.convert_to_tensor(v.value))) for v in variables]
        with _before_activation(layer, lambda x: output(layer, x)):
            with keras.StatelessScope(state_mapping=values):
                result = original(inputs, training=training, **kwargs)
        seen(layer, (inputs,), result)
        return result

    return call


# Why: Keras names a float8 layer's scale and amax-history variables `<tensor>_scale` and
# `<tensor>_amax_history` (`FLOAT8_VARIABLES`) and marks them `overwrite_with_gradient`: the
# optimizer assigns their "gradient", the new scale or history (a non-finite amax lands
# there). A report names the quantized tensor such a variable belongs to.
def float8_variable_role(variable: Any) -> str | None:
    """`"outputs_grad amax history"`, `"inputs scale"`, ... for a float8 layer's scale or
    amax-history variable; None for any other variable."""
    name = getattr(variable, "name", "").rsplit("/", 1)[-1].split(":")[0]
    if not getattr(variable, "overwrite_with_gradient", False) or name not in FLOAT8_VARIABLES:
        return None
    for kind in ("_amax_history", "_scale"):
        if name.endswith(kind):
            return f"{name[: -len(kind)]} {kind[1:].replace('_', ' ')}"
    return None
