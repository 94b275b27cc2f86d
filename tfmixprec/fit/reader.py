"""What a tfmixprec callback reads of one `fit`: one reader shared by all of them.

`LossScaleMonitor`, `OverflowGuard`, `tfmixprec.TensorBoard`, `GradientRangeMonitor` and the
watch `MixedPrecisionModel.fit` adds each hold a `FitReader`. It finds the model's loss scaling
(adopting Keras's own `LossScaleOptimizer` when `fit` sets the model), says when a read is due
(every `update_freq` steps, see `tfmixprec._common.cadence.Every`), and reads the optimizer's state
with what it was at the previous read and at the epoch's start, so "overflow steps since the
last read" and "overflow steps in this epoch" are differences of the optimizer's own total.
"""

from __future__ import annotations

from typing import Any

from tfmixprec._common.cadence import Every
from tfmixprec.fit.adoption import adopt_at_train_begin, adopt_when_set, loss_scaling_of
from tfmixprec.scaling.optimizer import LossScaleOptimizer
from tfmixprec.scaling.state_guard import mark_unapplied_epoch

__all__: list[str] = []  # private module: nothing here is part of the package's API


class FitReader:
    """The reads of one callback (named `who` in what adoption says).

    Args:
        who: String. The callback's name, for the lines adoption prints.
        update_freq: Int >= 1. Steps between reads (`due`).
    """

    def __init__(self, who: str, update_freq: int) -> None:
        self.who = who
        self.every = Every(update_freq)
        self.model: Any = None
        self._last: dict[str, Any] | None = None
        self._epoch_start = 0
        self._epoch_start_applied = -1  # set at each epoch's begin

    @property
    def optimizer(self) -> LossScaleOptimizer | None:
        """The model's tfmixprec `LossScaleOptimizer`, or None (no loss scaling)."""
        return loss_scaling_of(self.model)

    @property
    def last(self) -> dict[str, Any] | None:
        """The optimizer's state at the last read (`train_begin`'s, then `read`'s), or None
        without loss scaling: no read of its own."""
        return self._last

    def set_model(self, model: Any) -> None:
        """From the callback's `set_model`: adopts Keras's `LossScaleOptimizer` before any
        callback's `on_train_begin` (a `BackupAndRestore` anywhere in the list restores into
        tfmixprec's)."""
        self.model = model
        adopt_when_set(model, self.who)

    def train_begin(self) -> LossScaleOptimizer | None:
        """From `on_train_begin`: the loss scaling (said once per model when there is none),
        the cadence started, the state read once as the first "previous read"."""
        optimizer = adopt_at_train_begin(self.model, self.who)
        self.every.start()
        self._last = optimizer.read_state() if optimizer is not None else None
        self._epoch_start = self._last["overflow_steps"] if self._last else 0
        return optimizer

    def epoch_begin(self) -> None:
        """From `on_epoch_begin`: the cadence's epoch, and the epoch's first overflow total (one
        host read)."""
        self.every.epoch_begin()
        optimizer = self.optimizer
        if optimizer is not None:
            state = optimizer.read_state()
            self._epoch_start = state["overflow_steps"]
            self._epoch_start_applied = state["iterations"]

    def epoch_end(self, logs: dict | None) -> None:
        """From `on_epoch_end`: an epoch in which every step was skipped (overflows, and the
        optimizer's `iterations` did not move) logs nan for its loss and metrics, not the 0 of
        an empty mean (`state_guard.mark_unapplied_epoch`; one host read). Not with gradient
        accumulation: there an epoch of micro-batches may apply nothing and skip nothing, and
        a skipped window puts back its last micro-batch only."""
        optimizer = self.optimizer
        if optimizer is None or optimizer.accumulation_steps > 1:
            return
        state = optimizer.read_state()
        skipped_all = state["iterations"] == self._epoch_start_applied
        if skipped_all and state["overflow_steps"] > self._epoch_start:
            mark_unapplied_epoch(self.model, logs)

    def due(self, batch: int) -> bool:
        """Whether an `update_freq`-th step is among the steps up to `batch` (Keras's index)."""
        return self.every.due(batch)

    def read(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The optimizer's state now and at the previous read (one host read); needs loss
        scaling (`optimizer` not None)."""
        state = self.optimizer.read_state()
        previous = self._last if self._last is not None else state
        self._last = state
        return state, previous

    def epoch_overflows(self, total: float | None = None) -> float:
        """Overflow steps in the epoch so far: `total` (the optimizer's, e.g. from the logs:
        no read) or the state read now, less the epoch's first."""
        if total is None:
            total = self.optimizer.read_state()["overflow_steps"]
        return float(total - self._epoch_start)
