"""Keras's float8 `Dense` / `EinsumDense` as tfmixprec watches and replays them: the
in-step counters' call, a replay's call, the scale and amax-history variables' roles."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmixprec._keras.patches import patch, patches_of, undo_all

__all__: list[str] = []  # private module: nothing here is part of the package's API


# Why: Keras runs a float8 layer's quantize-dequantize forward in a method of its own, and
# where it is changed between releases; this is the one place that knows which. Keras 3.12 to
# 3.15: `Layer.quantized_call` calls the layer's private `self._float8_call(inputs,
# training=...)` (`Dense` / `EinsumDense` define it). Keras 3.16: the modes moved into
# strategies (`keras.src.quantizers.modes.float8.Float8Strategy`, the scale arithmetic into
# `keras.src.quantizers.float8_scaling`) and `quantized_call` calls `strategy.call(layer,
# inputs, training=...)` with no method of the layer's below it, so the layer's own
# `quantized_call` (the method `Operation.__call__` runs for a quantized layer) is the call
# to replace. Both compute the same: e4m3 inputs and kernel by `_kernel` and the `*_scale` /
# `*_amax_history` variables (`FLOAT8_VARIABLES`), the e5m2 output gradient right after the
# product, then the bias and `activation`.
def float8_entry(layer: Any) -> str:
    """The method of `layer` that runs its float8 forward, as this Keras calls it:
    `"_float8_call"` (Keras 3.12 to 3.15) or `"quantized_call"` (Keras 3.16)."""
    return "_float8_call" if hasattr(type(layer), "_float8_call") else "quantized_call"


def _class_call(layer: Any) -> Any:
    """The class's float8 forward, bound to `layer` (no patch of the instance's in it)."""
    return getattr(type(layer), float8_entry(layer)).__get__(layer)


def float_kernel(layer: Any) -> Any:
    """The float kernel variable a `Dense` / `EinsumDense` multiplies by (and a float8 layer
    quantizes), or None.

    Why: Keras keeps it as the private `_kernel` (Keras 3.12 to 3.16); the public `kernel`
    is the dequantized or LoRA-merged value for other modes."""
    return getattr(layer, "_kernel", None)


# Why: the forward has no hook to see the tensors it quantizes. `tfmixprec.float8` counts, in
# the step, the values that saturate or round to zero: this replaces the float8 forward
# (`float8_entry`) on the instance (the class, the config and the saved file are untouched)
# with one that hands `counts.forward` the inputs and the kernel first (read from `_kernel`,
# as Keras does) and, for that call only, puts `counts.output` in front of the layer's
# activation. `output` then sits after the bias, where the gradient is the one Keras
# quantizes to e5m2 right after its product (adding a bias does not change a gradient).
# `counts` itself (its variables) is kept on the layer as `COUNTS`, a patch of the same
# registry: `unwatch_float8_call` takes both out. Replica threads call it one at a time; the
# lock makes sure of it. The swap of `activation` lasts one Python call of the layer, i.e.
# while a training function is traced: a `get_config()` from another thread at that moment
# would see the wrapper (not guarded).
def watch_float8_call(layer: Any, counts: Any) -> None:
    original = _class_call(layer)
    lock = threading.Lock()

    def call(inputs: Any, training: Any = None, **kwargs: Any) -> Any:
        if not training:
            return original(inputs, training=training, **kwargs)
        counts.forward(inputs, float_kernel(layer))
        with lock, _before_activation(layer, counts.output):
            return original(inputs, training=training, **kwargs)

    patch(layer, float8_entry(layer), _FLOAT8_WATCH, lambda _: call, raw=True)
    patch(layer, COUNTS, _FLOAT8_WATCH, lambda _: counts, raw=True)


_FLOAT8_WATCH = "float8 counters"  # who patches a float8 layer's forward to count
COUNTS = "_tfmixprec_float8_counts"  # on a watched layer: its counters (`watch_float8_call`)


def unwatch_float8_call(layer: Any) -> bool:
    """Takes out what `watch_float8_call` made on `layer` (its forward and its counters);
    whether it had any."""
    return bool(undo_all(layer, who=_FLOAT8_WATCH))


def _before_activation(layer: Any, output: Any) -> Any:
    """A `with` patch: for the block, `output` sits in front of `layer`'s activation (after
    its bias)."""

    def make(activation: Any) -> Any:
        return output if activation is None else (lambda x: activation(output(x)))

    return patch(layer, "activation", "float8 output watch", make, raw=True)


def float8_call_watched(layer: Any) -> bool:
    """Whether `watch_float8_call` replaced `layer`'s float8 forward."""
    return bool(patches_of(layer, float8_entry(layer), _FLOAT8_WATCH))


def float8_counts(layer: Any) -> Any:
    """The counters `watch_float8_call` keeps on `layer`, or None."""
    return vars(layer).get(COUNTS) if float8_call_watched(layer) else None


# Why: a replay outside the step (`diagnosis`, `calibration`) differentiates a float8 layer's
# call eagerly and looks at the tensors it quantizes, and Keras's float8 `Dense` /
# `EinsumDense` allow neither: Keras 3.12 to 3.15 hand the variables themselves to
# `ops.custom_gradient`, whose eager form then finds variables read inside and asks Keras's
# gradient functions for their gradients (`variables=`), which they do not give ("too many
# values to unpack"; `fit` works: a `tf.function` traces it another way), and the output
# gradient it quantizes exists only inside it. Within the block, each float8 layer of
# `layers` runs the class's float8 forward (`float8_entry`; so the in-step counters of
# `watch_float8_call` count no replay) with those variables read through a
# `keras.StatelessScope`, mapped to their values read under the caller's tape (the gradients
# reach the variables as in the step); `output(layer, x)` sits before the activation, as in
# `watch_float8_call`, and `seen(layer, inputs, result)` follows the call. Keras 3.12 to 3.16
# read `_kernel` and the six `*_scale` / `*_amax_history` variables there. On Keras 3.16 the
# replaced method is `quantized_call`, which a call watcher (`_layers.watch_leaf_calls`)
# wraps too: enter this block first, so the watcher wraps the replay's call. Callers hold
# `_layers.CALLS_LOCK`.
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
            entry = float8_entry(layer)
            made = patch(layer, entry, "float8 replay", lambda _, c=call: c, raw=True)
            patches.callback(made.undo)
        yield


def _replayed_call(layer: Any, seen: Any, output: Any) -> Any:
    original = _class_call(layer)

    def call(inputs: Any, training: Any = None, **kwargs: Any) -> Any:
        variables = [float_kernel(layer), *(getattr(layer, name) for name in FLOAT8_VARIABLES)]
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
