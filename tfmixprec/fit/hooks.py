"""The hooks tfmixprec adds to a `fit`: the watch and progress bar of
`MixedPrecisionModel.fit`, and the replay of kept overflow batches behind the callbacks'
`diagnose=`."""

from __future__ import annotations

import warnings
from typing import Any

import keras

from tfmixprec._common.text import docs_page
from tfmixprec.fit.overflow_batches import (
    current_keeper,
    keep_for_callbacks,
    stop_keeping_for_callbacks,
)
from tfmixprec.fit.reader import FitReader, check_min_scale
from tfmixprec.replay.diagnosis import OverflowDiagnosis, explain_overflow
from tfmixprec.scaling.optimizer import LossScaleOptimizer

__all__: list[str] = []  # private module: nothing here is part of the package's API


class Diagnoser:
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
        self._done = 0  # replayed in this fit
        self._slot = 0  # the keeper's next slot (of its first `limit`) to replay
        self._seen = 0  # the keeper's count of kept overflow steps at the last look
        self._said = False

    def start(self, callback: Any, optimizer: LossScaleOptimizer | None) -> None:
        """Keeps overflow batches for this `fit` in the step of `callback`'s model (any
        model); nothing to keep without a tfmixprec `LossScaleOptimizer` (no step is skipped
        then). A keeper of the user's (`keep_overflow_batches`) filled before this `fit`
        serves it from its newest overflow step's slot."""
        self._keeper, self._done, self._slot, self._seen = None, 0, 0, 0
        self._said = False
        if not self.limit or optimizer is None:
            return
        # Keras gives every callback of one fit the same `params` dict: it marks the fit.
        fit = callback.params
        self._keeper = keep_for_callbacks(callback.model, self.limit, self.who, fit)
        if self._keeper is not None:
            self._seen = self._keeper.seen
            self._slot = min(self._seen, self._keeper.limit)

    def new(self, model: Any, reader: FitReader) -> list[tuple[int, OverflowDiagnosis]]:
        """Diagnoses of the overflow steps kept since the last call: the keeper's counts from
        `reader`'s shared read of the step (none where the step's logs say no step
        overflowed; a batch copied only when it is new). A batch that cannot be replayed ends
        the replay for this `fit` with a warning; it never stops training."""
        if self._keeper is None or self._done >= self.limit or not reader.overflowed():
            return []
        keeper = self._keeper
        seen = keeper.poll(model, reader.state())  # the rows grown where a batch did not fit
        fresh = keeper.kept_from(self._slot, seen)[: self.limit - self._done]
        self._slot += len(fresh)
        beyond = seen - self._seen - (min(seen, keeper.limit) - min(self._seen, keeper.limit))
        self._seen = seen
        if beyond > 0 and self._done + len(fresh) < self.limit:
            fresh += self._newest(keeper, beyond)
        self._done += len(fresh)
        found = []
        for kept in fresh:
            try:
                found.append((kept.step, explain_overflow(model, kept.batch, scale=kept.scale)))
            except (TypeError, ValueError) as err:
                warnings.warn(
                    f"{self.who} could not replay overflow step {kept.step}, so diagnose= is "
                    f"off for the rest of this fit (training goes on): {err} "
                    f"{docs_page('guides/why-overflow')}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._done = self.limit
                break
        return found

    def _newest(self, keeper: Any, beyond: int) -> list[Any]:
        """For `beyond` overflow steps past the keeper's first slots (a keeper of the user's,
        filled in an earlier `fit`): the newest one's batch; where that leaves some out (several
        in one execution), said once a `fit`."""
        newest = keeper.latest[:1]
        missed = beyond - len(newest)
        if missed > 0 and not self._said:
            self._said = True
            warnings.warn(
                f"{self.who}: diagnose={self.limit} replays {len(newest)} of {beyond} overflow "
                f"steps taken since the last batch end: the model's own keeper "
                f"(keep_overflow_batches({keeper.limit})) is full and keeps only the newest "
                "one's batch. Call keep_overflow_batches(0) before fit to let diagnose= keep "
                f"its own. {docs_page('guides/why-overflow')}",
                RuntimeWarning,
                stacklevel=3,
            )
        return newest

    def stop(self, model: Any) -> None:
        if self._keeper is not None:
            stop_keeping_for_callbacks(model)
        self._keeper = None


def record_stop(model: Any, step: int, message: str) -> None:
    """Records that `OverflowGuard` stopped training `model` after `step` steps (its
    `stopped_step`: steps attempted, skipped ones counted), for `tfmixprec.TensorBoard`'s
    events (a host-side list on the model)."""
    model.__dict__["_tfmixprec_stops"] = (*stops_of(model), (step, message))


def stops_of(model: Any) -> tuple[tuple[int, str], ...]:
    """The `OverflowGuard` stops of `model` so far (in this process), oldest first: each
    `(stopped_step, message)`."""
    return tuple(vars(model).get("_tfmixprec_stops", ()))


class FitWatch(keras.callbacks.Callback):
    """Added first to `MixedPrecisionModel.fit`'s callbacks: puts the epoch's number of overflow
    steps in the epoch logs as `overflow` (so History, CSVLogger and the progress bar show it),
    and reports a `min_scale` overflow (`on_min_scale`) every `update_freq` batches and at
    epoch end, so `"raise"` stops `fit` promptly. Its reads are the step's shared read
    (`FitReader.state`)."""

    def __init__(self, update_freq: int = 50) -> None:
        super().__init__()
        self.update_freq = update_freq
        self.reader = FitReader("MixedPrecisionModel.fit", update_freq)  # the bar's too

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self.reader.set_model(model)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.reader.train_begin(self.params)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.reader.epoch_begin()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        due = self.reader.batch_end(batch, logs)
        if due:
            check_min_scale(self.model.optimizer, self.reader.state())
        keeper = current_keeper(self.model)
        if keeper is not None and keeper.owner == "user" and self.reader.overflowed():
            # `keep_overflow_batches`: the rows grown where a batch did not fit.
            keeper.poll(self.model, self.reader.state())

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["overflow"] = self.reader.epoch_overflows()
        check_min_scale(self.model.optimizer, self.reader.state())


# What the progress bar leaves out: totals since the optimizer was created, kept in the logs
# (History, CSVLogger) but not what a person watches while training.
NOT_ON_THE_BAR = ("overflow_steps", "skipped_fraction")


class ProgressBar(keras.callbacks.ProgbarLogger):
    """Keras's progress bar for `MixedPrecisionModel.fit`, showing of the loss-scale values
    only what a person watches: `loss_scale`, and `overflow` as the epoch's number of overflow
    steps so far, once there is one (Keras prints a 0 as `0.0000e+00`). The logs that History,
    CSVLogger and the other callbacks see are not changed. `reader` is the `FitWatch`'s, which
    runs first and reads the epoch's starting total once."""

    def __init__(self, reader: FitReader) -> None:
        super().__init__()
        self._reader = reader

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        logs = dict(logs or {})
        if "overflow_steps" in logs:
            logs["overflow"] = self._reader.epoch_overflows(logs["overflow_steps"])
        super().on_train_batch_end(batch, bar_view(logs))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, bar_view(dict(logs or {})))


def bar_view(logs: dict) -> dict:
    """`logs` without the totals, and without `overflow` while it is 0."""
    view = {k: v for k, v in logs.items() if k not in NOT_ON_THE_BAR}
    if not view.get("overflow", 1):
        del view["overflow"]
    return view
