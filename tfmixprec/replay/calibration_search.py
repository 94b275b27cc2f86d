"""The calibration's search, by replaying (`Replayer`): the smallest set of layers that must
compute in float32 (`float32_set`; the steps are in `calibration`'s docstring), the loss in
float32 where its own dtype overflows, and the loss scale to start at (`starting_scale`: the
paper's rule with `MARGIN`, verified finite on the batches) with the steps a start skips.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._common.arrays import float_array
from tfmixprec._common.dtypes import DTYPE_MAX, FLOAT16_MAX
from tfmixprec._common.layers import (
    all_layers,
    iter_layers,
    variable_owners,
)
from tfmixprec._keras.graph import all_sublayers
from tfmixprec._keras.losses import loss_dtype, loss_in
from tfmixprec._keras.op_watch import first_nonfinite_op
from tfmixprec.precision.policy import LOW_PRECISION
from tfmixprec.replay.clash import DtypeClash, DtypeClashError
from tfmixprec.replay.engine import bad_data, underflow_to_zero
from tfmixprec.replay.replayer import HEADROOM, Replayer, ReplayRun, near_limit
from tfmixprec.scaling.loss_scale import LossScaleConfig

__all__: list[str] = []


MARGIN = 8.0  # initial_scale keeps the largest gradient times the scale 8x under 65504
KERAS_START = LossScaleConfig.initial_scale  # 2^15, Keras's and tfmixprec's default start


@dataclasses.dataclass(frozen=True)
class Float32Set:
    """What `float32_set` found: the layers that must compute in float32, each with why, and
    what no float32 layer fixes (None: nothing).

    Attributes:
        layers: Tuple of `(layer, why)`, in the order they were found.
        cause: String. `"none"` (nothing overflows), `"forward-overflow"`,
            `"near-overflow"` (values within `HEADROOM` of the range, none past it),
            `"backward-overflow"` or `"loss-overflow"` (the layers' outputs are finite, the
            loss is not: the first the set fixes), `"bad-data"` (NaN/Inf in the batch), or
            `"not-precision"` (not finite even in float32, or an operation outside any
            layer; `layers` is then empty: nothing is moved). A `"loss-overflow"` that
            computing the loss in float32 does not fix has `problem` too, and moves nothing.
        problem: String or None. What the set cannot fix, in a sentence.
        loss: String or None. Why the loss must compute in float32 (a `keras.losses.Loss`
            built with a float16 or bfloat16 dtype that overflows by itself), or None: the
            loss stays as it is.
    """

    layers: tuple[tuple[Any, str], ...]
    cause: str
    problem: str | None
    loss: str | None = None


def float32_set(replayer: Replayer) -> Float32Set:
    """The smallest set of layers of the replayer's model that must compute in float32 for
    every one of its batches to run finite forward and backward (unscaled); see the docstring
    of `tfmixprec.replay.calibration`. Changes no state."""
    for batch in replayer.batches:
        bad = bad_data(batch)
        if bad is not None:
            return Float32Set((), "bad-data", bad)
    model = replayer.model
    chosen: dict[int, tuple[Any, str]] = {}
    cause, loss = "none", None
    for _ in range(len(iter_layers(model)) + 2):
        found = _next_fix(replayer, [layer for layer, _ in chosen.values()])
        if found is None:
            break
        kind, fix = found
        if isinstance(fix, str):  # nothing is moved: the layers found so far do not fix it
            named = kind in ("loss-overflow", "model-code")  # else not the precision's
            return Float32Set((), kind if named else "not-precision", fix)
        if kind == "loss-overflow":  # the replays go on with the loss in float32
            replayer.loss_fn, loss = fix
            replayer.forget()  # its float32 replays were of the loss as it was
            cause = kind if cause == "none" else cause
            continue
        fix = _runnable(replayer, [layer for layer, _ in chosen.values()], fix)
        if isinstance(fix, str):
            return Float32Set((), "not-precision", fix)
        cause = kind if cause == "none" else cause
        for layer, why in fix:
            chosen.setdefault(id(layer), (layer, why))
    return Float32Set(tuple(_prune(replayer, list(chosen.values()))), cause, None, loss)


def _runnable(replayer: Replayer, chosen: list[Any], fix: list[tuple[Any, str]]) -> Any:
    """`fix`, or, where the model's call fails with it (see `Replayer.runs_with`), `fix` and
    the innermost layer around it that makes the call run, with its sublayers, in float32."""
    layers = [*chosen, *(layer for layer, _ in fix)]
    if replayer.runs_with(layers):
        return fix
    first = fix[0][0]
    for outer in _enclosing(replayer.model, first):
        parts = [outer, *all_sublayers(outer)]
        if replayer.runs_with([*layers, *parts]):
            why = f"{outer.name!r} computes with {first.name!r}: its call mixes their dtypes"
            return [*fix, *((part, why) for part in parts)]
    return (
        f"the model's call fails with {first.name!r} in float32 (an operation mixes float16 "
        "and float32 tensors): compute that part in float32 by hand."
    )


def _next_fix(replayer: Replayer, chosen: list[Any]) -> tuple[str, Any] | None:
    """The next layers to add, as `(cause, [(layer, why), ...])`, or `(cause, problem)` for
    what float32 layers cannot fix, or None when every batch is finite."""
    for index, batch in enumerate(replayer.batches):
        try:
            run = replayer.run(batch, 1.0, chosen)
        except DtypeClashError as err:
            return "model-code", _clash_fix(replayer, index, chosen, err.clash)
        if run.first_bad is not None:
            overflows = run.calls[run.first_bad].overflows  # else within the headroom only
            kind = "forward-overflow" if overflows else "near-overflow"
            return kind, _forward_fix(replayer, index, run, chosen)
        if not math.isfinite(run.loss):
            return "loss-overflow", _loss_fix(replayer, index, run, chosen)
        if not run.grads_finite:
            return "backward-overflow", _backward_fix(replayer, index, run, chosen)
    return None


def _clash_fix(replayer: Replayer, index: int, chosen: list[Any], clash: DtypeClash) -> Any:
    """The fewest layers whose float32 lets the call get past `clash` (each leaf inside the
    raising layer alone, then the layer with its sublayers, then each layer around it), as
    `[(layer, why), ...]`, or what no float32 layer fixes, in a sentence."""
    layer = clash.layer
    if layer is None:
        return f"{clash.describe()}, in no layer Keras named: cast the tensor in that code."
    leaves = [part for part in all_sublayers(layer) if not all_sublayers(part)]
    candidates = [[leaf] for leaf in leaves] + [
        [outer, *all_sublayers(outer)] for outer in [layer, *_enclosing(replayer.model, layer)]
    ]
    for parts in candidates:
        if _gets_past(replayer, index, [*chosen, *parts], layer):
            why = f"{clash.describe()}; with it in float32 the call runs"
            return [(part, why) for part in parts]
    return (
        f"{clash.describe()}, and no layer in float32 lets the call run: cast the tensor in "
        "that code."
    )


def _gets_past(replayer: Replayer, index: int, float32: list[Any], layer: Any) -> bool:
    """Whether batch `index` runs with `float32` in float32, or fails on a dtype clash in
    another layer than `layer` (a later block, which the next fix takes)."""
    try:
        replayer.run(replayer.batches[index], 1.0, float32)
    except DtypeClashError as err:
        return err.clash.layer is not None and err.clash.layer is not layer
    except (tf.errors.OpError, TypeError, ValueError):
        return False
    return True


def _loss_fix(replayer: Replayer, index: int, run: ReplayRun, chosen: list[Any]) -> Any:
    """Every layer's output is finite and the loss is not: `(the loss in float32, why)` for a
    `keras.losses.Loss` whose own dtype is float16 or bfloat16 and that float32 makes finite,
    else what computing layers in float32 cannot fix, in a sentence."""
    loss, dtype = replayer.loss_fn, loss_dtype(replayer.loss_fn)
    value = f"{run.loss:g}"
    if dtype in LOW_PRECISION:
        in_float32 = loss_in(loss, "float32")
        trial = replayer.run(replayer.batches[index], 1.0, chosen, loss_fn=in_float32)
        if math.isfinite(trial.loss):
            why = (
                f"the loss overflows in {dtype}: it computes in its own dtype ({dtype}) and is "
                f"{value} on outputs that are finite, {trial.loss:.4g} in float32"
            )
            return in_float32, why
    if math.isfinite(replayer.in_float32(index).loss):
        return (
            f"the loss overflows in float16: it is {value} on finite outputs, and finite with "
            "every layer in float32. It computes in the outputs' dtype: compute it in float32 "
            "(a float32 output layer, tfmixprec.float32_outputs(model), or cast y_pred to "
            "float32 in the loss)."
        )
    return (
        f"the loss overflows by itself: it is {value} on finite outputs, even with every layer "
        "in float32. Its own code computes in float16 (a Loss built with dtype='float16', or a "
        "cast inside it), or the labels are out of range: compute it in float32 and check the "
        "labels."
    )


def _limit(dtype: str) -> str:
    return f"{dtype}'s {DTYPE_MAX.get(dtype, math.inf):.6g}"


def _past(value: float, dtype: str) -> str:
    """How `value` stands against `dtype`'s range: past it, or within `HEADROOM` of it."""
    if value > DTYPE_MAX.get(dtype, math.inf):
        return f"past {_limit(dtype)}"
    return f"within {HEADROOM:g}x of {_limit(dtype)}"


def _forward_fix(replayer: Replayer, index: int, run: ReplayRun, chosen: list[Any]) -> Any:
    bad = run.first_bad
    call, reference = run.calls[bad], replayer.in_float32(index)
    if len(reference.calls) <= bad or (reference.calls[bad].bad and not reference.sound):
        return (
            f"layer {call.layer.name!r} is not finite even in float32: the weights or the "
            "model diverge, not the precision (lower the learning rate, check the "
            "initialization)."
        )
    dtype = replayer.dtypes.get(id(call.layer), call.dtype)  # as the model has it
    call = dataclasses.replace(call, dtype=dtype)
    largest, near = reference.calls[bad].max_abs, near_limit(call.dtype)
    received = reference.calls[bad].input_max  # its inputs, with every layer in float32
    if not any(layer is call.layer for layer in chosen):
        if call.risky_inputs and received > near:  # Keras casts a layer's inputs to its dtype
            why = f"it receives values up to {received:.4g} ({_past(received, call.dtype)})"
            return [(call.layer, f"{why} and casts them to {call.dtype}")]
        if not call.risky_inputs and largest > near:
            why = f"its outputs reach {largest:.4g}, {_past(largest, call.dtype)}"
            return [(call.layer, why)]
        if not call.risky_inputs:
            return [(call.layer, _inside(replayer, index, chosen, call.dtype, largest))]
    # Overflowed before it, or inside it though it computes in float32: in an operation
    # of a layer around it (or of itself, around its sublayers).
    around = _enclosing(replayer.model, call.layer)
    for outer in ([call.layer] if not call.risky_inputs else []) + around:
        parts = [outer, *all_sublayers(outer)]
        trial = replayer.run(replayer.batches[index], 1.0, [*chosen, *parts])
        if len(trial.calls) > bad and not trial.calls[bad].risky:
            why = f"an operation inside {outer.name!r} passes {_limit(call.dtype)}"
            return [(part, why) for part in parts]
    return (
        f"an operation outside any layer (keras.ops in a model's call, say) passes "
        f"{_limit(call.dtype)} before layer {call.layer.name!r}: cast it to float32 in that "
        "call."
    )


def _inside(replayer: Replayer, index: int, chosen: list[Any], dtype: str, largest: float) -> str:
    """Why a layer is not finite whose outputs are in range in float32 (`largest`): a value
    that underflowed to 0 before a log or a division inside it (`engine.underflow_to_zero`,
    the operation watched in one more replay), else a value inside it past the range."""
    found = first_nonfinite_op(lambda: replayer.run(replayer.batches[index], 1.0, chosen))
    reference = f"; its output is finite in float32 (max |x| {largest:.4g})"
    return underflow_to_zero(found, reference) or f"a value inside it passes {_limit(dtype)}"


def _enclosing(model: keras.Model, layer: Any) -> list[Any]:
    """The layers `layer` is nested in, innermost first (the model itself left out)."""
    around = [
        outer
        for outer in iter_layers(model)
        if outer is not layer and any(part is layer for part in all_sublayers(outer))
    ]
    return sorted(around, key=lambda outer: len(all_sublayers(outer)))


def _backward_fix(replayer: Replayer, index: int, run: ReplayRun, chosen: list[Any]) -> Any:
    """The layer nearest the loss whose variables' gradients are not finite, not yet chosen."""
    if not replayer.in_float32(index).grads_finite:
        return (
            "the gradients are not finite even in float32: the loss or the model diverge, "
            "not the precision (lower the learning rate, check the labels)."
        )
    owners = variable_owners(replayer.model)
    variables = replayer.model.trainable_variables
    bad = {
        id(owners[id(v)])
        for v, g in zip(variables, run.grads)
        if g is not None and id(v) in owners and not np.isfinite(float_array(g)).all()
    }
    taken = {id(layer) for layer in chosen}
    for call in reversed(run.calls):
        if id(call.layer) in bad and id(call.layer) not in taken:
            why = f"its gradients are not finite in {call.dtype} even unscaled"
            return [(call.layer, why)]
    return (
        "the gradients are not finite though every layer whose gradients overflow already "
        "computes in float32: an operation outside the layers overflows in the backward pass."
    )


def _prune(replayer: Replayer, chosen: list[tuple[Any, str]]) -> list[tuple[Any, str]]:
    """`chosen` without the layers every batch stays finite without (one pass, in order)."""
    kept = list(chosen)
    for entry in chosen:
        trial = [layer for layer, _ in kept if layer is not entry[0]]
        if replayer.finite_at(1.0, trial):
            kept = [item for item in kept if item is not entry]
    return kept


def float16_gradient_max(model: keras.Model, runs: list[ReplayRun], float32: list[Any]) -> float:
    """The largest |gradient| (float32 replays, unscaled) of a variable whose layer computes
    in float16 once `float32` compute in float32: only those meet float16's range."""
    taken = {id(layer) for layer in float32}
    largest = 0.0
    for key, grads in grads_by_layer(model, runs).items():
        layer = _layer_by_id(model, key)
        if key not in taken and layer.compute_dtype == "float16":
            largest = max([largest, *(float(np.abs(g).max()) for g in grads if g.size)])
    return largest


def _layer_by_id(model: keras.Model, key: int) -> Any:
    return next(layer for layer in all_layers(model) if id(layer) == key)


def _paper_scale(gradient_max: float) -> float:
    """The largest power of two S with gradient_max * S * MARGIN <= 65504, within [1, 2^24]."""
    if gradient_max <= 0:
        return LossScaleConfig.max_scale
    if not math.isfinite(gradient_max):  # not finite even in float32: no scale helps
        return 1.0
    exponent = math.floor(math.log2(FLOAT16_MAX / (gradient_max * MARGIN)))
    return float(2.0 ** min(max(exponent, 0), 24))


def starting_scale(
    replayer: Replayer, layers: list[Any], gradient_max: float | None = None
) -> float:
    """The scale to start at with `layers` in float32: the paper's rule with `MARGIN` on the
    largest gradient of a float16 layer (from the replayer's float32 replays unless given),
    within the optimizer's bounds, halved until the batches are finite at it."""
    model = replayer.model
    if gradient_max is None:
        runs = [replayer.in_float32(i) for i in range(len(replayer.batches))]
        gradient_max = float16_gradient_max(model, runs, layers)
    low, high = _bounds(model)
    start = min(max(_paper_scale(gradient_max), low), high)
    return _verified_scale(replayer, layers, start, low)


def _bounds(model: keras.Model) -> tuple[float, float]:
    """The [min_scale, max_scale] of `model`'s tfmixprec optimizer (tfmixprec's defaults for
    any other)."""
    config = getattr(getattr(model, "optimizer", None), "loss_scale_config", None)
    config = config if config is not None and config.dynamic else LossScaleConfig()
    return config.min_scale, config.max_scale


def _verified_scale(replayer: Replayer, layers: list[Any], scale: float, low: float = 1.0) -> float:
    """`scale`, halved until every batch is finite at it (`low` at the least)."""
    while scale > low and not replayer.finite_at(scale, layers):
        scale = max(scale / 2.0, low)
    return scale


def skipped_steps(replayer: Replayer, layers: list[Any], start: float) -> int | None:
    """Steps a dynamic scale starting at `start` skips on the batches: the halvings until
    every batch is finite (found by bisection; None: not finite even at 1)."""
    if replayer.finite_at(start, layers):
        return 0
    most = int(math.log2(start)) if start >= 1 else 0
    if not replayer.finite_at(start / 2.0**most, layers):
        return None
    low, high = 0, most  # not finite after `low` halvings, finite after `high`
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (
            (low, middle) if replayer.finite_at(start / 2.0**middle, layers) else (middle, high)
        )
    return high


def grads_by_layer(model: keras.Model, runs: list[ReplayRun]) -> dict[int, list[np.ndarray]]:
    owners = variable_owners(model)
    per_layer: dict[int, list[np.ndarray]] = {}
    for run in runs:
        for variable, grad in zip(model.trainable_variables, run.grads):
            if grad is not None and id(variable) in owners:
                per_layer.setdefault(id(owners[id(variable)]), []).append(float_array(grad))
    return per_layer
