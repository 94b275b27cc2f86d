"""Keras callbacks that read the optimizer's loss-scale state and the step logs.

They never keep their own copy of the scale: they read the optimizer's variables, and only at
their logging interval (values put into `logs` on other batches are tensors, not host reads).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._validate import check_int_at_least_one
from tfmixprec.attribution import overflow_report
from tfmixprec.diagnosis import OverflowDiagnosis, explain_overflow
from tfmixprec.loss_scale import LOG_KEYS, format_scale
from tfmixprec.optimizer import LossScaleOptimizer

__all__ = ["LossScaleMonitor", "OverflowGuard"]


def _loss_scale_optimizer_of(model: Any, who: str) -> LossScaleOptimizer:
    """Returns `model.optimizer` if it is a tfmixprec `LossScaleOptimizer`, else raises."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, LossScaleOptimizer):
        raise TypeError(
            f"{who} reads the loss-scale state of a tfmixprec.LossScaleOptimizer, but "
            f"model.optimizer is {type(optimizer).__name__}. Compile with "
            "optimizer=tfmixprec.LossScaleOptimizer(your_optimizer), or use "
            "tfmixprec.MixedPrecisionModel, whose compile() wraps it for you."
        )
    return optimizer


class _EpochOverflows:
    """The number of overflow steps in the current epoch: the optimizer's total at epoch end
    less its total at epoch begin (one host read at each)."""

    def __init__(self) -> None:
        self._start = 0

    def begin(self, opt: LossScaleOptimizer) -> None:
        self._start = opt.read_state()["overflow_steps"]

    def count(self, opt: LossScaleOptimizer) -> float:
        return float(opt.read_state()["overflow_steps"] - self._start)


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

    def start(self, model: Any) -> None:
        self._keeper, self._first, self._done = None, 0, 0
        if not self.limit:
            return
        if not hasattr(model, "keep_overflow_batches"):
            raise TypeError(
                f"{self.who}(diagnose={self.limit}) replays the batch of an overflow step, "
                "which only tfmixprec's train_step keeps: use tfmixprec.MixedPrecisionModel "
                "(or call tfmixprec.explain_overflow(model, batch) yourself). Received: "
                f"model of type {type(model).__name__}"
            )
        self._keeper = model._keep_for_callbacks(self.limit)
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
            model._stop_keeping_for_callbacks()
        self._keeper = None


class _FitWatch(keras.callbacks.Callback):
    """Added first to `MixedPrecisionModel.fit`'s callbacks: puts the epoch's number of overflow
    steps in the epoch logs as `overflow` (so History, CSVLogger and the progress bar show it),
    and reports a `min_scale` overflow (`on_min_scale`) every `update_freq` batches and at
    epoch end, so `"raise"` stops `fit` promptly. One scalar read per check."""

    def __init__(self, update_freq: int = 50) -> None:
        super().__init__()
        self.update_freq = update_freq
        self._batches = 0
        self._epoch = _EpochOverflows()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch.begin(self.model.optimizer)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._batches += 1
        if self._batches % self.update_freq == 0:
            self.model.optimizer.check_min_scale()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["overflow"] = self._epoch.count(self.model.optimizer)
        self.model.optimizer.check_min_scale()


@keras.saving.register_keras_serializable(package="tfmixprec")
class LossScaleMonitor(keras.callbacks.Callback):
    """Adds `loss_scale`, `overflow`, `overflow_steps` and `skipped_fraction` to the logs.

    At every batch end the values are added as tensors read from the optimizer (no host
    sync); at epoch end as Python floats (the values after the epoch's last step, and as
    `overflow` the epoch's number of overflow steps). With
    `verbose=1`, every `update_freq` batches it prints one line when there were overflows
    since the last report, naming the layers whose gradients were not finite at the last one
    (`tfmixprec.overflow_report`), e.g. `step 1200: 3 overflows since last report, loss scale
    32768 -> 4096; gradients not finite in: attention`.

    The values: `loss_scale`, the current scale; `overflow`, the number of overflow (skipped)
    steps in the span the value covers (one step in batch logs, so 0 or 1; the epoch in epoch
    logs; the write interval in TensorBoard); `overflow_steps`, the total since the optimizer
    was created; `skipped_fraction`, `overflow_steps` over all steps.

    With `diagnose=N` (a `MixedPrecisionModel` compiled without XLA), the batches of the
    first N overflow steps of each `fit` are kept on the host and replayed with
    `tfmixprec.explain_overflow` right after their step: the results go to `diagnoses` as
    `(step, OverflowDiagnosis)` and, with `verbose=1`, are printed.

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
        self._step = 0
        self._reported = (0, None)
        self._snapshot: Any = None
        self._snapshot_of: Any = None
        self._epoch = _EpochOverflows()

    def get_config(self) -> dict[str, Any]:
        return {"verbose": self.verbose, "update_freq": self.update_freq, "diagnose": self.diagnose}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LossScaleMonitor:
        return cls(**config)

    def on_train_begin(self, logs: dict | None = None) -> None:
        opt = _loss_scale_optimizer_of(self.model, "LossScaleMonitor")
        self._step = 0
        state = opt.read_state()
        self._reported = (state["overflow_steps"], state["loss_scale"])
        self._diagnoser.start(self.model)

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
        opt = _loss_scale_optimizer_of(self.model, "LossScaleMonitor")
        self._step += 1
        if not all(key in logs for key in LOG_KEYS):
            # Keras's own train_step: compute them here (tfmixprec's returns them already,
            # computed in the graph, which costs nothing per batch).
            logs.update(self._values(opt))
        if self._step % self.update_freq == 0:
            self._report(opt)
        for step, diagnosis in self._diagnoser.new(self.model):
            self.diagnoses.append((step, diagnosis))
            if self.verbose:
                print(f"overflow step {step} (0-based, skipped steps counted): {diagnosis}")

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch.begin(_loss_scale_optimizer_of(self.model, "LossScaleMonitor"))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = logs if logs is not None else {}
        opt = _loss_scale_optimizer_of(self.model, "LossScaleMonitor")
        logs.update({k: float(v.numpy()) for k, v in self._values(opt).items()})
        logs["overflow"] = self._epoch.count(opt)
        self._report(opt)

    def _report(self, opt: LossScaleOptimizer) -> None:
        state = opt.read_state()
        overflows, scale = state["overflow_steps"], state["loss_scale"]
        before_overflows, before_scale = self._reported
        if overflows > before_overflows:
            layers = overflow_report(self.model).last_overflow_layers
            line = (
                f"step {self._step}: {overflows - before_overflows} overflow"
                f"{'s' if overflows - before_overflows != 1 else ''} since last report, "
                f"loss scale {format_scale(before_scale)} -> {format_scale(scale)}"
                + (f"; gradients not finite in: {', '.join(layers)}" if layers else "")
            )
            self.events.append(line)
            if self.verbose:
                print(line)
        self._reported = (overflows, scale)
        opt.check_min_scale()


@keras.saving.register_keras_serializable(package="tfmixprec")
class OverflowGuard(keras.callbacks.Callback):
    """Stops training on a divergence, not on an ordinary overflow.

    It stops (sets `model.stop_training`) when the loss scale has sat at `min_scale` for
    `patience` steps, or after `max_consecutive` overflow steps in a row: that is bad data or a
    real divergence, not a scale finding its level. Unlike `keras.callbacks.TerminateOnNaN` an
    isolated overflow never stops it.

    Args:
        patience: Int. Steps at `min_scale` (still overflowing or not) before stopping.
        max_consecutive: Int. Consecutive overflow steps before stopping.
        restore_weights: Bool. On stopping, restore the last weights seen after an applied step
            with a finite loss (copied to the host at every check; costs memory and time).
        raise_error: Bool. Raise `FloatingPointError` with the message instead of only stopping.
        update_freq: Int. Batches between checks (each check reads two variables).
        verbose: Int. 1 prints the stop message.

    Raises:
        ValueError: If `patience`, `max_consecutive` or `update_freq` is not an integer >= 1,
            or `restore_weights` / `raise_error` is not a bool.

    Example:

    >>> guard = tfmixprec.OverflowGuard(patience=200, max_consecutive=20)
    >>> model.fit(x, y, callbacks=[guard]); guard.stop_message
    """

    def __init__(
        self,
        patience: int = 100,
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
        self._step = 0
        self._at_min_since: int | None = None
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

    def on_train_begin(self, logs: dict | None = None) -> None:
        _loss_scale_optimizer_of(self.model, "OverflowGuard")
        self._step = 0
        self._at_min_since = None
        self.stopped_step = None
        self.stop_message = None
        if self.restore_weights:
            self._good_weights = self.model.get_weights()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        logs = logs or {}
        self._step += 1
        if self._step % self.update_freq:
            return
        opt = _loss_scale_optimizer_of(self.model, "OverflowGuard")
        state = opt.read_state()
        consecutive = state["consecutive_overflows"]
        at_min = opt.dynamic and state["loss_scale"] <= opt.min_scale
        if at_min and self._at_min_since is None:
            self._at_min_since = self._step
        elif not at_min:
            self._at_min_since = None
        if self.restore_weights and consecutive == 0:
            loss = logs.get("loss")
            if loss is None or math.isfinite(float(loss)):
                self._good_weights = self.model.get_weights()
        opt.check_min_scale()  # on_min_scale="raise" raises here, "warn" warns once
        reason = None
        if consecutive >= self.max_consecutive:
            reason = (
                f"{consecutive} consecutive overflow steps (max_consecutive={self.max_consecutive})"
            )
        elif (
            self._at_min_since is not None and self._step - self._at_min_since + 1 >= self.patience
        ):
            reason = (
                f"the loss scale has sat at min_scale={opt.min_scale:g} for "
                f"{self._step - self._at_min_since + 1} steps (patience={self.patience})"
            )
        if reason is not None:
            self._stop(reason)

    def _stop(self, reason: str) -> None:
        self.stopped_step = self._step
        restored = ""
        if self.restore_weights and self._good_weights is not None:
            self.model.set_weights(self._good_weights)
            restored = " The last weights with a finite loss were restored."
        self.stop_message = (
            f"OverflowGuard stopped training at step {self._step}: {reason}. This is not a "
            "loss scale finding its level: likely causes are NaN/Inf in the inputs or labels, "
            "a learning rate that is too high, or a layer (softmax, loss, output) that must "
            f"run in float32 (see tfmixprec.audit(model)).{restored}"
        )
        self.model.stop_training = True
        if self.verbose:
            print(self.stop_message)
        if self.raise_error:
            raise FloatingPointError(self.stop_message)
