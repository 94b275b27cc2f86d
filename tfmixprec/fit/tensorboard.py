"""TensorBoard summaries of the loss scale and overflow events, and the dashboard layout."""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import summary as custom_scalar_summary

from tfmixprec._keras.fit import (
    tensorboard_batch_work,
    tensorboard_log_dir,
    tensorboard_step,
    tensorboard_writer,
)
from tfmixprec.fit.float8_monitor import Float8Reader
from tfmixprec.fit.gradient_monitor import GradientRangeMonitor
from tfmixprec.fit.hooks import Diagnoser
from tfmixprec.fit.reader import FitReader
from tfmixprec.fit.repair import repairs_of
from tfmixprec.precision.float8 import Float8TensorStats, float8_stats
from tfmixprec.replay.diagnosis import OverflowDiagnosis
from tfmixprec.scaling.attribution import OverflowReport, overflow_report
from tfmixprec.scaling.loss_scale import LOG_KEYS

__all__ = ["TensorBoard", "dashboard_layout"]  # what the package exports

PREFIX = "mixed_precision"
LAYOUT_TITLE = "Mixed precision"
TAGS = {
    "loss_scale": f"{PREFIX}/loss_scale",
    "log2_loss_scale": f"{PREFIX}/log2_loss_scale",
    "overflow": f"{PREFIX}/overflow",
    "overflow_steps": f"{PREFIX}/overflow_steps",
    "grad_underflow_fraction": f"{PREFIX}/grad_underflow_fraction",
    "grad_subnormal_fraction": f"{PREFIX}/grad_subnormal_fraction",
    "grad_log2_abs": f"{PREFIX}/grad_log2_abs",
    "layer_overflow_steps": f"{PREFIX}/layer_overflow_steps",  # + "/<layer>"
    "overflow_report": f"{PREFIX}/overflow_report",  # text
    "diagnosis": f"{PREFIX}/diagnosis",  # text
    "repairs": f"{PREFIX}/repairs",  # text, at each PrecisionRepair repair's step
    "repaired_layers": f"{PREFIX}/repaired_layers",  # layers moved to float32, in all
    "float8": f"{PREFIX}/float8",  # + "/<layer>/<tensor>/<stat>", see FLOAT8_STATS
}
# What is written per float8 layer and quantized tensor (inputs, kernel, outputs_grad), each
# over the interval since the last write, and the title of the chart each goes to (None: not
# charted; the scale and the amax are charted as log2, where the three tensors' scales, which
# lie orders of magnitude apart, can be told apart).
FLOAT8_STATS = {
    "saturated_fraction": "saturated (fraction)",
    "underflow_fraction": "zero once quantized (fraction)",
    "flushed_fraction": "non-zero values flushed to zero (fraction)",
    "log2_scale": "scale (log2)",
    "log2_amax": "amax (log2)",
    "scale": None,
    "amax": None,
}
FLOAT8_TITLE = f"{LAYOUT_TITLE}: float8"
LAYERS_TITLE = f"{LAYOUT_TITLE}: overflow steps per layer (total)"  # one chart a layer


def _exact(title: str, tag: str) -> layout_pb2.Chart:
    """A chart of `tag` (an exact name) drawn as written: a margin chart whose margins are the
    value itself. TensorBoard's Custom Scalars tab smooths multiline charts (0.6 by default,
    which turns each step of the loss scale or of a count into a curve) but never a margin
    chart: its smoothing setting is not passed to them."""
    series = layout_pb2.MarginChartContent.Series(value=tag, lower=tag, upper=tag)
    return layout_pb2.Chart(title=title, margin=layout_pb2.MarginChartContent(series=[series]))


def _shown_in_order(charts: list[layout_pb2.Chart]) -> list[layout_pb2.Chart]:
    """`charts` (all margin charts) as the layout must list them for TensorBoard to show them
    in this order: its Custom Scalars tab stacks a category's margin charts last first."""
    return charts[::-1]


def dashboard_layout(
    *,
    per_batch: bool = True,
    loss_scale: bool = True,
    gradient_range: bool = True,
    layers: Sequence[str] = (),
    repairs: bool = False,
    float8_layers: Sequence[str] = (),
) -> layout_pb2.Layout:
    """The custom-scalars layout: loss next to loss scale, overflow events, gradient range.

    Every chart shows one tag as written, never smoothed (a margin chart, which TensorBoard
    does not smooth), one line a run: its title says what it is. The flags leave out the
    charts of tags a run does not write: `tfmixprec.TensorBoard` writes the layout at train
    begin with what it will write, and again with `layers` when a layer overflows for the
    first time.

    Shown in this order (the layout lists each category's charts last first, the order
    TensorBoard stacks margin charts in): category "Mixed precision": "Loss (per batch)"
    (`per_batch`; else "Loss (per epoch)" first), "Loss scale (log2)", "Overflow events
    (skipped steps)" (`loss_scale`), "Loss (per epoch)", "Overflow steps (total)"
    (`loss_scale`), "Gradients below float16's range (fraction)", "Gradients in float16's
    subnormal range (fraction)" (`gradient_range`); with `layers`, category "Mixed precision:
    overflow steps per layer (total)": one chart a layer, titled with its name; with
    `float8_layers`, category "Mixed precision: float8": per layer, one chart a statistic
    ("<layer>: saturated (fraction)", ..., "<layer>: amax (log2)", see `FLOAT8_STATS`), a
    line per quantized tensor.

    Args:
        per_batch: Bool. Whether the run writes per-batch summaries (`update_freq` not
            `"epoch"`): the per-batch loss chart.
        loss_scale: Bool. Whether the model has loss scaling: the loss-scale and overflow
            charts.
        gradient_range: Bool. Whether a `GradientRangeMonitor` is driven: its two charts.
        layers: Sequence of layer names. A chart of `mixed_precision/layer_overflow_steps/<layer>`
            each, in this order.
        repairs: Bool. Whether `PrecisionRepair` repaired the run: a chart "Layers moved to
            float32 by PrecisionRepair (total)" last in "Mixed precision".
        float8_layers: Sequence of layer paths. The model's float8 layers: their charts of
            `mixed_precision/float8/<layer>/<tensor>/<statistic>`.

    Returns:
        A `tensorboard.plugins.custom_scalar.layout_pb2.Layout`.
    """
    loss = {
        "batch": _exact("Loss (per batch)", "batch_loss"),
        "epoch": _exact("Loss (per epoch)", "epoch_loss"),
    }
    charts = [loss["batch" if per_batch else "epoch"]]
    if loss_scale:
        charts.append(_exact("Loss scale (log2)", TAGS["log2_loss_scale"]))
        charts.append(_exact("Overflow events (skipped steps)", TAGS["overflow"]))
    if per_batch:
        charts.append(loss["epoch"])
    if loss_scale:
        charts.append(_exact("Overflow steps (total)", TAGS["overflow_steps"]))
    if gradient_range:
        charts.append(
            _exact("Gradients below float16's range (fraction)", TAGS["grad_underflow_fraction"])
        )
        charts.append(
            _exact(
                "Gradients in float16's subnormal range (fraction)",
                TAGS["grad_subnormal_fraction"],
            )
        )
    if repairs:
        title = "Layers moved to float32 by PrecisionRepair (total)"
        charts.append(_exact(title, TAGS["repaired_layers"]))
    return layout_pb2.Layout(category=_categories(charts, layers, float8_layers))


def _categories(
    charts: list[layout_pb2.Chart], layers: Sequence[str], float8_layers: Sequence[str]
) -> list[layout_pb2.Category]:
    """The layout's categories: "Mixed precision" (`charts`), then the per-layer overflow
    charts and the float8 charts when there are any."""
    categories = [layout_pb2.Category(title=LAYOUT_TITLE, chart=_shown_in_order(charts))]
    if layers:
        per_layer = [_exact(layer, f"{TAGS['layer_overflow_steps']}/{layer}") for layer in layers]
        categories.append(layout_pb2.Category(title=LAYERS_TITLE, chart=_shown_in_order(per_layer)))
    if float8_layers:
        float8 = _float8_charts(float8_layers)
        categories.append(layout_pb2.Category(title=FLOAT8_TITLE, chart=float8))
    return categories


def _float8_charts(layers: Sequence[str]) -> list[layout_pb2.Chart]:
    """Per float8 layer, one chart a statistic, with a line per quantized tensor (the tags
    matched by a regular expression: TensorBoard smooths these, unlike the margin charts)."""
    charts = []
    for layer in layers:
        for stat, title in FLOAT8_STATS.items():
            if title is None:
                continue
            tags = f"^{re.escape(TAGS['float8'])}/{re.escape(layer)}/[a-z_]+/{stat}$"
            lines = layout_pb2.MultilineChartContent(tag=[tags])
            charts.append(layout_pb2.Chart(title=f"{layer}: {title}", multiline=lines))
    return charts


def _write_float8(board: TensorBoard, step: int) -> None:
    """Writes what float8 quantization did to each float8 layer since the last write."""
    if not board._float8_layers:
        return
    stats = board._float8.read()
    with tensorboard_writer(board).as_default(), tf.summary.record_if(True):
        for layer in stats:
            for name, tensor in layer.tensors().items():
                for stat, value in _float8_values(tensor).items():
                    tag = f"{TAGS['float8']}/{layer.layer}/{name}/{stat}"
                    tf.summary.scalar(tag, value, step=step)


def _float8_values(tensor: Float8TensorStats) -> dict[str, float]:
    """The `FLOAT8_STATS` of one quantized tensor that have a value (a fraction of no values
    counted, or the log2 of a zero amax, is not written)."""
    values = {stat: getattr(tensor, stat, None) for stat in FLOAT8_STATS}
    values["log2_scale"] = math.log2(tensor.scale) if tensor.scale > 0 else None
    values["log2_amax"] = math.log2(tensor.amax) if tensor.amax > 0 else None
    return {k: v for k, v in values.items() if v is not None and math.isfinite(v)}


def _profile_batch_value(profile_batch: int | str | Sequence[int]) -> int | list[int]:
    """`profile_batch` (already checked by Keras) as an int or a `[start, stop]` list, the
    form that survives a JSON round trip ("2,5" and (2, 5) both give [2, 5])."""
    if isinstance(profile_batch, str):
        profile_batch = profile_batch.split(",")
    if isinstance(profile_batch, (tuple, list)):
        return [int(value) for value in profile_batch]
    return profile_batch


def _writes_summaries(model: Any) -> bool:
    """Whether this process writes summaries for `model`: False only on a worker of a
    multi-worker strategy that is not the chief (`extended.should_save_summary`)."""
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is None:
        return True
    try:
        return bool(strategy.extended.should_save_summary)
    except NotImplementedError:  # a strategy that does not say: every process writes
        return True


def _without_loss_scale(logs: dict | None) -> dict | None:
    """The logs for Keras's own writer: without the loss-scale values, which this callback
    writes under `mixed_precision/` (else each would appear twice, e.g. `batch_loss_scale`)."""
    if logs is None:
        return None
    return {key: value for key, value in logs.items() if key not in LOG_KEYS}


def _write_layout(board: TensorBoard, step: int, report: OverflowReport | None = None) -> None:
    """Writes `board`'s dashboard layout at `step` (TensorBoard shows a run's last one): the
    charts of what it writes, and one for each layer that has overflowed. With the `report`
    of an interval with overflows: only if it names a layer that has no chart yet."""
    if report is not None:
        layers = [row.layer for row in report.layers]
        if set(layers) <= set(board._charted_layers):
            return
        board._charted_layers = layers + [n for n in board._charted_layers if n not in layers]
    layout = dashboard_layout(
        per_batch=board.update_freq != "epoch",
        loss_scale=board._reader.optimizer is not None,
        gradient_range=board.gradient_monitor is not None,
        layers=board._charted_layers,
        repairs=bool(board._repairs_written),
        float8_layers=board._float8_layers,
    )
    with tensorboard_writer(board).as_default(), tf.summary.record_if(True):
        summary = custom_scalar_summary.pb(layout)
        tf.summary.experimental.write_raw_pb(summary.SerializeToString(), step=step)


class _ChiefWrites(keras.callbacks.TensorBoard):
    """`keras.callbacks.TensorBoard` that writes on the chief only under a multi-worker
    strategy: another worker's run folders are a temporary folder, removed when it is done."""

    _worker_dir: str | None = None  # where a worker other than the chief writes
    _in_fit = False

    def set_model(self, model: Any) -> None:
        self._drop_worker_dir()  # left by an `evaluate`, `predict` or `fit` that did not end
        self._in_fit = False
        if not _writes_summaries(model):  # a worker other than the chief
            self._worker_dir = tempfile.mkdtemp(prefix="tfmixprec-tb-worker-")
        with tensorboard_log_dir(self, self._worker_dir):
            super().set_model(model)

    def _drop_worker_dir(self) -> None:
        if self._worker_dir is not None:
            shutil.rmtree(self._worker_dir, ignore_errors=True)
            self._worker_dir = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        super().on_train_begin(logs)
        self._in_fit = True

    def on_train_end(self, logs: dict | None = None) -> None:
        super().on_train_end(logs)  # closes the writers
        self._in_fit = False
        self._drop_worker_dir()

    def on_test_end(self, logs: dict | None = None) -> None:
        super().on_test_end(logs)
        if not self._in_fit:  # a plain `evaluate`: Keras leaves its writer open, unused
            self._drop_worker_dir()

    def on_predict_end(self, logs: dict | None = None) -> None:
        super().on_predict_end(logs)
        if not self._in_fit:
            self._drop_worker_dir()


def _check_arguments(log_dir: Any, gradient_monitor: Any, update_freq: Any) -> None:
    """Raises for a `TensorBoard` argument Keras's callback would take and fail on later."""
    if not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(
            "log_dir must be the path of the folder to write to (a string or os.PathLike, "
            f"e.g. 'logs'). Received: log_dir={log_dir!r} of type {type(log_dir).__name__}"
        )
    if gradient_monitor is not None and not isinstance(gradient_monitor, GradientRangeMonitor):
        raise TypeError(
            "gradient_monitor must be a tfmixprec.GradientRangeMonitor. Received: "
            f"gradient_monitor of type {type(gradient_monitor).__name__}"
        )
    if update_freq not in ("epoch", "batch") and (
        isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1
    ):
        raise ValueError(
            'update_freq must be "epoch", "batch" or an integer >= 1. '
            f"Received: update_freq={update_freq!r}"
        )


@keras.saving.register_keras_serializable(package="tfmixprec")
class TensorBoard(_ChiefWrites):
    """`keras.callbacks.TensorBoard` plus loss-scale and overflow summaries.

    Everything Keras's callback writes is still written, except the loss-scale values of the
    logs, which are written once, here, under `mixed_precision/`. At each write (every
    `update_freq` steps, or at epoch end with `update_freq="epoch"`): `loss_scale`,
    `log2_loss_scale`, `overflow_steps` (total); after an interval with overflows, `overflow`
    (their number, never written as 0, so TensorBoard's outlier setting cannot hide one),
    `layer_overflow_steps/<layer>` and an `overflow_report` text; with a
    `GradientRangeMonitor`, the gradient-range fractions and a log2|g| histogram. It also
    writes the "Mixed precision" custom-scalars layout. Batches where it does not write cost
    no host sync; the step axis is the global batch (the epoch with `"epoch"`).

    Under a multi-worker strategy only the chief writes (every worker may pass the same
    `log_dir`). `get_config()` holds every argument of Keras's callback but
    `gradient_monitor` (it holds a data batch): pass it again to a restored callback.

    Args:
        log_dir: String or `os.PathLike`. The folder to write to, as for Keras's callback.
        gradient_monitor: `GradientRangeMonitor`. Driven by this callback (it calls
            `gradient_monitor.drive_from(self)`): this callback steps it once per batch and
            writes its measurements; passing it to `fit` as well does not measure twice.
        diagnose: Int >= 0. Overflow steps per `fit` whose batch is replayed with
            `tfmixprec.explain_overflow` and written as a `mixed_precision/diagnosis` text at
            its step (any model with loss scaling, with XLA or without; 0: none).
        **kwargs: Any other argument of `keras.callbacks.TensorBoard` (`update_freq`,
            `histogram_freq`, `profile_batch`, ...).

    Raises:
        TypeError: If `log_dir` is not a path (a string or `os.PathLike`) or
            `gradient_monitor` is not a `GradientRangeMonitor`.
        ValueError: If `update_freq` is not `"epoch"`, `"batch"` or an integer >= 1,
            `diagnose` is not an integer >= 0, or
            `gradient_monitor` is already driven by another callback.

    Example:

    >>> tb = tfmixprec.TensorBoard("runs/exp1", update_freq=50)
    >>> model.fit(x, y, callbacks=[tb])  # then: tensorboard --logdir runs
    """

    def __init__(
        self,
        log_dir: str | os.PathLike = "logs",
        gradient_monitor: GradientRangeMonitor | None = None,
        diagnose: int = 0,
        **kwargs: Any,
    ) -> None:
        diagnoser = Diagnoser(diagnose, "tfmixprec.TensorBoard")  # checks it first
        update_freq = kwargs.get("update_freq", "epoch")
        _check_arguments(log_dir, gradient_monitor, update_freq)
        super().__init__(log_dir=log_dir, **kwargs)
        # Keras keeps only the parsed range (privately): keep the argument, for get_config.
        self.profile_batch = _profile_batch_value(kwargs.get("profile_batch", 0))
        self.gradient_monitor = gradient_monitor
        if gradient_monitor is not None:
            gradient_monitor.drive_from(self)
        every = 1 if update_freq in ("epoch", "batch") else update_freq
        self._reader = FitReader("tfmixprec.TensorBoard", every)
        self._grad_measured_at: int | None = None
        self._epoch = 0
        self._diagnosis_writer: tuple[str, Any] | None = None  # (its directory, the writer)
        self._repairs_written = 0
        self.diagnose = diagnose
        self._diagnoser = diagnoser
        self._charted_layers: list[str] = []  # the layers with a chart in the layout
        self._float8 = Float8Reader()
        self._float8_layers: list[str] = []  # the model's float8 layers

    def get_config(self) -> dict[str, Any]:
        """Every argument of `keras.callbacks.TensorBoard`, as this callback holds it.

        Returns:
            Dict with `log_dir`, `histogram_freq`, `write_graph`, `write_images`,
            `write_steps_per_second`, `update_freq` (`"batch"` is held as 1),
            `profile_batch` (a pair as a list), `embeddings_freq`, `embeddings_metadata` and
            `diagnose`. `gradient_monitor` is not in it (not serializable: it holds a data batch).
        """
        return {
            "log_dir": self.log_dir,
            "histogram_freq": self.histogram_freq,
            "write_graph": self.write_graph,
            "write_images": self.write_images,
            "write_steps_per_second": self.write_steps_per_second,
            "update_freq": self.update_freq,
            "profile_batch": self.profile_batch,
            "embeddings_freq": self.embeddings_freq,
            "embeddings_metadata": self.embeddings_metadata,
            "diagnose": self.diagnose,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TensorBoard:
        return cls(**config)

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self._reader.set_model(model)
        if self.gradient_monitor is not None:
            self.gradient_monitor.set_model(model)

    def on_train_begin(self, logs: dict | None = None) -> None:
        opt = self._reader.train_begin()
        self._repairs_written = len(repairs_of(self.model))  # earlier fits' are written
        super().on_train_begin(logs)
        self._float8.start(self.model)
        self._float8_layers = [s.layer for s in float8_stats(self.model)]
        self._diagnoser.start(self, opt)
        if self.gradient_monitor is not None:
            self.gradient_monitor.on_train_begin(logs)
        _write_layout(self, step=0)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._diagnoser.stop(self.model)
        _write_repairs(self)
        if self.update_freq != "epoch":  # overflows after the last write: written now
            self._write(tensorboard_step(self), only_new_overflows=True)
        super().on_train_end(logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if tensorboard_batch_work(self):
            super().on_train_batch_end(batch, _without_loss_scale(logs))
        # else: with update_freq="epoch", Keras's callback would only issue per-batch
        # summaries that its writer discards (about 0.1 ms each, every batch): skipped.
        for _, diagnosis in self._diagnoser.new(self.model):
            self.write_diagnosis(diagnosis, _current_step(self))
        _write_repairs(self)
        measured = False
        if self.gradient_monitor is not None:
            logs = logs if isinstance(logs, dict) else None
            measured = self.gradient_monitor.step(logs, batch)
        if self.update_freq != "epoch" and self._reader.due(batch):
            self._write(tensorboard_step(self))
        elif measured and self.update_freq != "epoch":
            self._write_gradients(tensorboard_step(self))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_begin(epoch, logs)
        self._reader.epoch_begin()
        self._epoch = epoch
        if self.gradient_monitor is not None:
            self.gradient_monitor.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._reader.epoch_end(logs)
        super().on_epoch_end(epoch, _without_loss_scale(logs))
        if self.update_freq == "epoch":
            self._write(epoch)

    def _write(self, step: int, only_new_overflows: bool = False) -> None:
        """Writes the loss-scale values at `step`, and the overflows since the last write
        (`only_new_overflows`: nothing unless there were some)."""
        if not only_new_overflows:
            _write_float8(self, step)
        if self._reader.optimizer is None:  # no loss scaling: only the gradient range
            self._write_gradients(step)
            return
        state, before = self._reader.read()
        total = state["overflow_steps"]
        events = float(total - before["overflow_steps"])  # overflows in this interval
        if only_new_overflows and not events:
            return
        with tensorboard_writer(self).as_default(), tf.summary.record_if(True):
            tf.summary.scalar(TAGS["loss_scale"], state["loss_scale"], step=step)
            tf.summary.scalar(TAGS["log2_loss_scale"], math.log2(state["loss_scale"]), step=step)
            tf.summary.scalar(TAGS["overflow_steps"], float(total), step=step)
            if events:
                # Written only here, never as 0: a chart of events alone is never clipped
                # by TensorBoard's "ignore outliers" (on by default), which hides rare 1s.
                tf.summary.scalar(TAGS["overflow"], events, step=step)
                report = overflow_report(self.model)
                for row in report.layers:
                    tag = f"{TAGS['layer_overflow_steps']}/{row.layer}"
                    tf.summary.scalar(tag, float(row.overflow_steps), step=step)
                tf.summary.text(TAGS["overflow_report"], report.to_markdown(), step=step)
                _write_layout(self, step, report)  # if a layer has no chart yet
        self._write_gradients(step)

    def write_diagnosis(self, diagnosis: OverflowDiagnosis, step: int | None = None) -> None:
        """Writes an `explain_overflow` result as a text summary (its markdown table) under
        `mixed_precision/diagnosis`, so TensorBoard's Text tab shows it at its step.

        Args:
            diagnosis: `OverflowDiagnosis`. What `tfmixprec.explain_overflow` returned.
            step: Int or None. The step to show it at; None: the global batch the callback
                is at (the epoch with `update_freq="epoch"`).

        Raises:
            TypeError: If `diagnosis` is not an `OverflowDiagnosis`.
        """
        if not isinstance(diagnosis, OverflowDiagnosis):
            raise TypeError(
                "diagnosis must be what tfmixprec.explain_overflow returned (an "
                f"OverflowDiagnosis). Received: diagnosis of type {type(diagnosis).__name__}"
            )
        if self.model is not None and not _writes_summaries(self.model):
            return  # a worker other than the chief: the chief writes its own diagnosis
        if step is None:
            step = _current_step(self)
        # Its own writer into the run's train directory: Keras closes its writers when
        # training ends, and a diagnosis usually comes after an overflow, often after `fit`.
        # One writer (one event file) for all of this callback's diagnoses: event files
        # opened in the same second sort by a per-process counter as text ("...10.v2" before
        # "...9.v2"), so a new file per diagnosis could be read back out of order.
        _write_text(self, TAGS["diagnosis"], diagnosis.to_markdown(), step)

    def _write_gradients(self, step: int) -> None:
        monitor = self.gradient_monitor
        if monitor is None or monitor.weight_stats is None:
            return
        if self._grad_measured_at == monitor.last_step:
            return  # already written
        self._grad_measured_at = monitor.last_step
        stats = monitor.weight_stats
        with tensorboard_writer(self).as_default(), tf.summary.record_if(True):
            tf.summary.scalar(TAGS["grad_underflow_fraction"], stats.underflow_fraction, step=step)
            tf.summary.scalar(TAGS["grad_subnormal_fraction"], stats.subnormal_fraction, step=step)
            if stats.log2_abs.size:
                tf.summary.histogram(
                    TAGS["grad_log2_abs"], np.asarray(stats.log2_abs), step=step, buckets=60
                )
            for name, layer_stats in monitor.activation_stats.items():
                tf.summary.scalar(
                    f"{PREFIX}/activation_grad_underflow_fraction/{name}",
                    layer_stats.underflow_fraction,
                    step=step,
                )
        tensorboard_writer(self).flush()


def _current_step(callback: TensorBoard) -> int:
    """The step a write goes to: the epoch with `update_freq="epoch"`, else Keras's global
    batch counter."""
    if callback.update_freq == "epoch":
        return callback._epoch
    return tensorboard_step(callback)


def _write_repairs(board: TensorBoard) -> None:
    """Each `PrecisionRepair` repair made since the last call, as a text at its step (a
    host-side list: nothing read from the device)."""
    repairs = repairs_of(board.model)
    if len(repairs) == board._repairs_written or not _writes_summaries(board.model):
        return  # nothing new (every batch: a tuple's length, nothing more)
    new = repairs[board._repairs_written :]
    for done, repair in enumerate(new, start=board._repairs_written + 1):
        _write_text(board, TAGS["repairs"], repair.to_markdown(), repair.step)
        moved = float(sum(len(r.layers) for r in repairs[:done]))
        _write_text(board, TAGS["repaired_layers"], moved, repair.step)
    charted = bool(board._repairs_written)
    board._repairs_written = len(repairs)
    if new and not charted:
        _write_layout(board, new[0].step)


def _write_text(board: TensorBoard, tag: str, text: str | float, step: int) -> None:
    """A text (or, for a number, a scalar) summary into the run's train directory, through the
    callback's own writer (Keras's are closed when training ends)."""
    log_dir = os.path.join(board.log_dir, "train")
    if board._diagnosis_writer is None or board._diagnosis_writer[0] != log_dir:
        board._diagnosis_writer = (log_dir, tf.summary.create_file_writer(log_dir))
    writer = board._diagnosis_writer[1]
    with writer.as_default(), tf.summary.record_if(True):
        if isinstance(text, str):
            tf.summary.text(tag, text, step=step)
        else:
            tf.summary.scalar(tag, text, step=step)
    writer.flush()
