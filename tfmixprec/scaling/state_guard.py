"""A skipped step changes no variable: the model's non-trainable state put back on a skip.

The optimizer leaves weights, slots and `iterations` alone on an overflow step, but the forward
pass has already run by then, and it writes state of its own: `BatchNormalization`'s moving
mean and variance (with NaN, on an overflow of float16 activations), a dropout layer's seed,
the running totals of the loss and metrics of `compile` (an epoch's mean loss `nan`).
`guard_state(model, optimizer)` reads that state before the step and, after it, assigns it
back where the optimizer skipped the step, in the graph (no host read): on a skipped step every
variable of the model is as it was, bit for bit; on an applied step the assignments write the
values the step made. `MixedPrecisionModel`'s `train_step`, `make_train_step` and the train
step of a plain model in `fit` with a tfmixprec callback use it; a custom loop wraps its step
in it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from tfmixprec._keras.fit import STEP_COMPILES_ITSELF, loss_tracker, update_each_copy
from tfmixprec.scaling.loss_scale import read_now
from tfmixprec.scaling.step_notes import written_since

__all__ = ["guard_state"]


def _restore(copy: Any, skipped: tf.Tensor, saved: tf.Tensor, now: Any = None) -> tf.Tensor:
    """`copy` put back to `saved` where `skipped` (`now`: its value, where known unread)."""
    value = tf.where(skipped, saved, read_now(copy) if now is None else now)
    copy.assign(value)
    return value


def guarded_variables(model: keras.Model) -> list[Any]:
    """What a skipped step puts back: the model's non-trainable variables (batch-norm
    statistics, seeds) and its metrics' (the loss and metrics of `compile`), so that an
    epoch's mean loss is the mean over the applied steps, not `nan` after one skipped batch."""
    found, seen = [], set()
    for variable in [*model.non_trainable_variables, *model.metrics_variables]:
        if id(variable) not in seen:
            seen.add(id(variable))
            found.append(variable)
    return found


class GuardedStep:
    """What `guard_state` yields: after the block, `skipped` holds the skip flag it read (a
    scalar bool tensor of this step), for the step's logs (`optimizer.snapshot(skipped)`);
    in a `tf.function`, `written` the ids of the variables the block may write (those put
    back) and, without a strategy, `restored` the value each of them holds now (by the
    variable's `id`), for the logs without a read. Eagerly both stay None."""

    def __init__(self) -> None:
        self.skipped: Any = None
        self.written: set[int] | None = None
        self.restored: dict[int, tf.Tensor] | None = None


@contextlib.contextmanager
def guard_state(model: keras.Model, optimizer: Any) -> Iterator[GuardedStep]:
    """Puts the model's non-trainable variables and its metrics' back as they were before the
    block if the optimizer skipped the step the block ran (`guarded_variables`).

    In a `tf.function` it puts back, with selects (no branch, so no host wait on a GPU), only
    those the block may write: a frozen layer's weights, which the step only reads, cost
    nothing. Eagerly it reads the skip flag and assigns when it is set.

    Use it inside the step, around the forward pass and `optimizer.apply` (eager or in a
    `tf.function`, under a strategy too: each replica puts back its own copies). With gradient
    accumulation a skipped window's last micro-batch is put back; the earlier micro-batches'
    state stays (a window is not one step of the forward pass). Variables created inside the
    block (an unbuilt model's first call, eagerly) are not known to it: build the model first.

    Args:
        model: `keras.Model`. Its `non_trainable_variables` and `metrics_variables` are
            guarded.
        optimizer: `tfmixprec.LossScaleOptimizer`. It says whether the step was skipped.

    Yields:
        A `GuardedStep`, whose `skipped` is the step's skip flag after the block.

    Raises:
        TypeError: If `optimizer` is not a tfmixprec `LossScaleOptimizer`.

    Example:

    >>> opt = tfmixprec.LossScaleOptimizer(keras.optimizers.SGD())
    >>> with tfmixprec.guard_state(model, opt):
    ...     with tf.GradientTape() as tape:
    ...         scaled = opt.scale_loss(loss_fn(y, model(x, training=True)))
    ...     opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)
    """
    if not callable(getattr(optimizer, "skipped", None)):
        raise TypeError(
            "guard_state needs the tfmixprec.LossScaleOptimizer that applies the step (it says "
            f"whether the step was skipped). Received: optimizer of type "
            f"{type(optimizer).__name__}"
        )
    variables = guarded_variables(model)
    saved = [read_now(variable) for variable in variables]
    first = (
        None if tf.executing_eagerly() else len(tf.compat.v1.get_default_graph().get_operations())
    )
    guarded = GuardedStep()
    yield guarded
    skipped = guarded.skipped = optimizer.skipped()
    if first is None:  # eagerly: the flag is on the host already
        if bool(skipped):
            for variable, value in zip(variables, saved):
                variable.assign(value)
        return
    # Only what the block may write (a frozen layer's weights are read, never written), with
    # selects, not a `cond`: on a GPU a `cond` outside XLA waits for its flag on the host.
    written, assigned = written_since(first, variables)
    guarded.written = written
    pairs = [(v, s) for v, s in zip(variables, saved) if id(v) in written]
    if tf.distribute.has_strategy():  # each replica its own copies, in one merge_call
        update_each_copy([(v, _restore, (skipped, s)) for v, s in pairs])
        return
    restored = {id(v): _restore(v, skipped, s, assigned.get(id(v))) for v, s in pairs}
    guarded.restored = restored


def guarded_step(model: keras.Model, step: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`step` (a `train_step`) inside `guard_state(model, model.optimizer)`: for a plain model
    in `fit` with a tfmixprec callback (the optimizer is read while tracing)."""

    def guarded(data: Any) -> Any:
        if not callable(getattr(model.optimizer, "skipped", None)):
            return step(data)  # compiled again with another optimizer: no step is skipped
        with guard_state(model, model.optimizer) as guarded:
            logs = step(data)
        return metrics_after_guard(model, logs, guarded)

    guarded.tfmixprec_guarded = True  # wrapped once
    guarded.__wrapped__ = step  # the step it guards (the user's own, if they set one)
    # A batch keeper's step inside compiles itself with XLA: so is it built (`_keras.fit`).
    setattr(guarded, STEP_COMPILES_ITSELF, getattr(step, STEP_COMPILES_ITSELF, False))
    return guarded


def metrics_after_guard(
    model: keras.Model, logs: Any, guarded: GuardedStep | None = None, every_result: bool = False
) -> Any:
    """A step's `logs` with the model's metric results read again after `guard_state`: the
    running means over the applied steps (a skipped step's values put back; read inside the
    block they still held its nan), and nan while no step of the epoch was applied (the mean
    of nothing, where Keras's `Mean` says 0), where the step counts its loss in Keras's own
    loss tracker. Keys that are not metric results stay. `guarded`: what the guard yielded;
    the loss's mean is then the total over the count it put back (0 / 0: nan), with no read,
    unless the model has its own `get_metrics_result`. `every_result`: the step left its
    results out of `logs` (`results_after_guard`): each one is added, in `model.metrics`'s
    order, before the other keys."""
    if not isinstance(logs, dict):
        return logs
    tracker, count = _loss_count(model, guarded)
    restored = {} if guarded is None or guarded.restored is None else guarded.restored
    results = _results_after_guard(model, tracker, restored)
    made = {}  # whether no step of the epoch was applied: made once, where a result needs it

    def nan_if_nothing(value: tf.Tensor) -> tf.Tensor:
        if not value.dtype.is_floating:
            return value
        if not made:
            now = restored[id(count)] if id(count) in restored else read_now(count)
            made["nothing"] = tf.equal(now, 0)
        return tf.where(made["nothing"], tf.constant(float("nan"), value.dtype), value)

    def fresh(key: str, value: Any) -> Any:
        if key in results:  # a result (a metric's own dict of them, too)
            value, put_back = results[key]
            if put_back or count is None:
                return value
            return tf.nest.map_structure(nan_if_nothing, value)
        if isinstance(value, dict):  # a nested log (`compile_metrics`): its results again
            return {k: fresh(k, v) for k, v in value.items()}
        return value

    keys = [*results, *(k for k in logs if k not in results)] if every_result else logs
    return {key: fresh(key, logs.get(key)) for key in keys}


# Per thread (each replica traces in its own): the model whose step is being traced inside
# `results_after_guard`, whose `get_metrics_result` then returns nothing.
_RESULTS_LATER = threading.local()


def defers_results(model: keras.Model) -> bool:
    """Whether `model`'s step can leave its metric results to `metrics_after_guard`: its
    `get_metrics_result` asks `results_deferred` (tfmixprec's), no class of its own defines
    another (`own_results`) or its own `compute_metrics` (which may use them), and none below
    tfmixprec's in the bases defines a `train_step` (which would get no results)."""
    cls = type(model)
    if own_results(cls) or cls.compute_metrics is not keras.Model.compute_metrics:
        return False
    mro = cls.__mro__
    marked = [i for i, k in enumerate(mro) if getattr(_defined(k), KERAS_RESULTS, False)]
    below = mro[marked[0] + 1 :] if marked else ()
    return bool(marked) and not any("train_step" in vars(k) and not _kerass(k) for k in below)


def own_results(cls: type) -> bool:
    """Whether a class among `cls`'s bases, other than Keras's own, defines a
    `get_metrics_result` of its own (not tfmixprec's, which returns Keras's results)."""
    return any(
        _defined(k) is not None and not _kerass(k) and not getattr(_defined(k), KERAS_RESULTS, 0)
        for k in cls.__mro__
    )


def _defined(cls: type) -> Any:
    return vars(cls).get("get_metrics_result")


def _kerass(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "keras"


@contextlib.contextmanager
def results_after_guard(model: keras.Model) -> Iterator[None]:
    """Around Keras's `train_step` inside `guard_state`, for a model that `defers_results`:
    its `get_metrics_result` returns nothing there, so that the step reads each result once,
    after the guard (`metrics_after_guard(..., every_result=True)`), not also before it."""
    before = getattr(_RESULTS_LATER, "model", None)
    _RESULTS_LATER.model = model
    try:
        yield
    finally:
        _RESULTS_LATER.model = before


def results_deferred(model: keras.Model) -> bool:
    """Whether `model`'s step is being traced (or run eagerly) inside `results_after_guard` in
    this thread: its `get_metrics_result` then returns `{}`."""
    return getattr(_RESULTS_LATER, "model", None) is model


# Marks a `get_metrics_result` that returns Keras's own results (or none, `results_deferred`).
KERAS_RESULTS = "tfmixprec_keras_results"


def _loss_count(model: keras.Model, guarded: GuardedStep | None) -> tuple[Any, Any]:
    """Keras's loss tracker and its count, where the step counts its loss there (the guard
    saw the step write it; without a guard, wherever the model has one): a custom step that
    keeps its own trackers leaves it at 0, which says nothing of the steps applied."""
    tracker = loss_tracker(model)
    if tracker is None:
        return None, None
    written = None if guarded is None else guarded.written
    if written is not None and id(tracker.count) not in written:
        return tracker, None
    return tracker, tracker.count


def _results_after_guard(
    model: keras.Model, tracker: Any, restored: dict[int, tf.Tensor]
) -> dict[str, tuple[tf.Tensor, bool]]:
    """Each metric result (as `get_metrics_result`) and whether it is nan already where no
    step was applied: the loss's, from the total and count the guard put back (`restored`),
    is their quotient, 0 / 0 = nan (Keras's `Mean` divides with no nan: 0). A model with its
    own `get_metrics_result` gets its own results."""
    parts = [restored.get(id(v)) for v in (tracker.total, tracker.count)] if tracker else [None]
    if None in parts or own_results(type(model)):
        return {k: (_tensors(v), False) for k, v in model.get_metrics_result().items()}
    results = {}
    for metric in model.metrics:  # as Keras's `get_metrics_result`, in its order
        if metric is tracker:
            results[tracker.name] = (parts[0] / tf.cast(parts[1], parts[0].dtype), True)
            continue
        result = metric.result()
        result = result if isinstance(result, dict) else {metric.name: result}
        results.update({k: (_tensors(v), False) for k, v in result.items()})
    return results


def _tensors(result: Any) -> Any:
    """A result as tensors: a metric's result may be a dict of them (Keras logs it nested)."""
    return tf.nest.map_structure(tf.convert_to_tensor, result)


def mark_unapplied_epoch(model: keras.Model, logs: dict | None) -> None:
    """For the end of an epoch in which no step was applied (every one skipped and put back):
    the epoch's training metric results in `logs` become nan. Keras reads them again from its
    metrics, whose means of nothing say 0, which would make a diverged epoch look perfect;
    the `val_` results of a validation after it stay."""
    if logs is None:
        return
    for key in model.get_metrics_result():
        if key in logs:
            logs[key] = float("nan")
