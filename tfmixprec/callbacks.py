"""Keras callbacks that read the optimizer's loss-scale state and the step logs.

They never keep their own copy of the scale: they read the optimizer's variables, and only at
their logging interval (values put into `logs` on other batches are tensors, not host reads).
On a plain `keras.Model` compiled the Keras way they adopt Keras's own
`keras.optimizers.LossScaleOptimizer` when `fit` sets their model (see `LossScaleMonitor`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._cadence import Every
from tfmixprec._validate import check_int_at_least_one
from tfmixprec.attribution import overflow_report
from tfmixprec.diagnosis import (
    OverflowDiagnosis,
    explain_overflow,
    keep_for_callbacks,
    stop_keeping_for_callbacks,
)
from tfmixprec.loss_scale import LOG_KEYS, format_scale
from tfmixprec.optimizer import (
    LossScaleOptimizer,
    _adopt_loss_scaling,
    _adopt_when_set,
    _loss_scaling_of,
)

__all__ = ["LossScaleMonitor", "OverflowGuard"]


def _attempted(state: dict[str, Any]) -> int:
    """Steps attempted so far, skipped ones counted (the optimizer's own counters)."""
    return int(state["iterations"] + state["overflow_steps"])


class _EpochOverflows:
    """The number of overflow steps in the current epoch: the optimizer's total at epoch end
    less its total at epoch begin (one host read at each)."""

    def __init__(self) -> None:
        self._start = 0

    def begin(self, opt: LossScaleOptimizer) -> None:
        self._start = opt.read_state()["overflow_steps"]

    def count(self, opt: LossScaleOptimizer) -> float:
        return self.since(opt.read_state()["overflow_steps"])

    def since(self, total: float) -> float:
        """The epoch's count given the optimizer's total (from the logs: no read)."""
        return float(total - self._start)


class _Diagnoser:
    """Replays the batches of overflow steps that the model keeps (see
    `MixedPrecisionModel.keep_overflow_batches`) with `explain_overflow`, `limit` per `fit`."""

    def __init__(self, limit: int, who: str) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(
                "diagnose must be an int >= 0: how many overflow steps to replay per fit "
                f"(0: none). Received: diagnose={limit!r}"
            )
        self.limit, self.who = limit, who
        self._keeper: Any = None
        self._first = self._done = 0

    def start(self, callback: Any, optimizer: LossScaleOptimizer | None) -> None:
        """Keeps overflow batches for this `fit` in the step of `callback`'s model (any
        model); nothing to keep without a tfmixprec `LossScaleOptimizer` (no step is skipped
        then)."""
        self._keeper, self._first, self._done = None, 0, 0
        if not self.limit or optimizer is None:
            return
        # Keras gives every callback of one fit the same `params` dict: it marks the fit.
        fit = callback.params
        self._keeper = keep_for_callbacks(callback.model, self.limit, self.who, fit)
        self._first = len(self._keeper.kept) if self._keeper is not None else 0

    def new(self, model: Any) -> list[tuple[int, OverflowDiagnosis]]:
        """Diagnoses of the overflow steps kept since the last call (no device read). A
        batch that cannot be replayed ends the replay for this `fit` with a warning; it never
        stops training."""
        if self._keeper is None or self._done >= self.limit:
            return []
        fresh = self._keeper.kept[self._first + self._done : self._first + self.limit]
        self._done += len(fresh)
        found = []
        for kept in fresh:
            try:
                found.append((kept.step, explain_overflow(model, kept.batch, scale=kept.scale)))
            except (TypeError, ValueError) as err:
                warnings.warn(
                    f"{self.who} could not replay overflow step {kept.step}, so diagnose= is "
                    f"off for the rest of this fit (training goes on): {err}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._done = self.limit
                break
        return found

    def stop(self, model: Any) -> None:
        if self._keeper is not None:
            stop_keeping_for_callbacks(model)
        self._keeper = None


class _FitWatch(keras.callbacks.Callback):
    """Added first to `MixedPrecisionModel.fit`'s callbacks: puts the epoch's number of overflow
    steps in the epoch logs as `overflow` (so History, CSVLogger and the progress bar show it),
    and reports a `min_scale` overflow (`on_min_scale`) every `update_freq` batches and at
    epoch end, so `"raise"` stops `fit` promptly. One scalar read per check."""

    def __init__(self, update_freq: int = 50) -> None:
        super().__init__()
        self.update_freq = update_freq
        self._every = Every(update_freq)
        self.epoch_overflows = _EpochOverflows()  # shared with the progress bar

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._every.start()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._every.epoch_begin()
        self.epoch_overflows.begin(self.model.optimizer)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._every.due(batch):
            self.model.optimizer.check_min_scale()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["overflow"] = self.epoch_overflows.count(self.model.optimizer)
        self.model.optimizer.check_min_scale()


# What the progress bar leaves out: totals since the optimizer was created, kept in the logs
# (History, CSVLogger) but not what a person watches while training.
_NOT_ON_THE_BAR = ("overflow_steps", "skipped_fraction")


class _ProgressBar(keras.callbacks.ProgbarLogger):
    """Keras's progress bar for `MixedPrecisionModel.fit`, showing of the loss-scale values
    only what a person watches: `loss_scale`, and `overflow` as the epoch's number of overflow
    steps so far, once there is one (Keras prints a 0 as `0.0000e+00`). The logs that History,
    CSVLogger and the other callbacks see are not changed. `epoch_overflows` is the
    `_FitWatch`'s, which runs first and reads the epoch's starting total once."""

    def __init__(self, epoch_overflows: _EpochOverflows) -> None:
        super().__init__()
        self._epoch = epoch_overflows

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        logs = dict(logs or {})
        if "overflow_steps" in logs:
            logs["overflow"] = self._epoch.since(logs["overflow_steps"])
        super().on_train_batch_end(batch, _bar_view(logs))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, _bar_view(dict(logs or {})))


def _bar_view(logs: dict) -> dict:
    """`logs` without the totals, and without `overflow` while it is 0."""
    view = {k: v for k, v in logs.items() if k not in _NOT_ON_THE_BAR}
    if not view.get("overflow", 1):
        del view["overflow"]
    return view


@keras.saving.register_keras_serializable(package="tfmixprec")
class LossScaleMonitor(keras.callbacks.Callback):
    """Adds `loss_scale`, `overflow`, `overflow_steps` and `skipped_fraction` to the logs.

    At every batch end the values are added as tensors read from the optimizer (no host
    sync); at epoch end as Python floats (the values after the epoch's last step, and as
    `overflow` the epoch's number of overflow steps). With
    `verbose=1`, every `update_freq` batches it prints one line when there were overflows
    since the last report, naming the layers whose gradients were not finite at the last one
    (`tfmixprec.overflow_report`); see the report's wording below.

    The values: `loss_scale`, the current scale; `overflow`, the number of overflow (skipped)
    steps in the span the value covers (one step in batch logs, so 0 or 1; the epoch in epoch
    logs; the write interval in TensorBoard); `overflow_steps`, the total since the optimizer
    was created; `skipped_fraction`, `overflow_steps` over all steps.

    With `diagnose=N` (any model with loss scaling, Keras's own adopted, compiled without
    XLA, one replica), the batches of the first N overflow steps of each `fit` are kept on
    the host and replayed with `tfmixprec.explain_overflow` right after their step: the
    results go to `diagnoses` as `(step, OverflowDiagnosis)` and, with `verbose=1`, are
    printed. Without loss scaling (a plain optimizer under bfloat16 or float32) no step is
    skipped, so there is nothing to replay.

    Steps are numbered by the optimizer's own counters (0-based, skipped steps counted, as
    `tfmixprec.explain_overflow` numbers them), so the numbers are right with any
    `steps_per_execution`; `update_freq` counts steps too (a report due inside an execution
    comes at its end). A report with one overflow reads `overflow at step 6 (0-based, skipped
    steps counted), loss scale 32768 -> 16384; gradients not finite in: dense`; with several,
    `3 overflows in steps 4-11, the last at step 9 (...)`.

    On a plain `keras.Model` (Keras's `train_step`): under `mixed_float16`, Keras's `compile`
    wraps the optimizer in its own `keras.optimizers.LossScaleOptimizer`; when `fit` sets its
    model, before any callback's `on_train_begin` (so a `BackupAndRestore` anywhere in the list
    restores into it), this callback (like every tfmixprec callback) replaces it by
    `tfmixprec.LossScaleOptimizer.from_keras(...)` (same inner optimizer and settings; a used
    one's state carried over),
    saying so in one printed line per model. Under `mixed_bfloat16` or `float32` with a plain
    optimizer there is nothing to scale: it prints once that no loss scaling is needed and
    adds no loss-scale values. A float16 model with a plain optimizer gets a
    `RuntimeWarning` (gradients underflow; how to wrap the optimizer).

    Args:
        verbose: Int. 0 (silent) or 1 (print overflow events).
        update_freq: Int. Batches between reports (the only host reads it makes).
        diagnose: Int >= 0. Overflow steps to replay per `fit` (0: none).

    Raises:
        ValueError: If `verbose` is not 0 or 1, `update_freq` is not an integer >= 1, or
            `diagnose` is not an integer >= 0.

    Example:

    >>> model.fit(x, y, callbacks=[tfmixprec.LossScaleMonitor(verbose=1)])
    """

    def __init__(self, verbose: int = 0, update_freq: int = 100, diagnose: int = 0) -> None:
        super().__init__()
        if verbose not in (0, 1):
            raise ValueError(f"verbose must be 0 or 1. Received: verbose={verbose!r}")
        self.verbose = verbose
        self.update_freq = check_int_at_least_one("update_freq", update_freq)
        self.diagnose = diagnose
        self._diagnoser = _Diagnoser(diagnose, "LossScaleMonitor")
        self.diagnoses: list[tuple[int, OverflowDiagnosis]] = []
        self.events: list[str] = []
        self._every = Every(self.update_freq)
        self._reported: tuple[int, float, int] = (0, 0.0, 0)
        self._snapshot: Any = None
        self._snapshot_of: Any = None
        self._epoch = _EpochOverflows()

    def get_config(self) -> dict[str, Any]:
        return {"verbose": self.verbose, "update_freq": self.update_freq, "diagnose": self.diagnose}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LossScaleMonitor:
        return cls(**config)

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        _adopt_when_set(model, "LossScaleMonitor")

    def on_train_begin(self, logs: dict | None = None) -> None:
        opt = _adopt_loss_scaling(self.model, "LossScaleMonitor")
        self._every.start()
        if opt is not None:
            state = opt.read_state()
            self._reported = (state["overflow_steps"], state["loss_scale"], _attempted(state))
        self._diagnoser.start(self, opt)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._diagnoser.stop(self.model)

    def _values(self, opt: LossScaleOptimizer) -> dict[str, Any]:
        # One compiled call per batch instead of several eager ops: the values stay on the
        # device (tensors), nothing is read to the host here.
        if self._snapshot is None or self._snapshot_of is not opt:
            self._snapshot = tf.function(opt.snapshot)
            self._snapshot_of = opt
        return self._snapshot()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        logs = logs if logs is not None else {}
        opt = _loss_scaling_of(self.model)
        due = self._every.due(batch)
        if opt is None:
            return  # no loss scaling: nothing to add or report
        if not all(key in logs for key in LOG_KEYS):
            # Keras's own train_step: compute them here (tfmixprec's returns them already,
            # computed in the graph, which costs nothing per batch).
            logs.update(self._values(opt))
        if due:
            self._report(opt)
        for step, diagnosis in self._diagnoser.new(self.model):
            self.diagnoses.append((step, diagnosis))
            if self.verbose:
                print(f"overflow step {step} (0-based, skipped steps counted): {diagnosis}")

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._every.epoch_begin()
        opt = _loss_scaling_of(self.model)
        if opt is not None:
            self._epoch.begin(opt)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = logs if logs is not None else {}
        opt = _loss_scaling_of(self.model)
        if opt is None:
            return
        logs.update({k: float(v.numpy()) for k, v in self._values(opt).items()})
        logs["overflow"] = self._epoch.count(opt)
        self._report(opt)

    def _report(self, opt: LossScaleOptimizer) -> None:
        state = opt.read_state()
        overflows, scale, attempted = (
            state["overflow_steps"],
            state["loss_scale"],
            _attempted(state),
        )
        before_overflows, before_scale, before_attempted = self._reported
        if overflows > before_overflows:
            count, last = overflows - before_overflows, int(opt.last_overflow_step().numpy())
            layers = overflow_report(self.model).last_overflow_layers
            where = (
                f"overflow at step {last}"
                if count == 1
                else f"{count} overflows in steps {before_attempted}-{attempted - 1}, the last "
                f"at step {last}"
            )
            line = (
                f"{where} (0-based, skipped steps counted), loss scale "
                f"{format_scale(before_scale)} -> {format_scale(scale)}"
                + (f"; gradients not finite in: {', '.join(layers)}" if layers else "")
            )
            self.events.append(line)
            if self.verbose:
                print(line)
        self._reported = (overflows, scale, attempted)
        opt.check_min_scale()


@keras.saving.register_keras_serializable(package="tfmixprec")
class OverflowGuard(keras.callbacks.Callback):
    """Stops training on a divergence, not on an ordinary overflow.

    It stops (sets `model.stop_training`) after `patience` overflow steps taken at
    `min_scale` (where the scale cannot back off any further) since the scale last grew, or
    after `max_consecutive` overflow steps in a row: that is bad data or a real divergence,
    not a scale finding its level. Sitting at `min_scale` with clean steps never stops it, and
    unlike `keras.callbacks.TerminateOnNaN` an isolated overflow never does. Both counts are
    kept by the step, in the optimizer's variables (`min_scale_overflows`,
    `longest_overflow_run`), so they are exact with any `steps_per_execution` and
    `update_freq`: a run of overflows between two checks is still seen. `stopped_step` is the
    number of steps attempted when it stopped (skipped steps counted).

    Without loss scaling (a plain optimizer: `mixed_bfloat16`, `float32`, see
    `LossScaleMonitor`) nothing is skipped, so it does what `keras.callbacks.TerminateOnNaN`
    does: it stops at a check that sees a non-finite `loss`.

    Args:
        patience: Int. Overflow steps at `min_scale` (since the scale last grew) before
            stopping.
        max_consecutive: Int. Consecutive overflow steps before stopping.
        restore_weights: Bool. On stopping, restore the weights after the last clean step seen
            at a check (with loss scaling: an applied step, whatever the epoch's running-mean
            loss says; without: a step while the loss is finite). Copied to the host at every
            check whose step was clean (every step with `update_freq=1`; costs memory and
            time).
        raise_error: Bool. Raise `FloatingPointError` with the message instead of only stopping.
        update_freq: Int. Batches (steps) between checks (each check reads the state once).
        verbose: Int. 1 prints the stop message.

    Raises:
        ValueError: If `patience`, `max_consecutive` or `update_freq` is not an integer >= 1,
            or `restore_weights` / `raise_error` is not a bool.

    Example:

    >>> guard = tfmixprec.OverflowGuard(patience=10, max_consecutive=20)
    >>> model.fit(x, y, callbacks=[guard]); guard.stop_message
    """

    def __init__(
        self,
        patience: int = 10,
        max_consecutive: int = 20,
        restore_weights: bool = False,
        raise_error: bool = False,
        update_freq: int = 1,
        verbose: int = 1,
    ) -> None:
        super().__init__()
        self.patience = check_int_at_least_one("patience", patience)
        self.max_consecutive = check_int_at_least_one("max_consecutive", max_consecutive)
        self.update_freq = check_int_at_least_one("update_freq", update_freq)
        for name, value in (("restore_weights", restore_weights), ("raise_error", raise_error)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False. Received: {name}={value!r}")
        self.restore_weights = restore_weights
        self.raise_error = raise_error
        self.verbose = verbose
        self.stopped_step: int | None = None
        self.stop_message: str | None = None
        self._every = Every(self.update_freq)
        self._good_weights: list[np.ndarray] | None = None

    def get_config(self) -> dict[str, Any]:
        return {
            "patience": self.patience,
            "max_consecutive": self.max_consecutive,
            "restore_weights": self.restore_weights,
            "raise_error": self.raise_error,
            "update_freq": self.update_freq,
            "verbose": self.verbose,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> OverflowGuard:
        return cls(**config)

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        _adopt_when_set(model, "OverflowGuard")

    def on_train_begin(self, logs: dict | None = None) -> None:
        opt = _adopt_loss_scaling(self.model, "OverflowGuard")
        if opt is not None:
            opt.reset_longest_overflow_run()  # runs from here on; read at each check
        self._every.start()
        self.stopped_step = None
        self.stop_message = None
        if self.restore_weights:
            self._good_weights = self.model.get_weights()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._every.epoch_begin()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        logs = logs or {}
        if not self._every.due(batch):
            return
        opt = _loss_scaling_of(self.model)
        state = opt.read_state() if opt is not None else None
        loss = logs.get("loss")
        finite_loss = loss is None or math.isfinite(float(loss))
        # The step just taken was clean: with loss scaling, the optimizer applied it (the
        # epoch's running-mean loss stays non-finite after one skipped batch, so it cannot
        # say); without, its loss (the running mean) is still finite, or nothing was applied.
        clean = not state["consecutive_overflows"] if state is not None else finite_loss
        if self.restore_weights and clean:
            self._good_weights = self.model.get_weights()
        if opt is None:  # no loss scaling: a non-finite step was applied, as TerminateOnNaN
            if not finite_loss:
                step = int(self.model.optimizer.iterations.numpy())
                reason = f"the loss is {float(loss)} (without loss scaling nothing skips it)"
                self._stop(step, reason, scaled=False)
            return
        opt.check_min_scale()  # on_min_scale="raise" raises here, "warn" warns once
        reason = self._reason(opt, state)
        if reason is not None:
            self._stop(_attempted(state), reason)

    def _reason(self, opt: LossScaleOptimizer, state: dict[str, Any]) -> str | None:
        longest, at_min = state["longest_overflow_run"], state["min_scale_overflows"]
        if longest >= self.max_consecutive:
            return f"{longest} consecutive overflow steps (max_consecutive={self.max_consecutive})"
        if opt.dynamic and at_min >= self.patience:
            return (
                f"{at_min} overflow steps at min_scale={opt.min_scale:g}, where the loss scale "
                f"cannot back off any further (patience={self.patience})"
            )
        return None

    def _stop(self, step: int, reason: str, scaled: bool = True) -> None:
        self.stopped_step = step
        restored = ""
        if self.restore_weights and self._good_weights is not None:
            self.model.set_weights(self._good_weights)
            restored = " The weights after the last clean step were restored."
        self.stop_message = (
            f"OverflowGuard stopped training at step {step}: {reason}. "
            + ("This is not a loss scale finding its level: likely" if scaled else "Likely")
            + " causes are NaN/Inf in the inputs or labels, "
            "a learning rate that is too high, or a layer (softmax, loss, output) that must "
            f"run in float32 (see tfmixprec.audit(model)).{restored}"
        )
        self.model.stop_training = True
        if self.verbose:
            print(self.stop_message)
        if self.raise_error:
            raise FloatingPointError(self.stop_message)
