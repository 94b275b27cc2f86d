"""Which layers must compute in float32, and the loss scale to start at: found by replaying
batches outside training.

`calibrate(model, data, steps=8)` replays a few batches before the first step and returns a
`CalibrationReport`: per leaf layer, how large its outputs and gradients are; the loss scale
to start at (`initial_scale`); and the smallest set of layers that must compute in float32 so
that no value overflows (`float32_layers`). `report.apply(model)` makes the change.

The set is found by replaying, not guessed from layer types (`float32_set`, which
`PrecisionRepair` uses during `fit` too):

1. Replay the batch forward in the model's dtypes, with the set so far in float32. The first
   layer call whose output is not finite although its inputs are joins the set (checked
   finite in float32 first; a layer that is not finite even in float32 is a divergence, not
   a precision problem, unless the float32 replay's loss and gradients are finite: then its
   NaN/Inf are on purpose, a `-inf` key mask before a softmax, and passed over). That is the
   layer that overflows (or whose value underflows to 0 before a log, named as such), and
   then each consumer of its float32 output that casts it back to float16, until the values
   are back in range (typically at the next normalization, which does not cast its inputs).
2. A call whose inputs are already not finite overflowed in an operation outside any leaf
   layer (the attention logits, computed inside `MultiHeadAttention`): the innermost layer
   around it that makes it finite in float32, with its sublayers, joins the set.
3. Once forward is finite, a layer whose gradients are not finite even unscaled (scale 1)
   joins the set, nearest the loss first.
4. Last, each layer of the set is tried without: one the batches stay finite without is
   dropped. Every layer left is needed: without it, some value overflows.

A value counts as overflowing from a quarter of its dtype's largest value on (`HEADROOM`).

Replays run through `tfmixprec.replay`, in its training mode (`replay.TRAINING`: as the step
runs the model, the same mode `explain_overflow` replays in; batch normalization on the batch's
own statistics, dropout on), and the model's state is put back after each (moving statistics,
dropout seeds): no weight, optimizer slot, statistic or loss scale changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._common.arrays import float_array, float_arrays
from tfmixprec._common.dtypes import DTYPE_MAX, FLOAT16_MAX
from tfmixprec._common.layers import (
    all_layers,
    check_built_model,
    compiled_loss,
    forget_traced_functions,
    iter_layers,
    layer_names,
    mark_float32,
    variable_owners,
)
from tfmixprec._common.observe import policies_swapped
from tfmixprec._common.text import docs_page, jsonable, markdown_table
from tfmixprec._common.validate import check_bool, check_int_at_least_one
from tfmixprec._keras.graph import all_sublayers
from tfmixprec._keras.losses import loss_dtype, loss_in, set_loss_dtype
from tfmixprec._keras.op_watch import first_nonfinite_op
from tfmixprec.precision.float8 import is_float8
from tfmixprec.precision.policy import LOW_PRECISION, PolicyChange, compute_in_float32
from tfmixprec.replay.clash import DtypeClash, DtypeClashError
from tfmixprec.replay.engine import TRAINING, bad_data, computes_in, replay, underflow_to_zero
from tfmixprec.scaling.gradient_range import gradient_range_stats
from tfmixprec.scaling.loss_scale import LossScaleConfig, format_scale

__all__ = ["CalibrationReport", "LayerCalibration", "calibrate"]

MARGIN = 8.0  # initial_scale keeps the largest gradient times the scale 8x under 65504
# Values in a float16 layer must stay 4x under 65504: activations grow as training goes on
# (a residual stream that just passed 65504 in one block passes it in the block before a few
# steps later), so a set chosen at the limit would need a repair again and again.
HEADROOM = 4.0
KERAS_START = LossScaleConfig.initial_scale  # 2^15, Keras's and tfmixprec's default start


# ------------------------------------------------------------------ one replay
@dataclasses.dataclass(frozen=True)
class _Call:
    """One leaf layer call: its output's largest finite |x|, non-finite count, count past
    float16's range and size; whether its inputs held a NaN/Inf."""

    layer: Any
    dtype: str
    max_abs: float
    bad: int
    past: int
    size: int
    bad_inputs: bool
    input_max: float
    out_dtype: str  # the narrowest dtype of its outputs (a float16 layer may return float32)
    # Its NaN/Inf are the float32 replay's too, whose loss and gradients are finite: on
    # purpose (a `-inf` key mask before a softmax), not an overflow (`Replayer.run`).
    on_purpose: bool = False

    @property
    def overflows(self) -> bool:
        """Not finite, and not on purpose."""
        return bool(self.bad) and not self.on_purpose

    @property
    def risky(self) -> bool:
        """Overflows, or within `HEADROOM` of its outputs' dtype's largest value."""
        return self.overflows or self.max_abs > _near(self.out_dtype)

    @property
    def risky_inputs(self) -> bool:
        return self.bad_inputs or self.input_max > _near(self.dtype)


def _near(dtype: str) -> float:
    """The largest |x| a layer computing in `dtype` may hold, with `HEADROOM`."""
    return DTYPE_MAX.get(dtype, math.inf) / HEADROOM


@dataclasses.dataclass(frozen=True)
class _Run:
    calls: tuple[_Call, ...]
    loss: float
    grads: tuple[Any, ...]

    @property
    def first_bad(self) -> int | None:
        """The first call that is not finite or comes within `HEADROOM` of its range."""
        return next((i for i, call in enumerate(self.calls) if call.risky), None)

    @property
    def grads_finite(self) -> bool:
        return all(g is None or bool(np.isfinite(float_array(g)).all()) for g in self.grads)

    @property
    def sound(self) -> bool:
        """Whether the loss and the gradients are finite (of a float32 replay: its NaN/Inf
        values are on purpose)."""
        return math.isfinite(self.loss) and self.grads_finite


def _on_purpose(run: _Run, reference: _Run) -> _Run:
    """`run`, its calls' NaN/Inf that `reference` (the batch in float32, `sound`) has too
    marked on purpose, inputs and outputs: a value not finite in float32 as well that leaves
    the loss and gradients finite is not the overflow."""
    if not reference.sound or len(reference.calls) != len(run.calls):
        return run
    calls = [
        dataclasses.replace(
            call,
            on_purpose=0 < call.bad <= ref.bad,
            bad_inputs=call.bad_inputs and not ref.bad_inputs,
        )
        if call.layer is ref.layer and (call.bad or call.bad_inputs)
        else call
        for call, ref in zip(run.calls, reference.calls)
    ]
    return dataclasses.replace(run, calls=tuple(calls))


def _call(layer: Any, args: tuple, result: Any) -> _Call:
    out = float_arrays(result)
    finite = [np.abs(a[np.isfinite(a)]) for a in out]
    biggest = max((float(f.max()) for f in finite if f.size), default=0.0)
    bad = sum(int((~np.isfinite(a)).sum()) for a in out)
    past = sum(int((np.abs(a) > FLOAT16_MAX).sum()) for a in out)
    size = sum(a.size for a in out)
    inputs = float_arrays(args)
    bad_inputs = any(not np.isfinite(a).all() for a in inputs)
    input_max = max((float(np.abs(a).max()) for a in inputs if a.size), default=0.0)
    dtypes = {_dtype_name(item) for item in keras.tree.flatten(result) if item is not None}
    narrowest = min(dtypes, key=lambda name: DTYPE_MAX.get(name, math.inf), default="float32")
    return _Call(
        layer, layer.compute_dtype, biggest, bad, past, size, bad_inputs, input_max, narrowest
    )


def _dtype_name(value: Any) -> str:
    dtype = getattr(value, "dtype", None)
    return tf.as_dtype(dtype).name if dtype is not None else "float32"


class Replayer:
    """Replays `batches` of `model` with `loss_fn` (`replay.replay`, in `training` mode: the
    step's, `replay.TRAINING`, by default): forward and backward of the loss times a scale,
    with chosen layers (or all: `in_float32`) in float32."""

    def __init__(
        self,
        model: keras.Model,
        batches: Sequence[tuple],
        loss_fn: Callable,
        training: bool = TRAINING,
    ) -> None:
        self.model, self.batches, self.loss_fn = model, list(batches), loss_fn
        self.training = check_bool("training", training)
        # Each layer's own compute dtype (a replay swaps some to float32), for the messages.
        self.dtypes = {id(layer): layer.compute_dtype for layer in all_layers(model)}
        self._float32: dict[int, tuple[_Run, ...]] = {}

    def run(
        self,
        batch: tuple,
        scale: float,
        float32: Sequence[Any] = (),
        plain: bool = False,
        loss_fn: Callable | None = None,
        judged: bool = True,
    ) -> _Run:
        """One replay with `float32` in float32 (`float32_swapped`; `plain`: float8 layers
        without their quantization too), float8 layers differentiated eagerly; with
        `loss_fn` in place of the replayer's loss when given. `judged`: NaN/Inf that the
        batch's replay in float32 has too, finite loss and gradients there, are on purpose
        (`_on_purpose`), for a batch of the replayer's."""
        calls: list[_Call] = []
        record = lambda layer, args, result: calls.append(_call(layer, args, result))  # noqa: E731
        loss_fn = self.loss_fn if loss_fn is None else loss_fn
        with float32_swapped(list(float32), plain):
            done = replay(self.model, batch, loss_fn, scale, record, training=self.training)
        run = _Run(tuple(calls), done.loss, done.grads)
        index = next((i for i, mine in enumerate(self.batches) if mine is batch), None)
        if not judged or index is None or not any(c.bad or c.bad_inputs for c in run.calls):
            return run
        return _on_purpose(run, self.in_float32(index))

    def forget(self) -> None:
        """Drops the float32 replays kept (`in_float32`): the loss changed."""
        self._float32.clear()

    def all_runs(self, scale: float, float32: Sequence[Any] = ()) -> list[_Run]:
        return [self.run(batch, scale, float32) for batch in self.batches]

    def in_float32(self, index: int) -> _Run:
        """Batch `index` with every layer in float32, float8 ones without their quantization,
        at scale 1 (kept: asked often)."""
        if index not in self._float32:
            everything = all_layers(self.model)
            run = self.run(self.batches[index], 1.0, everything, True, judged=False)
            self._float32[index] = (run,)
        return self._float32[index][0]

    def finite_at(self, scale: float, float32: Sequence[Any]) -> bool:
        """Whether every batch is finite forward and backward at `scale` (False where the
        model's call fails with `float32` in float32, see `runs_with`)."""
        if not self.runs_with(float32):
            return False
        return all(
            run.first_bad is None and run.grads_finite and math.isfinite(run.loss * scale)
            for run in self.all_runs(scale, float32)
        )

    def runs_with(self, float32: Sequence[Any]) -> bool:
        """Whether the model's call runs with `float32` in float32: a layer's call that adds
        a sublayer's output to a tensor of its own (`x + residual` in a Transformer block)
        fails when one is float32 and the other float16 (TensorFlow does not promote)."""
        try:
            self.run(self.batches[0], 1.0, float32)
        except (tf.errors.OpError, TypeError, ValueError):
            return False
        return True


def float32_policy(layer: Any) -> Any:
    """The policy that makes `layer` compute in float32: `float32`, and for a float8 layer
    `float8_from_float32`, which keeps its quantization. A plain policy would stop its float8
    quantization but leave its float8 variables on it (Keras removes none): trained no more,
    and missing from a model loaded from its saved file, whose optimizer state then no
    longer fits (tfmixprec's refuses it)."""
    if is_float8(layer):
        return keras.dtype_policies.get("float8_from_float32")
    return keras.DTypePolicy("float32")


@contextlib.contextmanager
def float32_swapped(layers: Sequence[Any], plain: bool = False) -> Iterator[None]:
    """Within the block, `layers` compute in float32 (`float32_policy`; with `plain`, float8
    layers without their quantization too); their own policies are back after it."""
    float8 = [] if plain else [layer for layer in layers if is_float8(layer)]
    others = [layer for layer in layers if not any(layer is f for f in float8)]
    with policies_swapped(others, "float32"):
        with policies_swapped(float8, keras.dtype_policies.get("float8_from_float32")):
            yield


def move_to_float32(model: keras.Model, layers: Sequence[Any]) -> bool:
    """Makes each of `layers` compute in float32 (`float32_policy`: a float8 layer keeps its
    quantization) and drops `model`'s traced functions; returns whether the model's saved
    config records the change (see `policy.compute_in_float32`)."""
    return compute_in_float32(model, layers, float32_policy)


# ------------------------------------------------------------------ the float32 set
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
    every one of its batches to run finite forward and backward (unscaled); see the module's
    docstring. Changes no state."""
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


def _loss_fix(replayer: Replayer, index: int, run: _Run, chosen: list[Any]) -> Any:
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


def _forward_fix(replayer: Replayer, index: int, run: _Run, chosen: list[Any]) -> Any:
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
    largest, near = reference.calls[bad].max_abs, _near(call.dtype)
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


def _backward_fix(replayer: Replayer, index: int, run: _Run, chosen: list[Any]) -> Any:
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


# ------------------------------------------------------------------ the report
@dataclasses.dataclass(frozen=True)
class LayerCalibration:
    """One leaf layer over the calibration batches.

    Attributes:
        layer: String. The layer's path in the model.
        compute_dtype: String. The dtype it computes in, as the model is.
        max_abs: Float. The largest finite |x| of its outputs in that dtype.
        nonfinite: Int. NaN/Inf values in its outputs in that dtype.
        float32_max_abs: Float. The largest |x| of its outputs with the model in float32.
        past_float16: Float. Share of those float32 outputs past float16's 65504.
        gradient_max: Float. The largest |gradient| of its variables (float32, unscaled; 0
            without variables).
        gradient_underflow: Float. Share of its gradient values that are not zero but fall
            below float16's smallest subnormal, 2^-24, once multiplied by `initial_scale`.
    """

    layer: str
    compute_dtype: str
    max_abs: float
    nonfinite: int
    float32_max_abs: float
    past_float16: float
    gradient_max: float
    gradient_underflow: float


@dataclasses.dataclass(frozen=True)
class CalibrationReport:
    """What `calibrate` found: the scale to start at, the layers to compute in float32, and
    the numbers behind them. `print` it, or `to_dict()` / `to_markdown()`.

    Attributes:
        initial_scale: Float. The largest power of two that keeps the largest gradient times
            the scale `MARGIN` (8) times under 65504 (the mixed-precision paper's rule), and
            verified finite on the batches with `float32_layers` applied. 1 for a model
            without a float16 layer (bfloat16 and float32 need no loss scale).
        float32_layers: Tuple of strings. The layers that must compute in float32, named by
            the layers they are nested in (`reasons` says why, one each). Empty when nothing
            overflows or comes within the 4x headroom (`HEADROOM`).
        reasons: Tuple of strings. Why each of `float32_layers` is there.
        cause: String. The first overflow found (`"none"`, `"forward-overflow"`,
            `"near-overflow"`: within the 4x headroom only, `"backward-overflow"`), or what no
            float32 layer fixes (`"bad-data"`, `"not-precision"`, explained by `problem`;
            `float32_layers` is then empty).
        problem: String or None. What neither the layers nor the scale can fix.
        gradient_max: Float. The largest |gradient| over the batches (float32, unscaled) of a
            layer that computes in float16 once `float32_layers` compute in float32.
        start_skips: Int or None. Steps a start at `initial_scale` skips on these batches
            (halvings until finite; None: not finite even at 1).
        keras_start_skips: Int or None. The same for a start at 2^15, Keras's default.
        batches: Int. The batches replayed.
        layers: Tuple of `LayerCalibration`, one per leaf layer in the order they ran.
        float32_loss: String or None. Why the loss must compute in float32 (cause
            `"loss-overflow"`: a `keras.losses.Loss` built with a float16 or bfloat16 dtype
            that overflows by itself; `apply` sets the compiled loss's dtype), or None.
    """

    initial_scale: float
    float32_layers: tuple[str, ...]
    reasons: tuple[str, ...]
    cause: str
    problem: str | None
    gradient_max: float
    start_skips: int | None
    keras_start_skips: int | None
    batches: int
    layers: tuple[LayerCalibration, ...]
    float32_loss: str | None = None

    def apply(self, model: keras.Model, set_scale: bool = True) -> list[PolicyChange]:
        """Makes `float32_layers` of `model` compute in float32 (and its compiled loss, where
        `float32_loss` says so) and starts its optimizer's loss scale at `initial_scale`.
        Everything is checked before anything changes.

        Args:
            model: `keras.Model`. The model calibrated (its layers are found by path).
            set_scale: Bool. Also start the optimizer's loss scale at `initial_scale` (a
                tfmixprec or Keras `LossScaleOptimizer` that has not taken a step yet).

        Returns:
            List of `PolicyChange(layer, old, new, why)`: one per layer changed, one named
            `"loss"` for the compiled loss's dtype, and one named `"loss_scale"` for the
            optimizer's starting scale.

        Raises:
            ValueError: If a layer of the report is not in `model`, the report computes the
                loss in float32 and the model's compiled loss is no `keras.losses.Loss`, or
                `set_scale` is True and the optimizer has taken steps already.
        """
        check_bool("set_scale", set_scale)
        layers = self._layers_of(model)
        loss = self._loss_of(model)
        restart = _scale_setter(model, self.initial_scale) if set_scale else None
        changes = [
            PolicyChange(path, layer.dtype_policy.name, float32_policy(layer).name, why)
            for (path, why), layer in zip(zip(self.float32_layers, self.reasons), layers)
            if layer.compute_dtype != "float32"
        ]
        recorded = move_to_float32(model, layers) if changes else True
        mark_float32(model, {c.layer: f"calibrate: {c.why}" for c in changes})
        if loss is not None and loss_dtype(loss) != "float32":
            changes.append(PolicyChange("loss", loss_dtype(loss), "float32", self.float32_loss))
            set_loss_dtype(loss, "float32")
            forget_traced_functions(model)
        if restart is not None:
            changes.append(restart())
        if not recorded:  # last: a warning turned error leaves nothing half-done
            warn_not_recorded(model, "calibrate", self.float32_layers)
        return changes

    def _loss_of(self, model: keras.Model) -> Any:
        """The compiled loss whose dtype `apply` sets (None: the report leaves the loss)."""
        if self.float32_loss is None:
            return None
        loss = getattr(model, "loss", None)
        if loss_dtype(loss) is None:
            raise ValueError(
                f"apply computes the loss in float32, but model {model.name!r} is compiled "
                f"with loss={loss!r}, which has no dtype of its own to set. Compile it with "
                "a keras.losses.Loss built with dtype='float32'."
            )
        return loss

    def _layers_of(self, model: keras.Model) -> list[Any]:
        keys = layer_names(model)
        found = {keys[id(layer)]: layer for layer in all_layers(model)}
        missing = [path for path in self.float32_layers if path not in found]
        if missing:
            raise ValueError(
                f"apply found no layer {missing[0]!r} in model {model.name!r}: the report is "
                "of another model. Call calibrate(model, data) on this model, then apply it."
            )
        return [found[path] for path in self.float32_layers]

    def to_dict(self) -> dict[str, Any]:
        """The report as plain Python values (JSON-ready: `inf`/`nan` as strings)."""
        return jsonable(dataclasses.asdict(self))

    def write_summary(self, log_dir: str, step: int = 0) -> None:
        """Writes the report (`to_markdown()`) as a `mixed_precision/calibration` text into
        `log_dir/train`, the run `tfmixprec.TensorBoard(log_dir)` writes: TensorBoard's Text
        tab shows it next to the training that follows.

        Args:
            log_dir: String. The TensorBoard log directory.
            step: Int. The step to show it at (0: before the first step).
        """
        writer = tf.summary.create_file_writer(os.path.join(log_dir, "train"))
        with writer.as_default(), tf.summary.record_if(True):
            tf.summary.text("mixed_precision/calibration", self.to_markdown(), step=step)
        writer.close()

    def to_markdown(self) -> str:
        """The verdict and a markdown table of the layers (for TensorBoard and issues)."""
        rows = [
            (
                f"`{r.layer}`",
                r.compute_dtype,
                f"{r.max_abs:.4g}",
                r.nonfinite,
                f"{r.float32_max_abs:.4g}",
                f"{r.past_float16:.2%}",
                f"{r.gradient_max:.3g}",
                f"{r.gradient_underflow:.2%}",
            )
            for r in self.layers
        ]
        header = ("layer", "dtype", "max |x|", "NaN/Inf", "max |x| float32", "past 65504")
        table = markdown_table((*header, "max |grad|", "grad underflow"), rows)
        return "\n".join([*str(self).splitlines(), "", *table])

    def __str__(self) -> str:
        lines = [f"initial_scale: {format_scale(self.initial_scale)} ({self._skips_line()})"]
        if self.float32_layers:
            lines.append(f"float32_layers ({self.cause}):")
            lines += [f"  {p}: {why}" for p, why in zip(self.float32_layers, self.reasons)]
        else:
            none = " (nothing overflows in these batches)" if self.cause == "none" else ""
            lines.append(f"float32_layers: none{none}")
        if self.float32_loss is not None:
            lines.append(f"float32_loss: {self.float32_loss}")
        if self.problem is not None:
            lines.append(f"not fixed by float32 layers ({self.cause}): {self.problem}")
        return "\n".join(lines)

    def _skips_line(self) -> str:
        def skips(count: int | None) -> str:
            return "no finite scale" if count is None else f"{count} skipped"

        return (
            f"largest gradient {self.gradient_max:.3g}; steps skipped at the start on "
            f"{self.batches} batches: {skips(self.start_skips)}, from Keras's "
            f"{format_scale(KERAS_START)}: {skips(self.keras_start_skips)}"
        )


def _scale_setter(model: keras.Model, scale: float) -> Callable[[], PolicyChange] | None:
    """Checks that `model`'s optimizer can start at `scale`; returns the change to make (None:
    no loss-scaling optimizer)."""
    optimizer = getattr(model, "optimizer", None)
    if not hasattr(optimizer, "inner_optimizer"):
        return None
    reader = getattr(optimizer, "read_state", None)  # tfmixprec's counts skipped steps too
    steps = reader()["step"] if reader is not None else int(np.asarray(optimizer.iterations))
    if steps:
        raise ValueError(
            f"apply starts the loss scale before the first step, but the optimizer of model "
            f"{model.name!r} has taken {steps} steps. Pass set_scale=False to change the "
            "layers only."
        )
    config = getattr(optimizer, "loss_scale_config", None)
    if config is not None:  # the config's own checks, before anything changes
        try:
            dataclasses.replace(config, initial_scale=scale)
        except ValueError as err:
            raise ValueError(
                f"apply would start the loss scale at {format_scale(scale)}, outside the "
                f"optimizer's [min_scale, max_scale] = [{config.min_scale:g}, "
                f"{config.max_scale:g}]: calibrate the model with this optimizer (its bounds "
                f"are read then), or pass set_scale=False. ({err})"
            ) from err
    old = _current_scale(optimizer)

    def change() -> PolicyChange:
        _start_scale(optimizer, scale)
        why = f"the largest gradient times it stays {MARGIN:g}x under float16's 65504"
        return PolicyChange("loss_scale", format_scale(old), format_scale(scale), why)

    return change


def _current_scale(optimizer: Any) -> float:
    """The loss scale of a tfmixprec or Keras `LossScaleOptimizer` (Keras's before `build`:
    its `initial_scale`)."""
    if hasattr(optimizer, "loss_scale_config"):
        return float(np.asarray(optimizer.loss_scale))
    variable = getattr(optimizer, "dynamic_scale", None)
    return float(np.asarray(variable)) if variable is not None else float(optimizer.initial_scale)


def _start_scale(optimizer: Any, scale: float) -> None:
    if hasattr(optimizer, "loss_scale_config"):
        optimizer.start_at(scale)
    elif getattr(optimizer, "dynamic_scale", None) is not None:  # Keras's, built
        optimizer.dynamic_scale.assign(scale)
    else:  # Keras's, before `build`: read by `build`
        optimizer.initial_scale = scale


def warn_not_recorded(model: keras.Model, who: str, names: Sequence[str]) -> None:
    """Warns that `model`'s config does not record the float32 layers `who` set."""
    warnings.warn(
        f"{who} set {', '.join(repr(n) for n in names)} of model {model.name!r} to float32, "
        "but its config does not record layer dtypes, so a saved and reloaded model computes "
        f"them in the policy's dtype again (calibrate and apply again after loading). "
        f"{docs_page('guides/repair')}",
        UserWarning,
        stacklevel=3,
    )


# ------------------------------------------------------------------ calibrate
def calibration_batches(data: Any, steps: int, batch_size: int) -> list[tuple]:
    """The first `steps` batches of `data` as `(x, y, sample_weight)`: a `tf.data.Dataset` of
    batches, or arrays `(x, y)` / `(x, y, sample_weight)` cut into `batch_size` rows."""
    if isinstance(data, tf.data.Dataset):
        batches = [keras.utils.unpack_x_y_sample_weight(item) for item in data.take(steps)]
    elif isinstance(data, (tuple, list)) and len(data) in (2, 3):
        parts = (*data, None)[:3]  # x may be a dict or list of arrays, as fit takes
        lengths = [len(a) for p in parts if p is not None for a in keras.tree.flatten(p)]
        if len(set(lengths)) > 1:
            raise ValueError(
                "data's arrays must have the same number of rows (x, y and sample_weight, as "
                f"fit takes). Received: arrays of {sorted(set(lengths))} rows"
            )
        rows = lengths[0]

        def rows_of(start: int) -> tuple:
            cut = lambda a: np.asarray(a)[start : start + batch_size]  # noqa: E731
            return tuple(None if p is None else keras.tree.map_structure(cut, p) for p in parts)

        batches = [rows_of(start) for start in range(0, min(rows, steps * batch_size), batch_size)]
    elif isinstance(data, (tuple, list)):
        raise ValueError(
            "data must be (x, y) or (x, y, sample_weight): calibrate replays the loss, so it "
            f"needs the labels. Received: a {type(data).__name__} of {len(data)} items"
        )
    else:
        raise TypeError(
            "data must be a tf.data.Dataset of batches or arrays (x, y) / (x, y, "
            f"sample_weight), as fit takes. Received: data of type {type(data).__name__}"
        )
    batches = [tuple(batch) + (None,) * (3 - len(batch)) for batch in batches]
    if not batches or any(batch[1] is None for batch in batches):
        raise ValueError(
            "data must hold at least one batch with labels: calibrate replays the loss. "
            f"Received: {len(batches)} batches" + (", without labels" if batches else "")
        )
    return batches


def calibrate(
    model: keras.Model,
    data: Any,
    steps: int = 8,
    batch_size: int = 32,
    loss_fn: Callable[..., Any] | None = None,
) -> CalibrationReport:
    """Replays a few batches before the first step: the loss scale to start at, and the
    smallest set of layers that must compute in float32 so that no value overflows.

    Runs each batch forward (training mode, the state put back) and backward outside the
    step, in the model's dtypes and in float32; changes no weight, optimizer slot, statistic
    or loss scale. See the module's docstring for how the set is found and the 4x headroom
    it keeps; `report.apply(model)` makes the change.

    Args:
        model: A built `keras.Model` (compiled, unless `loss_fn` is given).
        data: A `tf.data.Dataset` of batches `(x, y[, sample_weight])`, or arrays `(x, y)` /
            `(x, y, sample_weight)`, as `fit` takes.
        steps: Int >= 1. How many batches to replay.
        batch_size: Int >= 1. Rows per batch when `data` is arrays.
        loss_fn: A `keras.losses.Loss`, a callable `(y_true, y_pred)`, or None for the
            compiled loss.

    Returns:
        A `CalibrationReport`.

    Raises:
        TypeError: If `model` is not a `keras.Model` or `data` is neither a dataset nor
            arrays.
        ValueError: If the model is not built, has no single compiled loss and no `loss_fn`,
            `data` holds no batch with labels, or `steps` / `batch_size` is not an int >= 1.

    Example:

    >>> report = tfmixprec.calibrate(model, (x, y), steps=2)
    >>> report.float32_layers
    ()
    """
    check_built_model(model, "calibrate")
    steps = check_int_at_least_one("steps", steps)
    batch_size = check_int_at_least_one("batch_size", batch_size)
    loss_fn = loss_fn if loss_fn is not None else compiled_loss(model, "calibrate")
    batches = calibration_batches(data, steps, batch_size)
    replayer = Replayer(model, batches, loss_fn)
    found = float32_set(replayer)
    layers = [layer for layer, _ in found.layers]
    # Bad data, or a model whose own code no float32 layer lets run: nothing to replay.
    unrunnable = found.cause == "bad-data" or (found.cause == "model-code" and found.problem)
    reference = [] if unrunnable else [replayer.in_float32(i) for i in range(len(batches))]
    gradient_max = _float16_gradient_max(model, reference, layers)
    if unrunnable or not computes_in(model, "float16"):
        scale, skips, keras_skips = 1.0, 0, 0
    else:
        scale = starting_scale(replayer, layers, gradient_max)
        skips = _skips(replayer, layers, scale)
        keras_skips = _skips(replayer, layers, KERAS_START)
    return CalibrationReport(
        initial_scale=scale,
        float32_layers=tuple(layer_names(model)[id(layer)] for layer in layers),
        reasons=tuple(why for _, why in found.layers),
        cause=found.cause,
        problem=found.problem,
        gradient_max=gradient_max,
        start_skips=skips,
        keras_start_skips=keras_skips,
        batches=len(batches),
        layers=tuple(_layer_rows(replayer, reference, scale, layers)) if reference else (),
        float32_loss=found.loss,
    )


def _float16_gradient_max(model: keras.Model, runs: list[_Run], float32: list[Any]) -> float:
    """The largest |gradient| (float32 replays, unscaled) of a variable whose layer computes
    in float16 once `float32` compute in float32: only those meet float16's range."""
    taken = {id(layer) for layer in float32}
    largest = 0.0
    for key, grads in _grads_by_layer(model, runs).items():
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
        gradient_max = _float16_gradient_max(model, runs, layers)
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


def _skips(replayer: Replayer, layers: list[Any], start: float) -> int | None:
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


def _layer_rows(
    replayer: Replayer, reference: list[_Run], scale: float, layers: list[Any]
) -> list[LayerCalibration]:
    """One row a leaf layer: its outputs as the model is (with `layers` in float32 where the
    model's own code cannot run as it is: `clash.DtypeClash`) and in float32, its gradients."""
    model = replayer.model
    try:
        as_is = replayer.all_runs(1.0)
    except DtypeClashError:
        try:  # the model's own code mixes dtypes: as the float32 layers let it run, if any
            as_is = replayer.all_runs(1.0, layers)
        except DtypeClashError:
            return []
    outputs: dict[int, list] = {}
    for run, run32 in zip(as_is, reference):
        for call, call32 in zip(run.calls, run32.calls):
            row = outputs.setdefault(id(call.layer), [call.layer, call.dtype, 0.0, 0, 0.0, 0, 0])
            row[2], row[3] = max(row[2], call.max_abs), row[3] + call.bad
            row[4] = max(row[4], call32.max_abs if not call32.bad else math.inf)
            row[5], row[6] = row[5] + call32.past + call32.bad, row[6] + call32.size
    grads = _grads_by_layer(model, reference)
    keys = layer_names(model)
    rows = []
    for layer, dtype, biggest, bad, biggest32, past, size in outputs.values():
        mine = grads.get(id(layer), [])
        underflow = gradient_range_stats([g * scale for g in mine]).underflow_fraction
        largest = max((float(np.abs(g).max()) for g in mine if g.size), default=0.0)
        share = past / size if size else 0.0
        rows.append(
            LayerCalibration(
                keys[id(layer)], dtype, biggest, bad, biggest32, share, largest, underflow
            )
        )
    return rows


def _grads_by_layer(model: keras.Model, runs: list[_Run]) -> dict[int, list[np.ndarray]]:
    owners = variable_owners(model)
    per_layer: dict[int, list[np.ndarray]] = {}
    for run in runs:
        for variable, grad in zip(model.trainable_variables, run.grads):
            if grad is not None and id(variable) in owners:
                per_layer.setdefault(id(owners[id(variable)]), []).append(float_array(grad))
    return per_layer
