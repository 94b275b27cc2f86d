"""Repair during `fit`: the layers whose values pass float16's range move to float32, between
steps, and training goes on from the current weights.

`PrecisionRepair` costs little while nothing overflows: the step keeps the batch of an
overflow step on the device (`overflow_batches.OverflowBatches`: a scatter into variables, no
conditional and no host read in the step, with XLA or without), and after each batch the
callback reads the keeper's counts in the one read the callbacks share (`FitReader.state`),
after Keras's own read of the batch's logs. When overflows keep coming and the scale cannot
fix them (a run of `max_consecutive` overflow steps, judged again at every `max_consecutive`
more while it goes on, or an overflow at `min_scale`; both counted by the step in the
optimizer's variables), it replays the newest overflow step's batches
(`calibration.float32_set`):

- a forward overflow, or gradients not finite even unscaled, in layers that are finite in
  float32: those layers (the smallest set that makes the batches finite, with the 4x
  headroom of `calibration.HEADROOM`) move to float32, the loss scale restarts at the level
  the replay verifies (`calibration.starting_scale`), and the train function is traced again.
  The skipped steps changed nothing.
- NaN/Inf in the batch, or values that are not finite even in float32: not repaired; named
  in one line, and `OverflowGuard` decides.
- nothing: the overflow is the scaled gradients', and the dynamic scale absorbs it.

Across replicas and workers every replica's batch is replayed, and the verdicts are summed
over the strategy: every worker makes the same repair at the same step and restarts at the
same scale (the least the workers verify). The step is chosen from the optimizer's state,
which every worker shares.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._common.layers import all_layers, compiled_loss, layer_names, mark_float32
from tfmixprec._common.text import docs_page
from tfmixprec._common.validate import check_int_at_least_one
from tfmixprec._keras.fit import make_train_function
from tfmixprec._keras.losses import loss_dtype, set_loss_dtype
from tfmixprec.fit.overflow_batches import keep_for_callbacks, stop_keeping_for_callbacks
from tfmixprec.fit.reader import FitReader
from tfmixprec.precision.float8 import is_float8
from tfmixprec.replay.calibration_search import Float32Set, float32_set, starting_scale
from tfmixprec.replay.replayer import Replayer, move_to_float32, warn_not_recorded
from tfmixprec.scaling.loss_scale import format_scale

__all__ = ["PrecisionRepair", "Repair"]

# Causes that move nothing first (the first seen on any worker wins), then those repaired.
_CAUSES = (
    "bad-data",
    "not-precision",
    "loss-overflow",
    "model-code",
    "forward-overflow",
    "near-overflow",
    "backward-overflow",
)


# A judgment of cause "none": the replay is finite unscaled, only the scaled gradients were not.
NONE_MESSAGE = "only the scaled gradients overflowed, which the dynamic loss scale absorbs"


@dataclasses.dataclass(frozen=True)
class Repair:
    """One judgment of `PrecisionRepair`: a repair, or why there was none.

    Attributes:
        step: Int. The overflow step replayed (0-based, skipped steps counted).
        layers: Tuple of strings. The paths of the layers moved to float32 (empty: none).
        cause: String. `"forward-overflow"`, `"near-overflow"` or `"backward-overflow"`
            (repaired), `"loss-overflow"` (the loss overflows by itself: repaired where its
            `keras.losses.Loss` computes in float16 or bfloat16 by its own dtype, which moves
            to float32), `"bad-data"` or `"not-precision"` (not repaired), or `"none"`
            (not repaired: only the scaled gradients overflowed, and the scale absorbs it).
        message: String. What was found, in a sentence.
        loss_scale: Float. For a repair, the scale training goes on at: the largest the
            replay verifies finite with the layers moved (as `calibrate`'s `initial_scale`);
            the overflows before the repair had lowered it, for a cause now gone. 0: none (or
            a fixed scale, `dynamic=False`, which a repair leaves as it is).
        float8: Tuple of strings. Those of `layers` that are float8 layers: they compute in
            float32 and keep their float8 quantization (`float8_from_float32`). Keras
            cannot take a float8 layer back to its float16 policy in a `fit`: its float8
            variables would stay on it, and the saved model would not load.
        float32_loss: Bool. Whether the compiled loss now computes in float32 (its dtype was
            float16 or bfloat16, and it overflowed by itself).
    """

    step: int
    layers: tuple[str, ...]
    cause: str
    message: str
    loss_scale: float = 0.0
    float8: tuple[str, ...] = ()
    float32_loss: bool = False

    @property
    def repaired(self) -> bool:
        return bool(self.layers) or self.float32_loss

    def to_markdown(self) -> str:
        """The line and the layers, for TensorBoard's Text tab."""
        rows = [f"- `{layer}`{self._float8_note(layer)}" for layer in self.layers]
        rows += ["- the loss"] if self.float32_loss else []
        return "\n".join([f"**step {self.step}**: {self.line()}", "", *rows])

    def _float8_note(self, layer: str) -> str:
        return " (float8, quantization kept: float8_from_float32)" if layer in self.float8 else ""

    def line(self) -> str:
        if not self.repaired:
            return f"not repaired ({self.cause}): {self.message}"
        names = [f"{layer!r}{self._float8_note(layer)}" for layer in self.layers]
        names += ["the loss"] if self.float32_loss else []
        said = ", ".join(names)
        verb = "computes" if names == ["the loss"] else "compute"
        line = f"{said} now {verb} in float32 ({self.cause}: {self.message})"
        if self.loss_scale > 0:  # 0: a fixed scale, left as it was
            line += f"; the loss scale goes on from {format_scale(self.loss_scale)}"
        return line

    def __str__(self) -> str:
        return f"PrecisionRepair: step {self.step}: {self.line()}"


def repairs_of(model: Any) -> tuple[Repair, ...]:
    """The repairs made on `model` so far (in this process), oldest first."""
    return tuple(r for r in vars(model).get("_tfmixprec_repairs", ()) if r.repaired)


def _record(model: Any, repair: Repair) -> None:
    model.__dict__["_tfmixprec_repairs"] = (*vars(model).get("_tfmixprec_repairs", ()), repair)


@keras.saving.register_keras_serializable(package="tfmixprec")
class PrecisionRepair(keras.callbacks.Callback):
    """Repairs float16 overflows during `fit`: the layers whose values pass float16's range
    move to float32 between steps, and training goes on from the current weights.

    While nothing overflows it costs at most the one small read a batch that the tfmixprec
    callbacks share, after the step (no host wait inside it; none on a `MixedPrecisionModel`,
    whose step logs the overflow total). When overflows keep coming and the loss scale cannot
    fix them (`max_consecutive` overflow steps in a row, and every `max_consecutive` more while
    the run goes on, or one at `min_scale`), it replays the newest overflow step's batch
    outside training and moves the smallest set of layers that makes it finite to float32
    (see `tfmixprec.calibrate`), then traces the train function again. Bad data is named, not
    repaired (`OverflowGuard` decides), and overflows that the scale absorbs are left to the scale.

    Every judgment is in `judgments`, every repair in `repairs` (and printed in one line with
    `verbose=1`); the epoch's logs get `repairs`, the number made so far (a History key), and
    `tfmixprec.TensorBoard` writes each one as a `mixed_precision/repairs` text at its step.
    A repaired functional or Sequential model saves its new policies in its `.keras` file.
    A float8 layer (`tfmixprec.float8_layers`) that must move computes in float32 and keeps
    its float8 quantization (`float8_from_float32`), named as float8 in the repair: Keras
    cannot take it back to its float16 policy during `fit` (its float8 variables would stay
    on it, trained no more, and the saved model would not load with its optimizer).

    After a repair the loss scale goes on from the level the replay verifies finite with the
    layers moved (as `calibrate`'s `initial_scale`): the overflows had lowered it for a cause
    now gone.

    Needs a tfmixprec or Keras `LossScaleOptimizer` (adopted as the other callbacks do), one
    compiled loss and no gradient accumulation; without them it warns once and does nothing.
    It works with XLA (`jit_compile=True`, and Keras's default "auto", which compiles with
    XLA on a GPU): the step keeps the batch on the device, and the same layers are repaired
    at the same step as without XLA. Under a strategy of several replicas it needs a step
    without XLA (Keras's "auto" compiles none there).

    Args:
        max_repairs: Int >= 1. Repairs per `fit` at the most.
        max_consecutive: Int >= 1. Consecutive overflow steps before a replay.
        verbose: Int. 1 prints each judgment in one line.

    Raises:
        ValueError: If `max_repairs` or `max_consecutive` is not an integer >= 1.

    Example:

    >>> repair = tfmixprec.PrecisionRepair(max_repairs=3)
    >>> model.fit(x, y, callbacks=[repair]); repair.repairs
    """

    def __init__(self, max_repairs: int = 3, max_consecutive: int = 5, verbose: int = 1) -> None:
        super().__init__()
        self.max_repairs = check_int_at_least_one("max_repairs", max_repairs)
        self.max_consecutive = check_int_at_least_one("max_consecutive", max_consecutive)
        self.verbose = verbose
        self.repairs: list[Repair] = []
        self.judgments: list[Repair] = []
        self._reader = FitReader("PrecisionRepair", 1)
        self._keeper: Any = None
        self._seen = 0
        self._judged: Any = None
        self._loss_fn: Any = None

    def get_config(self) -> dict[str, Any]:
        return {
            "max_repairs": self.max_repairs,
            "max_consecutive": self.max_consecutive,
            "verbose": self.verbose,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PrecisionRepair:
        return cls(**config)

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self._reader.set_model(model)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.repairs, self.judgments, self._judged = [], [], None
        optimizer = self._reader.train_begin(self.params)
        self._keeper = self._loss_fn = None
        if optimizer is None:
            return  # said by the reader: no loss scaling, nothing is skipped
        try:
            self._loss_fn = compiled_loss(self.model, "PrecisionRepair")
        except ValueError as err:
            warnings.warn(f"{err} {docs_page('guides/repair')}", RuntimeWarning, stacklevel=2)
            return
        fit = self.params  # one dict per fit, shared by its callbacks
        self._keeper = keep_for_callbacks(
            self.model, 0, "PrecisionRepair", fit, True, "repair", "guides/repair"
        )
        self._seen = self._keeper.seen if self._keeper is not None else 0

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._keeper is not None:
            stop_keeping_for_callbacks(self.model)  # the callbacks' keeper goes dormant
        self._keeper = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._reader.epoch_begin()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._reader.epoch_end(logs)
        if logs is not None:
            logs["repairs"] = float(len(self.repairs))

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        keeper = self._keeper
        self._reader.batch_end(batch, logs)
        if keeper is None or not self._reader.overflowed():
            return  # none kept, or the step's logs say no step overflowed: nothing read
        state = self._reader.state()  # the step's shared read: the counts and the state
        seen = keeper.poll(self.model, state)
        if seen == self._seen:
            return  # no overflow kept since the last look
        self._seen = seen
        if len(self.repairs) >= self.max_repairs:
            return
        at_min = self._reader.optimizer.dynamic and state["min_scale_overflows"] > 0
        run = state["consecutive_overflows"]
        if run < self.max_consecutive and not at_min:
            return
        # Every `max_consecutive` overflows of a run (one judged "none", the scale's, does not
        # hide the forward overflows after it), again at min_scale, and after each repair.
        start = state["last_overflow_step"] - run + 1
        judged = (start, run // self.max_consecutive, at_min, len(self.repairs))
        if judged == self._judged or not keeper.latest:
            return
        self._judged = judged
        self._judge(state["last_overflow_step"], [kept.batch for kept in keeper.latest])

    def _judge(self, step: int, batches: list[tuple]) -> None:
        batches = [tuple(batch) + (None,) * (3 - len(batch)) for batch in batches]
        replayer = Replayer(self.model, batches, self._loss_fn)
        found = _agreed(self.model, _replayed(replayer, step))
        layers = [layer for layer, _ in found.layers]
        # The scale to go on at, with the agreed layers, on every worker's batches: the least.
        fixed = layers or found.loss is not None  # with the loss in float32: the replayer's
        scale = _least(self.model, _scale_with(replayer, layers, step) if fixed else 0.0)
        keys = layer_names(self.model)
        message = _message(found, keys)
        names = tuple(keys[id(layer)] for layer in layers)
        float8 = tuple(keys[id(layer)] for layer in layers if is_float8(layer))
        dynamic = self._reader.optimizer.dynamic  # a fixed scale is left as it is
        scale = scale if (layers or found.loss) and dynamic else 0.0
        loss = found.loss is not None and loss_dtype(self._loss_fn) is not None
        judgment = Repair(step, names, found.cause, message, scale, float8, loss)
        self.judgments.append(judgment)
        if judgment.repaired:
            if loss:  # the compiled loss is this object: Keras calls it as it is
                set_loss_dtype(self._loss_fn, "float32")
            recorded = move_to_float32(self.model, layers) if layers else True
            reason = f"PrecisionRepair at step {step} ({judgment.cause})"
            mark_float32(self.model, {layer: reason for layer in judgment.layers})
            if judgment.loss_scale > 0:
                self._reader.optimizer.restart_at(judgment.loss_scale)
                self._reader.forget()  # every callback reads the new scale
            make_train_function(self.model)
            self.repairs.append(judgment)
            _record(self.model, judgment)
            if not recorded:  # last: a warning turned error leaves nothing half-done
                warn_not_recorded(self.model, "PrecisionRepair", judgment.layers)
        if self.verbose:
            print(judgment)


def _message(found: Float32Set, keys: dict[int, str]) -> str:
    """What a judgment found, in a sentence: its problem, else the reason of what its cause
    moved first (the loss for `loss-overflow`, else the first layer)."""
    if found.cause == "none":
        return NONE_MESSAGE
    if found.problem is not None:
        return found.problem
    if found.loss is not None and (found.cause == "loss-overflow" or not found.layers):
        return found.loss
    if found.layers:
        layer, why = found.layers[0]
        return f"{keys[id(layer)]!r}: {why}"
    return "needed for another worker's batch"


def _replayed(replayer: Replayer, step: int) -> Float32Set:
    """This process's verdict on the kept batches; a replay that fails warns and repairs
    nothing (it never stops training)."""
    try:
        return float32_set(replayer)
    except Exception as err:  # noqa: BLE001 - a replay never stops training
        _warn_replay_failed(step, err)
        return Float32Set((), "not-precision", f"the replay failed: {type(err).__name__}")


def _scale_with(replayer: Replayer, layers: list[Any], step: int) -> float:
    """The scale to go on at with `layers` in float32 (`calibration.starting_scale`; 0 where
    the replay fails: the scale is left as it is)."""
    try:
        return starting_scale(replayer, layers)
    except Exception as err:  # noqa: BLE001 - a replay never stops training
        _warn_replay_failed(step, err)
        return 0.0


def _warn_replay_failed(step: int, err: Exception) -> None:
    warnings.warn(
        f"PrecisionRepair could not replay overflow step {step}, so it repairs nothing there "
        f"(training goes on): {type(err).__name__}: {str(err)[:300]} "
        f"{docs_page('guides/repair')}",
        RuntimeWarning,
        stacklevel=4,
    )


def _agreed(model: Any, found: Float32Set) -> Float32Set:
    """`found` summed over the strategy's workers: every worker gets the same verdict (bad
    data anywhere, else not-precision anywhere, else the union of the layers). One process
    (any number of replicas) replayed every replica's batch already."""
    strategy = model.distribute_strategy
    if not _workers(strategy) > 1:
        return found
    return _agreed_verdict(model, strategy, found)


def _least(model: Any, scale: float) -> float:
    """The least of the workers' scales (0: none), the same on every worker."""
    strategy = model.distribute_strategy
    if not _workers(strategy) > 1:
        return scale
    local = tf.constant([scale if scale > 0 else np.inf], tf.float32)
    least = float(np.min(np.asarray(strategy.gather(strategy.run(lambda: local), axis=0))))
    return least if np.isfinite(least) else 0.0


def _agreed_verdict(model: Any, strategy: Any, found: Float32Set) -> Float32Set:
    everything = all_layers(model)
    chosen = {id(layer) for layer, _ in found.layers}
    problem = found.problem is not None
    votes = [float(found.cause == cause and problem) for cause in _CAUSES]  # moves nothing
    votes += [float(found.cause == cause and not problem) for cause in _CAUSES]
    votes += [float(found.loss is not None)]
    votes += [float(id(layer) in chosen) for layer in everything]
    local = tf.constant(votes, tf.float32)
    total = strategy.reduce("SUM", strategy.run(lambda: tf.identity(local)), axis=None)
    total = np.asarray(total) > 0
    n = len(_CAUSES)
    unfixed = [cause for cause, anywhere in zip(_CAUSES, total[:n]) if anywhere]
    if unfixed:  # a problem on a worker: nothing moves anywhere (bad data first)
        mine = problem and found.cause == unfixed[0]
        return Float32Set((), unfixed[0], found.problem if mine else "seen on another worker")
    why = dict((id(layer), reason) for layer, reason in found.layers)
    layers = tuple(
        (layer, why.get(id(layer), "needed for another worker's batch"))
        for layer, wanted in zip(everything, total[2 * n + 1 :])
        if wanted
    )
    loss = found.loss or ("needed for another worker's batch" if total[2 * n] else None)
    seen = [cause for cause, anywhere in zip(_CAUSES, total[n : 2 * n]) if anywhere]
    return Float32Set(layers, seen[0] if seen else "none", None, loss)


def _workers(strategy: Any) -> int:
    """How many worker processes `strategy` spans (1 without a cluster)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    spec = resolver.cluster_spec().as_dict()
    return sum(len(tasks) for job, tasks in spec.items() if job in ("chief", "worker")) or 1
