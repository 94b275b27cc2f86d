"""Keras callbacks that read the optimizer's loss-scale state and the step logs.

They never keep their own copy of the scale: they read the optimizer's variables, and only at
their logging interval (values put into `logs` on other batches are tensors, not host reads).
On a plain `keras.Model` compiled the Keras way they adopt Keras's own
`keras.optimizers.LossScaleOptimizer` when `fit` sets their model (see `LossScaleMonitor`).
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._common.layers import float32_on_purpose
from tfmixprec._common.validate import check_bool, check_int_at_least_one, check_update_freq
from tfmixprec.fit.hooks import Diagnoser, record_stop
from tfmixprec.fit.reader import FitReader, check_min_scale
from tfmixprec.fit.repair import repairs_of
from tfmixprec.replay.diagnosis import OverflowDiagnosis
from tfmixprec.scaling.attribution import overflow_report
from tfmixprec.scaling.loss_scale import LOG_KEYS, format_scale
from tfmixprec.scaling.optimizer import LossScaleOptimizer

__all__ = ["LossScaleMonitor", "OverflowGuard"]


@keras.saving.register_keras_serializable(package="tfmixprec")
class LossScaleMonitor(keras.callbacks.Callback):
    """Adds `loss_scale`, `overflow`, `overflow_steps` and `skipped_fraction` to the logs.

    At every batch end the values are added as tensors read from the optimizer (no host
    sync); at epoch end as Python floats, with `overflow` the epoch's number of overflow
    steps. `loss_scale` is the current scale, `overflow_steps` the total since the optimizer
    was created, `skipped_fraction` that total over all steps. With `verbose=1`, every
    `update_freq` steps with overflows since the last report it prints one line, e.g.
    `overflow at step 6 (0-based, skipped steps counted), loss scale 32768 -> 16384;
    gradients not finite in: dense` (with several: `3 overflows in steps 4-11, the last at
    step 9 (...)`). Steps are the optimizer's own count, right with any `steps_per_execution`.

    With `diagnose=N` the batches of the first N overflow steps of each `fit` are replayed
    with `tfmixprec.explain_overflow` right after their step (any model with loss scaling,
    with XLA or without, one replica): the results go to `diagnoses` as
    `(step, OverflowDiagnosis)` and, with `verbose=1`, are printed.

    On a plain `keras.Model` compiled under `mixed_float16`, Keras's own
    `keras.optimizers.LossScaleOptimizer` is replaced by `tfmixprec.LossScaleOptimizer` when
    `fit` sets the callback's model (as every tfmixprec callback does; said in one line per
    model). Without loss scaling (bfloat16 or float32 with a plain optimizer) it says once
    that none is needed and adds nothing; float16 without it gets a `RuntimeWarning`.

    Args:
        verbose: Int. 0 (silent) or 1 (print overflow events).
        update_freq: `"epoch"`, `"batch"` or Int, as for `keras.callbacks.TensorBoard`:
            report at each epoch's end only, after every batch, or every that many batches
            (the only host reads it makes).
        diagnose: Int >= 0. Overflow steps to replay per `fit` (0: none).

    Raises:
        ValueError: If `verbose` is not 0 or 1, `update_freq` is not `"epoch"`, `"batch"`
            or an integer >= 1, or
            `diagnose` is not an integer >= 0.

    Example:

    >>> model.fit(x, y, callbacks=[tfmixprec.LossScaleMonitor(verbose=1)])
    """

    def __init__(self, verbose: int = 0, update_freq: int | str = 100, diagnose: int = 0) -> None:
        super().__init__()
        if verbose not in (0, 1):
            raise ValueError(f"verbose must be 0 or 1. Received: verbose={verbose!r}")
        self.verbose = verbose
        self.update_freq = check_update_freq(update_freq)
        self.diagnose = diagnose
        self._diagnoser = Diagnoser(diagnose, "LossScaleMonitor")
        self.diagnoses: list[tuple[int, OverflowDiagnosis]] = []
        self.events: list[str] = []
        every = self.update_freq if isinstance(self.update_freq, int) else 1
        self._reader = FitReader("LossScaleMonitor", every)
        self._snapshot: Any = None
        self._snapshot_of: Any = None

    def get_config(self) -> dict[str, Any]:
        return {"verbose": self.verbose, "update_freq": self.update_freq, "diagnose": self.diagnose}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LossScaleMonitor:
        return cls(**config)

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self._reader.set_model(model)

    def on_train_begin(self, logs: dict | None = None) -> None:
        opt = self._reader.train_begin(self.params)
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
        opt = self._reader.optimizer
        due = self._reader.batch_end(batch, logs) and self.update_freq != "epoch"
        if opt is None:
            return  # no loss scaling: nothing to add or report
        if not all(key in logs for key in LOG_KEYS):
            # Keras's own train_step: compute them here (tfmixprec's returns them already,
            # computed in the graph, which costs nothing per batch).
            logs.update(self._values(opt))
        if due:
            self._report(opt)
        for step, diagnosis in self._diagnoser.new(self.model, self._reader):
            self.diagnoses.append((step, diagnosis))
            if self.verbose:
                print(f"overflow step {step} (0-based, skipped steps counted): {diagnosis}")

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._reader.epoch_begin()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = logs if logs is not None else {}
        self._reader.epoch_end(logs)
        opt = self._reader.optimizer
        if opt is None:
            return
        logs.update(_log_values(self._reader.state()))
        logs["overflow"] = self._reader.epoch_overflows()
        self._report(opt)

    def _report(self, opt: LossScaleOptimizer) -> None:
        now, before = self._reader.read()
        count = now["overflow_steps"] - before["overflow_steps"]
        if count > 0:
            last = now["last_overflow_step"]
            layers = overflow_report(self.model).last_overflow_layers
            # One overflow: the scale it used (the scale may have grown since the last read).
            used = now["last_overflow_scale"] if count == 1 else 0.0
            start = used if used > 0 else before["loss_scale"]  # 0: not recorded
            where = (
                f"overflow at step {last}"
                if count == 1
                else f"{count} overflows in steps {before['step']}-{now['step'] - 1}, the last "
                f"at step {last}"
            )
            line = (
                f"{where} (0-based, skipped steps counted), loss scale "
                f"{format_scale(start)} -> {format_scale(now['loss_scale'])}"
                + (f"; gradients not finite in: {', '.join(layers)}" if layers else "")
                + _repaired(self.model, before["step"], now["step"])
            )
            self.events.append(line)
            if self.verbose:
                print(line)
        check_min_scale(opt, now)


def _log_values(state: dict[str, Any]) -> dict[str, float]:
    """`LOG_KEYS` from a shared read, as `snapshot()` computes them (in float32); `overflow`
    (in its place) is set by the caller, to the epoch's count."""
    overflows = np.float32(state["overflow_steps"])
    attempted = overflows + np.float32(state["iterations"])
    return {
        "loss_scale": state["loss_scale"],
        "overflow": 0.0,
        "overflow_steps": float(overflows),
        "skipped_fraction": float(overflows / np.maximum(attempted, np.float32(1.0))),
    }


def _repaired(model: Any, start: int, end: int) -> str:
    """What `PrecisionRepair` moved to float32 in steps [start, end), for the monitor's line:
    a repaired run is not a failed one."""
    made = [r for r in repairs_of(model) if start <= r.step < end]
    return "".join(
        f"; repaired at step {r.step}: {', '.join(repr(n) for n in r.layers)} now float32"
        for r in made
    )


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
        ValueError: If `patience`, `max_consecutive` or `update_freq` is not an integer >= 1.
        TypeError: If `restore_weights` or `raise_error` is not a bool.

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
        self.restore_weights = check_bool("restore_weights", restore_weights)
        self.raise_error = check_bool("raise_error", raise_error)
        self.verbose = verbose
        self.stopped_step: int | None = None
        self.stop_message: str | None = None
        self._reader = FitReader("OverflowGuard", self.update_freq)
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
        self._reader.set_model(model)

    def on_train_begin(self, logs: dict | None = None) -> None:
        opt = self._reader.train_begin(self.params)
        if opt is not None:
            opt.reset_longest_overflow_run()  # runs from here on; read at each check
            self._reader.forget()
        self.stopped_step = None
        self.stop_message = None
        if self.restore_weights:
            self._good_weights = self.model.get_weights()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._reader.epoch_begin()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._reader.epoch_end(logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        logs = logs or {}
        if not self._reader.batch_end(batch, logs):
            return
        opt = self._reader.optimizer
        state = self._reader.read()[0] if opt is not None else None
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
        check_min_scale(opt, state)  # on_min_scale="raise" raises here, "warn" warns once
        reason = self._reason(opt, state)
        if reason is not None:
            self._stop(state["step"], reason)

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
        repaired = float32_on_purpose(self.model)
        if repaired:  # a repair is not the failure: say what was repaired before it
            names = ", ".join(repr(path) for path in repaired)
            restored += f" Already computing in float32 on purpose: {names}."
        self.stop_message = (
            f"OverflowGuard stopped training at step {step}: {reason}. "
            + ("This is not a loss scale finding its level: likely" if scaled else "Likely")
            + " causes are NaN/Inf in the inputs or labels, "
            "a learning rate that is too high, or a layer (softmax, loss, output) that must "
            f"run in float32 (see tfmixprec.audit(model)).{restored}"
        )
        self.model.stop_training = True
        record_stop(self.model, step, self.stop_message)
        if self.verbose:
            print(self.stop_message)
        if self.raise_error:
            raise FloatingPointError(self.stop_message)
