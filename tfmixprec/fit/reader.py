"""What a tfmixprec callback reads of one `fit`: one reader shared by all of them.

`LossScaleMonitor`, `OverflowGuard`, `tfmixprec.TensorBoard`, `GradientRangeMonitor` and the
watch `MixedPrecisionModel.fit` adds each hold a `FitReader`. It finds the model's loss scaling
(adopting Keras's own `LossScaleOptimizer` when `fit` sets the model), says when a read is due
(every `update_freq` steps, see `tfmixprec._common.cadence.Every`), and reads the optimizer's state
with what it was at the previous read and at the epoch's start, so "overflow steps since the
last read" and "overflow steps in this epoch" are differences of the optimizer's own total.

Every read is one copy from the device, shared: the optimizer's state (and the counts of the
model's batch keeper, where one keeps) packed into one vector on the device and read once a
step per model (`SharedRead`, attached to the model, keyed by the `fit` and the steps taken in
it), whichever callbacks ask for it that step. A step where none is due reads nothing.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfmixprec._common.cadence import Every
from tfmixprec.fit.adoption import adopt_at_train_begin, adopt_when_set, loss_scaling_of
from tfmixprec.fit.overflow_batches import KEEPER_COUNTS, current_keeper
from tfmixprec.scaling.loss_scale import read_now, step_number
from tfmixprec.scaling.optimizer import STATE_NAMES, LossScaleOptimizer
from tfmixprec.scaling.state_guard import mark_unapplied_epoch

__all__: list[str] = []  # private module: nothing here is part of the package's API

# What the packed read holds beyond `read_state()`'s variables: the scale the last overflow
# used, then the step numbers, then the keeper's counts (`KEEPER_COUNTS`) where one keeps.
_EXTRA = ("last_overflow_scale",)
_STEPS = ("step", "last_overflow_step")


class SharedRead:
    """One model's packed read: the optimizer's state (`read_state()`'s values and the scale
    the last overflow used) and, where a batch keeper keeps, its counts, as one vector
    computed on the device and copied to the host once per `key` (the `fit` and the steps
    taken in it: a step's read serves every callback that asks after that step)."""

    def __init__(self) -> None:
        self._key: Any = None
        self._values: dict[str, Any] | None = None
        self._pack: Any = None
        self._pack_of: Any = None

    def forget(self) -> None:
        """After a write outside the step (a repair's scale, the guard's run reset): the next
        read reads again."""
        self._key = self._values = None

    def state(self, optimizer: Any, counts: Any, key: Any) -> dict[str, Any]:
        """The values now (one host read), or those read already under `key` (None: read)."""
        if key is not None and self._key is not None and self._values is not None:
            fit, steps, variable = self._key
            if fit is key[0] and steps == key[1] and variable is key[2]:
                return self._values
        if self._pack_of != (id(optimizer), id(counts)):
            self._pack, self._pack_of = _packer(optimizer, counts), (id(optimizer), id(counts))
        values = self._pack().numpy()  # the one copy to the host
        self._values = _unpacked(values, counts is not None)
        self._key = key
        return self._values


def _packer(optimizer: Any, counts: Any) -> Any:
    """A function of no arguments that packs the values `SharedRead` reads into one float64
    vector on the device (exact: the counters stay far below 2**53, the scale is a float32)."""
    variables = [getattr(optimizer, name) for name in STATE_NAMES + _EXTRA]

    @tf.function(autograph=False)
    def pack() -> tf.Tensor:
        values = [read_now(v) for v in variables]
        total, iterations = values[STATE_NAMES.index("overflow_steps")], optimizer.iterations
        values += [step_number(read_now(iterations), total), optimizer.last_overflow_step()]
        packed = tf.stack([tf.cast(v, tf.float64) for v in values])
        if counts is not None:
            packed = tf.concat([packed, tf.cast(read_now(counts), tf.float64)], 0)
        return packed

    return pack


def _unpacked(values: Any, counted: bool) -> dict[str, Any]:
    """The packed vector as `read_state()`'s dict (ints, and the scale a float), with
    `last_overflow_scale` and, where `counted`, the keeper's counts (`KEEPER_COUNTS`)."""
    names = STATE_NAMES + _EXTRA + _STEPS + (KEEPER_COUNTS if counted else ())
    state = {name: int(value) for name, value in zip(names, values.tolist())}
    state["loss_scale"] = float(values[0])
    state["last_overflow_scale"] = float(values[len(STATE_NAMES)])
    return state


def shared_read(model: Any) -> SharedRead:
    """The `SharedRead` of `model` (made at the first call): one per model, for every
    callback of every `fit` (a host-side attribute, as its repairs are)."""
    shared = vars(model).get("_tfmixprec_shared_read")
    if shared is None:
        shared = model.__dict__["_tfmixprec_shared_read"] = SharedRead()
    return shared


def check_min_scale(optimizer: Any, state: dict[str, Any]) -> None:
    """`optimizer.check_min_scale()` (warn or raise, per `on_min_scale`) where `state`, a
    shared read, counts overflow steps at `min_scale` since the scale last grew: its own read
    then only. The end of `fit` checks once more, whatever the reads saw."""
    if state["min_scale_overflows"] > 0:
        optimizer.check_min_scale()


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
        self._fit: Any = None  # what marks the `fit` in progress (None: outside one)
        self._last: dict[str, Any] | None = None
        self._epoch_start = 0
        self._epoch_start_applied = -1  # set at each epoch's begin
        self._logged: float | None = None  # the step's logs' overflow total, a host number
        self._looked: float | None = None  # that total at the last `overflowed()` that read

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

    def train_begin(self, fit: Any = None) -> LossScaleOptimizer | None:
        """From `on_train_begin`: the loss scaling (said once per model when there is none),
        the cadence started, the state read once as the first "previous read" (read afresh:
        a callback before this one may have restored or reset it). `fit` marks the `fit` (the
        `params` dict Keras gives each of its callbacks): the callbacks of one `fit` share
        each step's read; without it this reader shares none."""
        optimizer = adopt_at_train_begin(self.model, self.who)
        self.every.start()
        self._fit = fit if fit else object()
        self._logged = self._looked = None
        self._last = self.state(fresh=True) if optimizer is not None else None
        self._epoch_start = self._last["overflow_steps"] if self._last else 0
        self._looked = float(self._epoch_start) if self._last else None
        return optimizer

    def state(self, fresh: bool = False) -> dict[str, Any]:
        """The optimizer's state after the steps taken so far (`read_state()`'s values, the
        scale the last overflow used, and the keeper's counts where one keeps): this step's
        shared read, or one host read where no callback read it yet (`fresh`: always)."""
        keeper = current_keeper(self.model)
        counts = None if keeper is None else keeper.counts_variable()
        key = None if fresh or self._fit is None else (self._fit, self.every.steps, counts)
        shared = shared_read(self.model)
        if fresh:
            shared.forget()
        return shared.state(self.optimizer, counts, key)

    def forget(self) -> None:
        """After a write to the optimizer's state outside the step: every reader of the
        model reads it again."""
        shared_read(self.model).forget()

    def epoch_begin(self) -> None:
        """From `on_epoch_begin`: the cadence's epoch, and the epoch's first overflow total
        (the step's shared read)."""
        self.every.epoch_begin()
        if self.optimizer is not None:
            state = self.state()
            self._epoch_start = state["overflow_steps"]
            self._epoch_start_applied = state["iterations"]

    def epoch_end(self, logs: dict | None) -> None:
        """From `on_epoch_end`: an epoch in which every step was skipped (overflows, and the
        optimizer's `iterations` did not move) logs nan for its loss and metrics, not the 0 of
        an empty mean (`state_guard.mark_unapplied_epoch`; the step's shared read). Not with
        gradient accumulation: there an epoch of micro-batches may apply nothing and skip
        nothing, and a skipped window puts back its last micro-batch only."""
        optimizer = self.optimizer
        if optimizer is None or optimizer.accumulation_steps > 1:
            return
        state = self.state()
        skipped_all = state["iterations"] == self._epoch_start_applied
        if skipped_all and state["overflow_steps"] > self._epoch_start:
            mark_unapplied_epoch(self.model, logs)

    def batch_end(self, batch: int, logs: dict | None = None) -> bool:
        """From `on_train_batch_end`, first: counts the steps up to `batch` (Keras's index),
        notes the overflow total the step's logs hold as a host number (a
        `MixedPrecisionModel`'s step logs it), and says whether an `update_freq`-th step is
        among them (`due`)."""
        total = (logs or {}).get("overflow_steps") if isinstance(logs, dict) else None
        host = isinstance(total, (int, float)) and not isinstance(total, bool)
        self._logged = float(total) if host else None
        return self.every.due(batch)

    def due(self, batch: int) -> bool:
        """Whether an `update_freq`-th step is among the steps up to `batch` (`batch_end`
        without logs)."""
        return self.batch_end(batch)

    def overflowed(self) -> bool:
        """Whether a step overflowed since the last call that said so or read: no read where
        the step's logs hold the overflow total (unchanged: False), else the shared read."""
        if self._logged is not None and self._logged == self._looked:
            return False
        self._looked = self._logged
        return True

    def read(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The optimizer's state now and at the previous read (the step's shared read); needs
        loss scaling (`optimizer` not None)."""
        state = self.state()
        previous = self._last if self._last is not None else state
        self._last = state
        return state, previous

    def epoch_overflows(self, total: float | None = None) -> float:
        """Overflow steps in the epoch so far: `total` (the optimizer's, e.g. from the logs:
        no read) or the step's shared read, less the epoch's first."""
        if total is None:
            total = self.state()["overflow_steps"]
        return float(total - self._epoch_start)
