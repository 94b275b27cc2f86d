"""`tfmixprec.TensorBoard`: the summaries of the loss scale, the overflows and the events of
a run (diagnoses, repairs, stops) that the "Mixed precision" tab shows, and the custom-scalars
layout (`fit/layout.py`) for a TensorBoard without the tab."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorboard.plugins.custom_scalar import summary as custom_scalar_summary

from _tfmixprec_board import names
from tfmixprec._common.validate import check_update_freq
from tfmixprec._keras.fit import (
    tensorboard_batch_work,
    tensorboard_log_dir,
    tensorboard_writer,
)
from tfmixprec.fit.board_events import diagnosis_event, repair_event, write_event
from tfmixprec.fit.float8_monitor import Float8Reader
from tfmixprec.fit.gradient_monitor import GradientRangeMonitor
from tfmixprec.fit.hooks import Diagnoser, stops_of
from tfmixprec.fit.layout import FLOAT8_STATS, PREFIX, TAGS, dashboard_layout
from tfmixprec.fit.reader import FitReader
from tfmixprec.fit.repair import repairs_of
from tfmixprec.precision.float8 import Float8TensorStats, float8_stats
from tfmixprec.replay.diagnosis import OverflowDiagnosis
from tfmixprec.scaling.attribution import OverflowReport, overflow_report
from tfmixprec.scaling.loss_scale import LOG_KEYS

__all__ = ["TensorBoard"]  # what the package exports


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
    check_update_freq(update_freq)


@keras.saving.register_keras_serializable(package="tfmixprec")
class TensorBoard(_ChiefWrites):
    """`keras.callbacks.TensorBoard` plus loss-scale and overflow summaries, and the events
    of TensorBoard's "Mixed precision" tab.

    Everything Keras's callback writes is still written, except the loss-scale values of the
    logs, which are written once, here, under `mixed_precision/`. At each write (every
    `update_freq` steps, or at epoch end with `update_freq="epoch"`): `loss_scale`,
    `log2_loss_scale`, `overflow_steps` (total) and `loss`; after an interval with overflows,
    `overflow` at each overflow step (how many steps it stands for: 1 where the step is known
    exactly; never written as 0, so TensorBoard's outlier setting cannot hide one),
    `layer_overflow_steps/<layer>` and an `overflow_report` text; with a
    `GradientRangeMonitor`, the gradient-range fractions and a log2|g| histogram. The "Mixed
    precision" tab's events (the fit's start, diagnoses, repairs, overflows at `min_scale`,
    `OverflowGuard` stops) and the "Mixed precision" custom-scalars layout too. Batches where
    it does not write cost no host sync; the step axis is the 0-based number of the step
    just taken, skipped steps counted, as in every tfmixprec message (the epoch with
    `"epoch"`).

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
        self._stops_written = 0
        # From Keras's logs, host numbers (never a device read): the overflow steps flagged
        # since the last write, and the last step's loss.
        self._flagged: list[int] = []
        self._loss: float | None = None
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
        opt = self._reader.train_begin(self.params)
        self._repairs_written = len(repairs_of(self.model))  # earlier fits' are written
        self._stops_written = len(stops_of(self.model))
        self._flagged, self._loss = [], None
        super().on_train_begin(logs)
        self._float8.start(self.model)
        self._float8_layers = [s.layer for s in float8_stats(self.model)]
        self._diagnoser.start(self, opt)
        if self.gradient_monitor is not None:
            self.gradient_monitor.on_train_begin(logs)
        _write_layout(self, step=0)
        _write_start(self, opt)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._diagnoser.stop(self.model)
        _write_repairs(self)
        if self.update_freq != "epoch":  # overflows after the last write: written now
            self._write(only_new_overflows=True)
        _write_stops(self)
        super().on_train_end(logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        due = self._reader.batch_end(batch, logs)  # first: the step's reads are keyed by it
        if tensorboard_batch_work(self):
            super().on_train_batch_end(batch, _without_loss_scale(logs))
        # else: with update_freq="epoch", Keras's callback would only issue per-batch
        # summaries that its writer discards (about 0.1 ms each, every batch): skipped.
        _note_step(self, logs)
        for step, diagnosis in self._diagnoser.new(self.model, self._reader):
            self.write_diagnosis(diagnosis, step)
        _write_repairs(self)
        measured = False
        if self.gradient_monitor is not None:
            logs = logs if isinstance(logs, dict) else None
            measured = self.gradient_monitor.step(logs, batch)
        if self.update_freq != "epoch" and due:
            self._write()
        elif measured and self.update_freq != "epoch":
            self._write_gradients(_step_now(self))

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
            self._loss = _host_number((logs or {}).get("loss"))
            self._write(epoch)

    def _write(self, epoch: int | None = None, only_new_overflows: bool = False) -> None:
        """Writes the loss-scale values and the overflows since the last write (with
        `only_new_overflows`: nothing unless there were some), at the step just taken (0-based,
        skipped steps counted) or at `epoch` with `update_freq="epoch"`."""
        if self._reader.optimizer is None:  # no loss scaling: the loss, float8, gradients
            if only_new_overflows:
                return
            step = _step_now(self) if epoch is None else epoch
            _write_float8(self, step)
            with tensorboard_writer(self).as_default(), tf.summary.record_if(True):
                _write_loss(self, step)
            self._write_gradients(step)
            return
        state, before = self._reader.read()
        step = state["step"] - 1 if epoch is None else epoch
        events = int(state["overflow_steps"] - before["overflow_steps"])  # in this interval
        if only_new_overflows and not events:
            return
        if not only_new_overflows:
            _write_float8(self, step)
        with tensorboard_writer(self).as_default(), tf.summary.record_if(True):
            _write_state(self, state, step)
            if events:
                _write_overflows(self, state, before, step, epoch is not None)
        _write_min_scale(self, state, before)
        self._write_gradients(step)

    def write_diagnosis(self, diagnosis: OverflowDiagnosis, step: int | None = None) -> None:
        """Writes an `explain_overflow` result at its step: a text summary (its markdown
        table) under `mixed_precision/diagnosis`, which TensorBoard's Text tab shows, and an
        event of the "Mixed precision" tab (cause, layer, value, message).

        Args:
            diagnosis: `OverflowDiagnosis`. What `tfmixprec.explain_overflow` returned.
            step: Int or None. The step to show it at (the overflow step replayed: 0-based,
                skipped steps counted); None: the last step taken (the epoch with
                `update_freq="epoch"`).

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
            step = self._epoch if self.update_freq == "epoch" else _step_now(self)
        _write_text(self, TAGS["diagnosis"], diagnosis.to_markdown(), step)
        write_event(_own_writer(self), names.DIAGNOSIS, step, diagnosis_event(diagnosis))

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


def _host_number(value: Any) -> float | None:
    """`value` if Keras's logs hold it as a host number (they do once Keras has read them,
    before any callback), else None: a tensor is never read here."""
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        return float(value)
    return None


def _note_step(board: TensorBoard, logs: dict | None) -> None:
    """From each batch's logs (host numbers Keras already read): the loss, and, where the
    step just taken overflowed (`overflow` is 1: a `MixedPrecisionModel`'s step logs it), its
    number (one read, on that step only), so that each overflow step is marked at its own
    step, not counted at the next write. Nothing is read on any other step."""
    logs = logs if isinstance(logs, dict) else {}
    board._loss = _host_number(logs.get("loss"))
    optimizer = board._reader.optimizer
    if board.update_freq != "epoch" and _host_number(logs.get("overflow")) and optimizer:
        board._flagged.append(board._reader.state()["last_overflow_step"])


def _step_now(board: TensorBoard) -> int:
    """The 0-based number of the step just taken, skipped steps counted (the step's shared
    read)."""
    optimizer = board._reader.optimizer
    if optimizer is not None:
        return board._reader.state()["step"] - 1
    return int(board.model.optimizer.iterations.numpy()) - 1


def _write_state(board: TensorBoard, state: dict[str, Any], step: int) -> None:
    """The loss scale, its log2, the overflow total and the loss at `step` (inside a
    writer's default)."""
    tf.summary.scalar(TAGS["loss_scale"], state["loss_scale"], step=step)
    tf.summary.scalar(TAGS["log2_loss_scale"], math.log2(state["loss_scale"]), step=step)
    tf.summary.scalar(TAGS["overflow_steps"], float(state["overflow_steps"]), step=step)
    _write_loss(board, step)


def _write_loss(board: TensorBoard, step: int) -> None:
    """The loss of the step just taken (from Keras's logs), where finite."""
    if board._loss is not None and math.isfinite(board._loss):
        tf.summary.scalar(TAGS["loss"], board._loss, step=step)


def _write_overflows(
    board: TensorBoard, state: dict[str, Any], before: dict[str, Any], step: int, epochs: bool
) -> None:
    """The overflows of the interval since `before` (inside a writer's default): a marker at
    each overflow step (`overflow`: how many steps it stands for; never 0), each layer's
    total, the overflow report's text, and a layout chart for a layer new to it."""
    events = int(state["overflow_steps"] - before["overflow_steps"])
    for at, count in _markers(board, state, before, events, step if epochs else None).items():
        tf.summary.scalar(TAGS["overflow"], float(count), step=at)
    report = overflow_report(board.model)
    for row in report.layers:
        tag = f"{TAGS['layer_overflow_steps']}/{row.layer}"
        tf.summary.scalar(tag, float(row.overflow_steps), step=step)
    tf.summary.text(TAGS["overflow_report"], report.to_markdown(), step=step)
    _write_layout(board, step, report)  # if a layer has no chart yet


def _markers(
    board: TensorBoard, state: dict, before: dict, events: int, epoch: int | None
) -> dict[int, int]:
    """`{step: overflow steps}` for the interval's `events` overflows: each step the logs
    flagged, and the rest (several steps run between two reads, e.g. with
    `steps_per_execution > 1`, where only the last one's number is known) counted at the
    last overflow step; with `update_freq="epoch"`, all at the `epoch`."""
    if epoch is not None:
        return {epoch: events}
    flagged = [s for s in board._flagged if before["step"] <= s < state["step"]][:events]
    board._flagged = []
    markers = {s: 1 for s in flagged}
    if events > len(flagged):
        last = state["last_overflow_step"]
        markers[last] = markers.get(last, 0) + events - len(flagged)
    return dict(sorted(markers.items()))


def _write_min_scale(board: TensorBoard, state: dict[str, Any], before: dict[str, Any]) -> None:
    """An event for overflow steps at `min_scale` in the interval: lowering the scale cannot
    help them."""
    count = state["min_scale_overflows"] - before["min_scale_overflows"]
    if count <= 0 or not _writes_summaries(board.model):
        return
    optimizer = board._reader.optimizer
    message = (
        f"{count} overflow step(s) at min_scale={optimizer.min_scale:g}, where lowering the "
        "loss scale cannot help: NaN/Inf in the inputs or labels, a learning rate that is too "
        "high, or a layer that must compute in float32."
    )
    payload = {"count": count, "min_scale": optimizer.min_scale, "message": message}
    write_event(tensorboard_writer(board), names.MIN_SCALE, state["last_overflow_step"], payload)


def _write_start(board: TensorBoard, optimizer: Any) -> None:
    """The event that starts a run's part of the tab (and makes the tab active): the step
    axis, the model's policy and its loss scaling."""
    if not _writes_summaries(board.model):
        return
    state = board._reader.last if optimizer is not None else None  # train_begin's read
    epochs = board.update_freq == "epoch"
    if epochs:
        step = board._epoch
    else:  # the next step's number
        step = state["step"] if state else int(board.model.optimizer.iterations.numpy())
    payload = {
        "axis": "epoch" if epochs else "step",
        "model": board.model.name,
        "policy": board.model.dtype_policy.name,
        "loss_scale": None if state is None else state["loss_scale"],
        "dynamic": None if optimizer is None else optimizer.dynamic,
        "update_freq": board.update_freq,
    }
    write_event(tensorboard_writer(board), names.START, step, payload)  # Keras's, open now


def _write_repairs(board: TensorBoard) -> None:
    """Each `PrecisionRepair` repair made since the last call, at its step: a text, the total
    of layers moved, and an event of the tab (a host-side list: nothing read from the
    device)."""
    repairs = repairs_of(board.model)
    if len(repairs) == board._repairs_written or not _writes_summaries(board.model):
        return  # nothing new (every batch: a tuple's length, nothing more)
    new = repairs[board._repairs_written :]
    for done, repair in enumerate(new, start=board._repairs_written + 1):
        _write_text(board, TAGS["repairs"], repair.to_markdown(), repair.step)
        moved = float(sum(len(r.layers) for r in repairs[:done]))
        _write_text(board, TAGS["repaired_layers"], moved, repair.step)
        write_event(_own_writer(board), names.REPAIR, repair.step, repair_event(repair))
    charted = bool(board._repairs_written)
    board._repairs_written = len(repairs)
    if new and not charted:
        _write_layout(board, new[0].step)


def _write_stops(board: TensorBoard) -> None:
    """Each `OverflowGuard` stop of this fit, as an event at the last step taken."""
    stops = stops_of(board.model)
    if not _writes_summaries(board.model):
        return
    for step, message in stops[board._stops_written :]:
        write_event(_own_writer(board), names.GUARD_STOP, max(step - 1, 0), {"message": message})
    board._stops_written = len(stops)


def _own_writer(board: TensorBoard) -> Any:
    """The callback's own writer into the run's train directory: Keras closes its writers
    when training ends, and a diagnosis often comes after `fit`. One writer (one event file)
    for all of them: event files opened in the same second sort by a per-process counter as
    text ("...10.v2" before "...9.v2"), so a new file each time could be read out of order."""
    log_dir = os.path.join(board.log_dir, "train")
    if board._diagnosis_writer is None or board._diagnosis_writer[0] != log_dir:
        board._diagnosis_writer = (log_dir, tf.summary.create_file_writer(log_dir))
    return board._diagnosis_writer[1]


def _write_text(board: TensorBoard, tag: str, text: str | float, step: int) -> None:
    """A text (or, for a number, a scalar) summary with the callback's own writer."""
    writer = _own_writer(board)
    with writer.as_default(), tf.summary.record_if(True):
        if isinstance(text, str):
            tf.summary.text(tag, text, step=step)
        else:
            tf.summary.scalar(tag, text, step=step)
    writer.flush()
