"""Why a step overflowed: replay one batch outside the training step and name the cause.

`explain_overflow(model, batch)` runs the batch again (`tfmixprec.replay`), in training mode as
the step runs it (`replay.TRAINING`, the mode `calibrate` and `PrecisionRepair` replay in too:
batch normalization on the batch's statistics, dropout on), with the model's state put back,
and changes no weight, statistic, optimizer slot or loss scale. It looks, in this order, for:

- `bad-data`: NaN/Inf already in the inputs, labels or sample weights;
- `model-code`: the model's call fails because its own code mixes dtypes (a tensor cast to
  float32 by hand times one computed in float16: `clash.DtypeClash`), named with the layer,
  the operation and the line; no value overflowed, and `calibrate` finds the layers whose
  float32 makes the call run;
- `forward-overflow`: the first layer (in the order the forward pass runs them) whose output
  is not finite although its inputs are: its activations exceed the compute dtype's range
  (65504 for float16). A second replay in float32 says how large they are and whether the
  layer would be finite in float32 or bfloat16. NaN/Inf that the float32 replay holds too,
  where its loss and gradients are finite, are on purpose (a `-inf` key mask before a
  softmax) and passed over. Where the layer's output is in range in float32 and a value
  inside it underflowed to 0 before a log or a division (`log(softmax(x))`: log(0) is
  -inf), the message names that underflow and its fix (`log_softmax`, or float32);
- `loss-overflow`: the predictions are finite but the loss, or the loss times the scale, is not;
- `backward-overflow`: everything forward is finite but some gradients of the scaled loss are
  not; the replay halves the scale until they are (k halvings: the dynamic scale finds that
  level by itself, nothing to fix) and names the first layer whose gradients overflowed;
- `underflow`: nothing overflows, but a large share of the scaled gradients (measured in
  float32) is below float16's smallest subnormal, 2^-24, and would flush to zero (a model
  with a float16 layer only: bfloat16 and float32 keep such values);
- `none`: the batch replays finite at this scale with little underflow.

Where the step overflows, the float8 layers (`tfmixprec.float8_layers`) whose quantization
saturated or flushed values in the replay are named too, with the format, the scale each
tensor was quantized with, its amax and the shares (`OverflowDiagnosis.float8`).

`tfmixprec.fit.overflow_batches` keeps the batches of overflow steps on the device, from inside
the training step (`MixedPrecisionModel.keep_overflow_batches`, and the callbacks'
`diagnose=` switch), so they can be replayed right after the step.

This module holds the replay and the verdict; the report's types and text are
`diagnosis_report`'s, importable from here too, as before they were split.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._common.arrays import float_arrays, nonfinite_count
from tfmixprec._common.dtypes import DTYPE_MAX, FLOAT32_MAX
from tfmixprec._common.layers import (
    all_layers,
    check_built_model,
    compiled_loss,
    layer_names,
    variable_owners,
)
from tfmixprec._common.observe import policies_swapped
from tfmixprec._common.validate import check_float32_scale
from tfmixprec._keras.losses import loss_dtype
from tfmixprec._keras.op_watch import first_nonfinite_op
from tfmixprec.precision import float8_recipe
from tfmixprec.precision.float8 import gradient_watched, is_float8
from tfmixprec.precision.float8_recipe import (
    Float8Tensor,
    Float8TensorStats,
    quantization_counts,
)
from tfmixprec.replay.clash import DtypeClash, DtypeClashError
from tfmixprec.replay.diagnosis_report import CAUSES as CAUSES
from tfmixprec.replay.diagnosis_report import Float8Quantized as Float8Quantized
from tfmixprec.replay.diagnosis_report import Float8Replay, LayerReplay, OverflowDiagnosis
from tfmixprec.replay.engine import bad_data, computes_in, replay, underflow_to_zero
from tfmixprec.scaling.gradient_range import gradient_range_stats
from tfmixprec.scaling.loss_scale import format_scale

__all__ = ["explain_overflow"]  # and the report types (diagnosis_report)


UNDERFLOW_SHARE = 0.01  # at least this share of gradients flushing to zero is worth a word
_MAX_HALVINGS = 40


def _all_finite(value: Any) -> bool:
    return nonfinite_count(value) == 0


def _output_stats(result: Any) -> tuple[float, int, int]:
    arrays = float_arrays(result)
    nan = sum(int(np.isnan(a).sum()) for a in arrays)
    inf = sum(int(np.isinf(a).sum()) for a in arrays)
    finite = [np.abs(a[np.isfinite(a)]) for a in arrays]
    biggest = max((float(f.max()) for f in finite if f.size), default=0.0)
    return biggest, nan, inf


class _Float8Counts:
    """A replay's float8 layers: per layer and quantized tensor, `quantization_counts` summed
    over its calls, and the largest |x|."""

    def __init__(self) -> None:
        self.layers: dict[int, Any] = {}
        self.counts: dict[tuple[int, str], Float8TensorStats] = {}

    def forward(self, layer: Any, inputs: Any) -> None:
        self.add(layer, "inputs", inputs)
        self.add(layer, "kernel", keras.ops.cast(layer.kernel, layer.compute_dtype))

    def output(self, layer: Any, x: Any) -> Any:
        return gradient_watched(x, lambda upstream: self.add(layer, "outputs_grad", upstream))

    def add(self, layer: Any, name: str, x: Any) -> None:
        tensor = float8_recipe.RECIPE.tensor(name)
        scale = tf.convert_to_tensor(getattr(layer, tensor.scale))
        counts = quantization_counts(x, scale, tensor.format).numpy().tolist()
        x = tf.cast(x, tf.float32)
        amax = float(tf.reduce_max(tf.abs(x))) if counts[0] else 0.0  # as its history sees it
        self.layers.setdefault(id(layer), layer)
        total = self.counts.setdefault((id(layer), name), _empty(tensor, float(scale)))
        amax = math.nan if math.isnan(amax) or math.isnan(total.amax) else max(amax, total.amax)
        values, saturated, zero, flushed = counts
        self.counts[id(layer), name] = dataclasses.replace(
            total,
            amax=amax,
            values=total.values + values,
            saturated=total.saturated + saturated,
            zero=total.zero + zero,
            flushed=total.flushed + flushed,
        )

    def records(self, names: dict[int, str]) -> tuple[Float8Replay, ...]:
        """The layers whose quantization saturated or flushed a value, in forward order, named
        by `names` (`replay.layer_names`)."""
        found = []
        for key, layer in self.layers.items():
            tensors = {  # no gradient reached its output: nothing quantized there
                t.name: self.counts.get((key, t.name)) or _empty(t, _value(getattr(layer, t.scale)))
                for t in float8_recipe.RECIPE.tensors
            }
            if any(t.saturated or t.flushed for t in tensors.values()):
                found.append(Float8Replay(names[key], layer.dtype_policy.name, **tensors))
        return tuple(found)


def _empty(tensor: Float8Tensor, scale: float) -> Float8TensorStats:
    """`tensor`'s statistics before anything was quantized at `scale`."""
    return Float8TensorStats(tensor.format, scale, 0.0, 0, 0, 0, 0)


def _value(variable: Any) -> float:
    return float(keras.ops.convert_to_numpy(variable))


@dataclasses.dataclass
class _Pass:
    """One replay: per layer call, (layer, compute dtype, output stats, input stats); the stats
    are (largest finite |x|, NaN count, Inf count); the float8 layers' quantization; how the
    report names each layer (`replay.layer_names`, short)."""

    calls: list[tuple[Any, str, tuple[float, int, int], tuple[float, int, int]]]
    y_pred: Any
    loss: float
    grads: list[Any]
    float8: _Float8Counts
    names: dict[int, str]


def _replay(model: keras.Model, data: tuple, loss_fn: Callable, scale: float) -> _Pass:
    """Forward (`replay.replay`, in the step's training mode, the state put back) and backward
    of the loss times `scale`, watching each layer (and what quantizing does to the tensors of
    float8 layers)."""
    calls: list[tuple[Any, str, tuple[float, int, int], tuple[float, int, int]]] = []
    float8 = _Float8Counts()

    def record(layer: Any, args: tuple, result: Any) -> None:
        calls.append((layer, layer.compute_dtype, _output_stats(result), _output_stats(args)))

    def seen(layer: Any, args: tuple, result: Any) -> None:
        float8.forward(layer, args[0])

    done = replay(model, data, loss_fn, scale, record, (seen, float8.output))
    names = layer_names(model, short=True)
    return _Pass(calls, done.y_pred, done.loss, list(done.grads), float8, names)


def _in_float32(model: keras.Model, run: Callable[[], _Pass]) -> _Pass:
    """`run()` with every layer of `model` computing in float32; the policies restored after."""
    with policies_swapped(all_layers(model), "float32"):
        return run()


def _gradient_rows(model: keras.Model, grads: list[Any], grads32: list[Any]) -> dict[int, tuple]:
    """Per owning layer: (non-finite values at the scale, share of float32 values < 2^-24)."""
    owners = variable_owners(model)
    per_layer: dict[int, tuple[list, list]] = {}
    for variable, grad, grad32 in zip(model.trainable_variables, grads, grads32):
        layer = owners.get(id(variable))
        if layer is None or grad is None:
            continue
        mine = per_layer.setdefault(id(layer), ([], []))
        mine[0].append(grad)
        mine[1].append(grad32)
    rows = {}
    for key, (mine, mine32) in per_layer.items():
        bad = nonfinite_count(mine)
        rows[key] = (
            bad,
            gradient_range_stats([g for g in mine32 if g is not None]).underflow_fraction,
        )
    return rows


def _float32_max(stats: tuple[float, int, int], sound: bool = False) -> float:
    """A call's largest |x| in the float32 replay (`inf` when not finite even in float32);
    `sound` (the float32 replay's loss and gradients are finite): its largest finite |x|, its
    NaN/Inf being on purpose (see `_excess`)."""
    biggest, nan, inf = stats
    return math.inf if (nan or inf) and not sound else biggest


def _sound(run32: _Pass) -> bool:
    """Whether the float32 replay's loss and gradients are finite: then a value that is not
    finite there either is on purpose (a `-inf` key mask before a softmax), not an overflow."""
    return math.isfinite(run32.loss) and _all_finite(run32.grads)


def _excess(stats: tuple[float, int, int], stats32: tuple[float, int, int], sound: bool) -> int:
    """The NaN/Inf of a call's values (its outputs' or inputs' stats) that its float32 replay
    does not have too, where that replay is `sound`; else all of them."""
    bad = stats[1] + stats[2]
    return max(bad - stats32[1] - stats32[2], 0) if sound else bad


def _layer_rows(model: keras.Model, run: _Pass, run32: _Pass) -> list[LayerReplay]:
    """One row a layer, over all its calls (a layer called twice: the larger values, the
    NaN/Inf of both); the two replays call the layers in the same order."""
    grad_rows = _gradient_rows(model, run.grads, run32.grads)
    rows: dict[int, LayerReplay] = {}
    for (layer, dtype, (biggest, nan, inf), _), call32 in zip(run.calls, run32.calls):
        float32_max = _float32_max(call32[2])
        row = rows.get(id(layer))
        if row is None:
            bad, under = grad_rows.get(id(layer), (0, 0.0))
            rows[id(layer)] = LayerReplay(
                run.names[id(layer)], dtype, biggest, nan, inf, float32_max, bad, under
            )
        else:
            rows[id(layer)] = dataclasses.replace(
                row,
                max_abs=max(row.max_abs, biggest),
                nan=row.nan + nan,
                inf=row.inf + inf,
                float32_max_abs=max(row.float32_max_abs, float32_max),
            )
    return list(rows.values())


def _forward_advice(dtype: str, float32_max: float, float8: bool = False) -> str:
    """What the float32 replay says of a layer whose output overflowed in `dtype`."""
    limit = DTYPE_MAX.get(dtype, math.inf)
    fix = 'Run it in float32 (dtype="float32" on the layer), or use mixed_bfloat16'
    if float8:  # a plain float32 policy would drop its quantization, not its float8 variables
        fix = (
            "Run it in float32 and keep its float8 quantization (layer.dtype_policy = "
            '"float8_from_float32"), or use mixed_bfloat16'
        )
    if not math.isfinite(float32_max):
        return (
            "it is not finite even in float32: the weights or the model diverge, not the "
            "precision (lower the learning rate, check the initialization)."
        )
    if float32_max > limit:
        fits = [name for name in ("float32", "bfloat16") if float32_max <= DTYPE_MAX[name]]
        return (
            f"its outputs reach {float32_max:.4g} in float32, past {dtype}'s {limit:.6g}; it "
            f"would be finite in {' and '.join(fits)}. {fix}."
        )
    return (
        f"a value inside it passes {dtype}'s {limit:.6g} (attention logits or a long sum, "
        f"say), though its output is finite in float32 (max |x| {float32_max:.4g}). {fix} "
        "(float32's range)."
    )


# The guess above, which the first operation that was not finite (`_with_operation`)
# replaces where a constant too large for the dtype caused it.
_INSIDE_GUESS = re.compile(
    r"a value inside it passes \S+ \S+ \(attention logits or a long sum, say\)"
)


_FINITE_IN_FLOAT32 = re.compile(r"its output is finite in float32 \(max \|x\| [^)]+\)")


def _input_advice(dtype: str, input_max: float) -> str:
    """Why a layer's inputs were not finite although no layer before it made a NaN/Inf."""
    limit = DTYPE_MAX.get(dtype, math.inf)
    if input_max > limit:
        return (
            f"its inputs reach {input_max:.4g} in float32, past {dtype}'s {limit:.6g}, so they "
            f"are not finite by the time they reach it in {dtype} (the model's inputs cast to "
            f"{dtype}, or an operation before it that is not a layer). Normalize the inputs, "
            "or compute that part in float32."
        )
    return (
        f"its inputs are already not finite in {dtype} though no layer before it made a "
        "NaN/Inf: an operation between layers (keras.ops on a tensor, say) overflowed "
        f"(the inputs reach {input_max:.4g} in float32). Run that computation in float32."
    )


def _forward_source(run: _Pass, run32: _Pass) -> OverflowDiagnosis | None:
    """The first layer whose output is not finite although its inputs are; else the first
    layer whose output is not finite (its inputs overflowed before it, outside any layer).
    NaN/Inf that the float32 replay has too, where its loss and gradients are finite, are on
    purpose and count for neither (`_excess`)."""
    # Each call's own float32 replay decides (a layer may be called twice).
    sound = _sound(run32)
    bad = [
        (call, call32)
        for call, call32 in zip(run.calls, run32.calls)
        if _excess(call[2], call32[2], sound)
    ]
    for (layer, dtype, (_, nan, inf), inputs), call32 in bad:
        if not _excess(inputs, call32[3], sound):
            advice = _forward_advice(dtype, _float32_max(call32[2], sound), is_float8(layer))
            return _verdict(
                "forward-overflow",
                run.names[id(layer)],
                f"{nan + inf} NaN/Inf in its output; {advice}",
            )
    if bad:
        (layer, _, (_, nan, inf), _), call32 = bad[0]
        input_max = call32[3][0]
        low = next((c[1] for c in run.calls if c[1] != "float32"), "float32")
        advice = _input_advice(low, input_max)
        return _verdict(
            "forward-overflow", run.names[id(layer)], f"{nan + inf} NaN/Inf in its output; {advice}"
        )
    if not _all_finite(run.y_pred):
        return _verdict(
            "forward-overflow",
            None,
            "the predictions are not finite though every layer's output is: an operation "
            "after the layers (keras.ops on the outputs, say) overflowed. Run it in float32.",
        )
    return None


def _halvings(replay: Callable[[float], _Pass], scale: float) -> tuple[int | None, float | None]:
    """How many halvings of `scale` make every gradient finite (None: not even at 1)."""
    for k in range(1, _MAX_HALVINGS + 1):
        trial = scale / 2.0**k
        if trial < 1.0:
            break
        if _all_finite(replay(trial).grads):
            return k, trial
    return None, None


def _verdict(cause: str, layer: str | None, message: str) -> OverflowDiagnosis:
    """A diagnosis with only the verdict filled in (`explain_overflow` adds the numbers)."""
    return OverflowDiagnosis(cause, layer, message, 0.0, math.nan, math.nan, None, None, 0.0, ())


def _with_operation(
    verdict: OverflowDiagnosis, replay: Callable, scale: float
) -> OverflowDiagnosis:
    """A forward overflow that a constant of the model's own code caused, too large for the
    compute dtype (T5's mask bias of -1e9), or an underflow to 0 before a log or a division
    (`log(softmax(x))`, `engine.underflow_to_zero`): the verdict names the operation and its
    line (`_keras.op_watch`) in place of the guess. Values past the range keep their
    verdict."""
    if verdict.cause != "forward-overflow":
        return verdict
    found = first_nonfinite_op(lambda: replay(scale))
    guess = _INSIDE_GUESS.search(verdict.message)
    finite = _FINITE_IN_FLOAT32.search(verdict.message)
    underflow = underflow_to_zero(found, f"; {finite.group(0)}" if finite else "")
    if guess is not None and underflow is not None:
        return dataclasses.replace(verdict, message=verdict.message[: guess.start()] + underflow)
    if found is None or not found.constant:
        return verdict
    at = f" at {found.where}" if found.where else ""
    said = (
        f" The first {found.dtype} operation that is not finite is {found.operation}{at}: one "
        f"of its inputs is a constant too large for {found.dtype}, so it is the model's own "
        f"code, not {found.dtype}'s range of its values. Compute that layer in float32, or "
        f"use a constant {found.dtype} holds."
    )
    message = _INSIDE_GUESS.sub("a value inside it is not finite", verdict.message)
    return dataclasses.replace(verdict, message=message + said)


def _underflow(
    model: keras.Model, verdict: OverflowDiagnosis, underflow: float, scale: float
) -> OverflowDiagnosis:
    """`verdict`, or `underflow` where nothing overflows but a share of the gradients flushes
    to zero in float16."""
    if verdict.cause != "none" or underflow < UNDERFLOW_SHARE or not computes_in(model, "float16"):
        return verdict
    return _verdict(
        "underflow",
        None,
        f"{underflow:.1%} of the gradients times {format_scale(scale)} are below 2^-24 and "
        "flush to zero in float16; a larger loss scale (or dynamic scaling) keeps them.",
    )


def _model_code(model: keras.Model, clash: DtypeClash) -> OverflowDiagnosis:
    """The verdict on a call that fails because the model's own code mixes dtypes."""
    layer = None if clash.layer is None else layer_names(model, short=True)[id(clash.layer)]
    message = (
        f"{clash.describe()}: not a value out of range, the model's own code. Computing the "
        "layers around that operation in float32 may let it run (tfmixprec.calibrate(model, "
        "data) finds the fewest, or says none does), or cast the tensor in that code."
    )
    return _verdict("model-code", layer, message)


def _own_dtype_loss(verdict: OverflowDiagnosis, run: _Pass, loss_fn: Any) -> OverflowDiagnosis:
    """`verdict`, or where the loss is not finite and computes in float16 or bfloat16 by its
    own dtype (a `keras.losses.Loss` built so), a verdict that says so."""
    dtype = loss_dtype(loss_fn)
    if verdict.cause != "loss-overflow" or dtype not in ("float16", "bfloat16"):
        return verdict
    if math.isfinite(run.loss):
        return verdict  # the loss times the scale: the scale's
    message = (
        f"the predictions are finite but the loss is not ({run.loss:.6g}): it computes in "
        f"{dtype}, its own dtype (a keras.losses.Loss built with dtype={dtype!r}), and "
        "overflows by itself. Build it with dtype='float32' (calibrate and PrecisionRepair "
        "set it so)."
    )
    return _verdict("loss-overflow", None, message)


def _classify(
    run: _Pass, run32: _Pass, rows: list[LayerReplay], replay: Callable, scale: float
) -> OverflowDiagnosis:
    found = _forward_source(run, run32)
    if found is not None:
        return found
    scaled = run.loss * scale
    if not math.isfinite(run.loss) or not math.isfinite(scaled) or scaled > FLOAT32_MAX:
        what = (
            "the loss" if not math.isfinite(run.loss) else f"the loss times {format_scale(scale)}"
        )
        return _verdict(
            "loss-overflow",
            None,
            f"the predictions are finite but {what} is not ({run.loss:.6g}); compute the loss "
            "in float32 from float32 outputs (a float32 output layer), or check the labels.",
        )
    if not _all_finite(run.grads):
        layer = next((row.layer for row in rows if row.gradient_nonfinite), None)
        k, finite_scale = _halvings(replay, scale)
        if k is None:
            message = (
                "its gradients are not finite even unscaled: run it in float32 "
                '(dtype="float32" on the layer).'
            )
        else:
            message = (
                f"the gradients are finite at scale {format_scale(finite_scale)} ({k} halving"
                f"{'s' if k > 1 else ''} of {format_scale(scale)}): the dynamic loss scale "
                "finds this level by itself, nothing to fix."
            )
        verdict = _verdict("backward-overflow", layer, message)
        return dataclasses.replace(verdict, halvings=k, finite_scale=finite_scale)
    return _verdict("none", None, f"the batch is finite at scale {format_scale(scale)}.")


def _check_arguments(data: tuple, scale: Any, loss_fn: Any) -> None:
    if data[1] is None:
        raise ValueError(
            "batch must hold labels: explain_overflow replays the loss. Received: batch (x, None)"
        )
    if scale is not None:
        check_float32_scale("scale", scale)  # a finite, positive float32 number
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            "loss_fn must be a callable (y_true, y_pred) or a keras.losses.Loss, or None for "
            f"the compiled loss. Received: loss_fn={loss_fn!r}"
        )


def _scale_of(model: keras.Model, scale: float | None) -> float:
    if scale is not None:
        return float(scale)
    optimizer = getattr(model, "optimizer", None)
    reader = getattr(optimizer, "overflow_scale", None)
    if reader is not None:
        return reader()
    value = getattr(optimizer, "loss_scale", None) or getattr(optimizer, "dynamic_scale", None)
    return 1.0 if value is None else float(np.asarray(value))


def explain_overflow(
    model: keras.Model,
    batch: Sequence[Any],
    scale: float | None = None,
    loss_fn: Callable[..., Any] | None = None,
) -> OverflowDiagnosis:
    """Replays one batch and says why its step overflowed (or would), naming the layer.

    Runs the batch forward and backward once in the model's dtypes and once in float32,
    outside the training step, in training mode as the step runs it (batch normalization on
    the batch's statistics, dropout on: the mode `calibrate` and `PrecisionRepair` replay in),
    with the model's state put back: changes no weight, statistic, seed, optimizer slot or
    loss scale.

    Args:
        model: A built `keras.Model` (compiled, unless `loss_fn` is given).
        batch: Tuple `(x, y)` or `(x, y, sample_weight)`: the batch that overflowed.
        scale: Float or None. The loss scale to replay at; by default the scale of the last
            step if it overflowed (before the backoff), else the current scale (1 without a
            loss-scaling optimizer).
        loss_fn: A `keras.losses.Loss`, or a callable `(y_true, y_pred)` returning per-sample
            losses (weighted and averaged as Keras does), or None for the compiled loss.

    Returns:
        An `OverflowDiagnosis`: `cause`, `layer`, `message`, the numbers behind them, a
        per-layer table and, where the step overflows, the float8 layers whose quantization
        saturated or flushed values (`print` it, or `to_dict()` / `to_markdown()`).

    Raises:
        TypeError: If `model` is not a `keras.Model`.
        TypeError: If `loss_fn` is not callable.
        ValueError: If the model is not built, has no single compiled loss and no `loss_fn`
            is given, `batch` is not `(x, y)` / `(x, y, sample_weight)` with labels, or
            `scale` is not a number in float32's normal range.

    Example:

    >>> diagnosis = tfmixprec.explain_overflow(model, (x[:32], y[:32]))
    >>> diagnosis.cause
    'none'
    """
    check_built_model(model, "explain_overflow")
    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise ValueError(
            "batch must be a tuple (x, y) or (x, y, sample_weight). "
            f"Received: batch of type {type(batch).__name__}"
        )
    data = (batch[0], batch[1], batch[2] if len(batch) == 3 else None)
    _check_arguments(data, scale, loss_fn)
    loss_fn = loss_fn if loss_fn is not None else compiled_loss(model, "explain_overflow")
    scale = _scale_of(model, scale)
    bad = bad_data(data)
    if bad is not None:
        return dataclasses.replace(_verdict("bad-data", None, bad), loss_scale=scale)
    replay = lambda s: _replay(model, data, loss_fn, s)  # noqa: E731
    try:
        run = replay(scale)
    except DtypeClashError as err:
        return dataclasses.replace(_model_code(model, err.clash), loss_scale=scale)
    run32 = _in_float32(model, lambda: replay(scale))
    rows = _layer_rows(model, run, run32)
    verdict = _own_dtype_loss(_classify(run, run32, rows, replay, scale), run, loss_fn)
    underflow = gradient_range_stats([g for g in run32.grads if g is not None]).underflow_fraction
    verdict = _with_operation(_underflow(model, verdict, underflow, scale), replay, scale)
    return dataclasses.replace(
        _with_float8(verdict, run.float8.records(run.names)),
        loss_scale=scale,
        loss=run.loss,
        scaled_loss=run.loss * scale,
        underflow_fraction=underflow,
        layers=tuple(rows),
    )


_OVERFLOWS = ("forward-overflow", "loss-overflow", "backward-overflow")


def _with_float8(verdict: OverflowDiagnosis, records: tuple) -> OverflowDiagnosis:
    """Where the step overflows: the float8 layers whose quantization saturated or flushed
    values, named in the message with the scales they had."""
    if verdict.cause not in _OVERFLOWS or not records:
        return verdict
    named = ", ".join(repr(record.layer) for record in records)
    said = (
        f" In float8, {named} saturated or flushed values at the scales they had (below): "
        "delayed scaling sets those from the amax of earlier steps."
    )
    return dataclasses.replace(verdict, message=verdict.message + said, float8=records)
