"""Replaying one batch through a model outside the training step: the one engine behind
`explain_overflow` (and the callbacks' `diagnose=`), `calibrate` and `PrecisionRepair`.

`replay(model, batch, loss_fn, scale)` runs the batch forward and backward of the loss times
`scale`, with each leaf layer's call watched, and puts the model's state back afterwards. With
it: `computes_in` (whether a model has a layer computing in a dtype), `bad_data` (the one check
for NaN/Inf in a batch, with one message) and `layer_names` (the one way reports name layers).

The training mode is `training=True` (`TRAINING`) for every replay, the diagnosis's and the
repair's alike, because a replay asks what the step computed, and a step under `fit` calls
`model(x, training=True)`:

- batch normalization normalizes with the batch's own statistics in the step; its moving
  statistics (those of a fresh layer pass its inputs through unchanged) are what inference
  uses, so an inference replay would judge other values than the ones that overflowed;
- dropout is on in the step, and scales the values it keeps by `1 / (1 - rate)`: an
  inference replay sees smaller activations than the step did;
- a float8 layer's delayed scaling computes its new scales and amax histories only in
  training mode: the step's finite check counts them (a non-finite amax), so does the replay.

A replay in training mode writes state (moving statistics, dropout seed generators, a
stateful RNN's states, a layer's own metrics, `add_loss` losses, and Keras's global seed
generator, which an unseeded `keras.random.normal` in a layer draws from):
`_observe.state_put_back` puts every variable that is not trainable back as it was, bit for
bit (metrics' variables, which `model.variables` leaves out, and the optimizer's own state
included), and the global seed generator too, so a replay changes nothing: a fit with
`diagnose=N` ends with the weights of the same fit without it, and two replays of the same
batch (the model's dtypes, then float32) draw the same seeds. A dropout in
float32 draws its mask in float32, though: it can keep other values than in float16 (a
float32 replay's numbers are a reference, not the same computation).

Private: the module's names are shared with `diagnosis`, `calibration` (and `repair` through
it) and `float8` (`layer_names`); nothing here is part of the package's API."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmixprec._common.arrays import nonfinite_count
from tfmixprec._common.layers import (
    CALLS_LOCK,
    all_layers,
    iter_layers,
    loss_value,
    watch_leaf_calls,
)
from tfmixprec._common.observe import state_put_back
from tfmixprec._common.validate import check_bool
from tfmixprec._keras.float8 import float8_replayed
from tfmixprec.replay.clash import DtypeClashError, clash_of
from tfmixprec.scaling.loss_scale import multiply

__all__ = []


# The one training mode of every replay: as the step under `fit` runs the model (see above).
TRAINING = True


@dataclasses.dataclass(frozen=True)
class Replay:
    """One replay of a batch.

    Attributes:
        y_pred: The model's outputs.
        loss: Float. The batch's loss (float32, unscaled).
        grads: Tuple. The gradients of the loss times the scale, one per trainable variable
            of the model, in `model.trainable_variables`' order (None where none reaches it).
    """

    y_pred: Any
    loss: float
    grads: tuple[Any, ...]


def _no_float8_output(layer: Any, x: Any) -> Any:
    return x


def replay(
    model: keras.Model,
    batch: Sequence[Any],
    loss_fn: Callable[..., Any],
    scale: float,
    record: Callable[[Any, tuple, Any], None] | None = None,
    float8: tuple[Callable, Callable] | None = None,
    training: bool = TRAINING,
) -> Replay:
    """Replays `batch` through `model`: forward, the loss, and the gradients of the loss times
    `scale`; every variable that is not trainable is put back after it (nothing changes).

    Args:
        model: `keras.Model`. A built model, in the dtypes it computes in now.
        batch: Tuple `(x, y, sample_weight)` (`sample_weight` may be None).
        loss_fn: A `keras.losses.Loss` or a callable `(y_true, y_pred)` (see
            `_layers.loss_value`).
        scale: Float. The loss scale.
        record: Callable `(layer, args, result)` or None. Called after each leaf layer call
            (`_layers.watch_leaf_calls`).
        float8: Tuple `(seen, output)` or None. The float8 layers' watchers
            (`_keras.float8.float8_replayed`); None: none. Float8 layers are differentiated
            eagerly either way.
        training: Bool. The mode the model is called in; `TRAINING` (True, as the step).

    Returns:
        A `Replay`.

    Raises:
        TypeError: If `training` is not True or False.
        DtypeClashError: If the model's call fails because its own code mixes dtypes
            (`clash.DtypeClash`).
    """
    training = check_bool("training", training)
    x, y, sample_weight = batch
    seen, output = float8 if float8 is not None else (lambda *_: None, _no_float8_output)
    called: list[Any] = []

    def note(layer: Any, args: tuple, result: Any) -> None:
        called.append(layer)
        if record is not None:
            record(layer, args, result)

    # The float8 replay first: on Keras 3.16 it replaces the `quantized_call` the watcher wraps.
    float8_replay = float8_replayed(iter_layers(model), seen, output)
    with state_put_back(model), CALLS_LOCK, float8_replay, watch_leaf_calls(model, note):
        with tf.GradientTape() as tape:
            y_pred = _called(model, x, training, called)
            loss = loss_value(loss_fn, y, y_pred, sample_weight)
            scaled = multiply(loss, scale)
        grads = tape.gradient(scaled, model.trainable_variables)
    return Replay(y_pred, float(loss.numpy()), tuple(grads))


def _called(model: keras.Model, x: Any, training: bool, called: list[Any]) -> Any:
    """`model(x, training=training)`; a call that fails because the model's own code mixes
    dtypes raises `DtypeClashError` (`clash.clash_of`), other errors as they are."""
    try:
        return model(x, training=training)
    except (tf.errors.InvalidArgumentError, TypeError) as err:
        clash = clash_of(err, model, called)
        if clash is None:
            raise
        raise DtypeClashError(clash) from err


def computes_in(layer: Any, dtype: str) -> bool:
    """Whether `layer` (a model, say) or a layer nested in it computes in `dtype`: only a
    model with a float16 layer has gradients below 2^-24 that flush to zero, and needs a loss
    scale (bfloat16 and float32 keep them)."""
    return any(part.compute_dtype == dtype for part in all_layers(layer))


def bad_data(batch: Sequence[Any]) -> str | None:
    """What NaN/Inf the batch's inputs, labels or sample weights hold, in one sentence and its
    fix, or None (the first of them that holds one)."""
    for name, value in zip(("inputs", "labels", "sample weights"), batch):
        bad = nonfinite_count(value)
        if bad:
            return (
                f"the batch's {name} hold {bad} NaN/Inf values: no float32 layer and no loss "
                "scale can fix this. Clean or filter the data (dataset.filter on "
                "tf.math.is_finite)."
            )
    return None


# What an operation makes of a 0, and the fix: a value that underflowed to 0 before it.
_LOG_OF_ZERO = (
    "-inf of that 0 (log(0)",
    "Take the log of a softmax as keras.ops.log_softmax (or tf.nn.log_softmax), which never "
    'forms the 0, or compute that layer in float32 (dtype="float32" on the layer).',
)
# Per operation, the input whose 0 it makes Inf/NaN of: log(0), x / 0.
_LOGS = {"Log": 0, "Xlogy": 1}
_DIVISIONS = {"Reciprocal": 0, "Rsqrt": 0, "RealDiv": 1, "Div": 1, "Xdivy": 1, "FloorDiv": 1}


def underflow_to_zero(found: Any, reference: str = "") -> str | None:
    """Where the first float16/bfloat16 operation that was not finite (a
    `_keras.op_watch.NonfiniteOp`, or None) made Inf/NaN of a 0 from finite inputs: a value
    that underflowed to 0 before it (a softmax's smallest probabilities), then log(0) or a
    division by 0. What happened, with the fix, in a sentence or two (`reference`, after the
    dtype's range: what the float32 replay showed); None for anything else."""
    if found is None or not found.inputs_finite:
        return None
    zero = {**_LOGS, **_DIVISIONS}.get(found.operation)
    if zero is None or zero not in found.zero_inputs:
        return None
    if found.operation in _LOGS:
        made, fix = _LOG_OF_ZERO
    else:
        made = "Inf of that 0 (a division by 0"
        fix = (
            f"Keep the divisor from 0 (add an epsilon {found.dtype} holds, 1e-3 say), or compute "
            'that layer in float32 (dtype="float32" on the layer).'
        )
    at = f", at {found.where}" if found.where else ""
    return (
        f"a value inside it underflows to 0 in {found.dtype} (a softmax's smallest "
        f"probabilities, say), then {found.operation} makes {made}{at}): an underflow, not a "
        f"value past {found.dtype}'s range{reference}. {fix}"
    )
