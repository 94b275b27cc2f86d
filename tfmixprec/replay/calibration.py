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

This module holds `calibrate` and the batches it replays; the replays are `replayer`'s, the
search (the float32 set, the starting scale) `calibration_search`'s, and the report
`calibration_report`'s. Their names are importable from here too, as before they were split.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._common.layers import (
    check_built_model,
    compiled_loss,
    layer_names,
)
from tfmixprec._common.validate import check_int_at_least_one
from tfmixprec.replay.calibration_report import CalibrationReport, LayerCalibration
from tfmixprec.replay.calibration_search import (
    KERAS_START,
    float16_gradient_max,
    float32_set,
    grads_by_layer,
    skipped_steps,
    starting_scale,
)
from tfmixprec.replay.calibration_search import MARGIN as MARGIN
from tfmixprec.replay.calibration_search import Float32Set as Float32Set
from tfmixprec.replay.clash import DtypeClashError
from tfmixprec.replay.engine import computes_in
from tfmixprec.replay.replayer import HEADROOM as HEADROOM
from tfmixprec.replay.replayer import Replayer, ReplayRun
from tfmixprec.replay.replayer import float32_policy as float32_policy
from tfmixprec.replay.replayer import float32_swapped as float32_swapped
from tfmixprec.replay.replayer import move_to_float32 as move_to_float32
from tfmixprec.replay.replayer import warn_not_recorded as warn_not_recorded
from tfmixprec.scaling.gradient_range import gradient_range_stats

__all__ = ["calibrate"]  # and CalibrationReport, LayerCalibration (calibration_report)


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
    gradient_max = float16_gradient_max(model, reference, layers)
    if unrunnable or not computes_in(model, "float16"):
        scale, skips, keras_skips = 1.0, 0, 0
    else:
        scale = starting_scale(replayer, layers, gradient_max)
        skips = skipped_steps(replayer, layers, scale)
        keras_skips = skipped_steps(replayer, layers, KERAS_START)
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


def _layer_rows(
    replayer: Replayer, reference: list[ReplayRun], scale: float, layers: list[Any]
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
    grads = grads_by_layer(model, reference)
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
