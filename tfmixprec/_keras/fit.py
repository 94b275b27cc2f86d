"""`fit` as tfmixprec hooks into it through Keras internals: the train step replaced and
the train function built around a step that compiles itself with XLA, multi-worker `fit`,
no epoch left suspended when `fit` ends, TensorBoard's writer and step, the XLA context and
the traced train functions."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

# Why: keras-team/keras#20585 (see `MultiWorkerFit`): tfmixprec's fix must apply exactly where
# Keras's trainer takes its multi-worker path, so it asks Keras's own test.
from keras.src.backend.tensorflow.trainer import (
    _collective_all_reduce_multi_worker as _keras_multi_worker,
)

# Why: see `in_xla_context`.
from tensorflow.python.ops.control_flow_util import (
    GraphOrParentsInXlaContext as _xla_context,
)

from tfmixprec._keras.graph import every_layer_built
from tfmixprec._keras.patches import patch, undo_all

__all__: list[str] = []  # private module: nothing here is part of the package's API


# Why: `tfmixprec.TensorBoard` extends `keras.callbacks.TensorBoard` and writes its summaries
# into the same run, at the same batch steps; Keras keeps the writer and counters private.
def tensorboard_writer(callback: Any) -> Any:
    """The train-run summary writer of a `keras.callbacks.TensorBoard`."""
    return callback._train_writer


def tensorboard_step(callback: Any) -> int:
    """The global train-batch counter a `keras.callbacks.TensorBoard` writes batch steps at."""
    return callback._global_train_batch


@contextlib.contextmanager
def tensorboard_log_dir(callback: Any, directory: str | None) -> Iterator[None]:
    """Inside: `callback.log_dir` is `directory` (None: left alone), then the user's again.

    Why: `keras.callbacks.TensorBoard.set_model` derives its run folders (`train`,
    `validation`) from `log_dir` and keeps them privately; a worker other than the chief must
    write into a folder of its own without changing the `log_dir` the user reads and
    `get_config` saves."""
    log_dir = callback.log_dir
    if directory is not None:
        callback.log_dir = directory
    try:
        yield
    finally:
        callback.log_dir = log_dir


def loss_tracker(model: Any) -> Any:
    """The `keras.metrics.Mean` behind the `loss` of `fit`'s logs (its `total` and `count`),
    or None.

    Why: Keras keeps that metric as the private `_loss_tracker`; its count says whether any
    step of the epoch was applied (after a skipped step is put back), where its result alone
    reads 0 for no step at all."""
    tracker = getattr(model, "_loss_tracker", None)
    return tracker if isinstance(tracker, keras.metrics.Mean) else None


def loss_tracker_count(model: Any) -> Any:
    """The step count of `loss_tracker(model)`, or None."""
    return getattr(loss_tracker(model), "count", None)


def tensorboard_batch_work(callback: Any) -> bool:
    """Whether Keras's own `on_train_batch_end` would write anything (else it is skipped)."""
    return bool(
        callback.update_freq != "epoch"
        or callback._should_write_train_graph
        or callback._should_trace
        or callback.write_steps_per_second
    )


def across_workers(strategy: Any) -> bool:
    """True under a `MultiWorkerMirroredStrategy` with more than one worker: where Keras's TF
    trainer takes its multi-worker path (Keras's own test, so the fix below applies exactly
    there)."""
    return bool(_keras_multi_worker(strategy))


def _as_vector(value: Any) -> Any:
    if isinstance(value, tf.Tensor) and value.shape.rank == 0:
        return tf.reshape(value, [1])
    return value


@contextlib.contextmanager
def epochs_closed(model: Any) -> Iterator[None]:
    """Around a `fit` of `model` (any Keras model): no epoch of that `fit` is left suspended
    when it ends, so the data iterator of a `fit` left early goes when `fit` returns.

    Why: Keras's `TFEpochIterator` keeps its epoch's generator (`_enumerate_iterator`) in the
    private `_epoch_iterator`, and the generator's frame keeps the epoch iterator: a
    reference cycle whenever `fit` leaves an epoch before its end (a callback such as
    `OverflowGuard` sets `stop_training`, or a callback or the step raises). The cycle holds
    the epoch's `tf.data` iterator, its prefetched batches and its autotune thread until
    Python's next full collection, which can come minutes later; freeing an autotuned
    iterator that old can then wait up to a minute for its autotune thread (TF 2.21).
    Closing the generator (what `for` does at an epoch's end) ends the cycle. Keras hands
    each epoch iterator it makes to `_maybe_symbolic_build`, patched here to note them
    (weakly); an outer `fit`'s are left to it."""
    noted: weakref.WeakSet = weakref.WeakSet()

    def make(build: Any) -> Any:
        def noting(*args: Any, **kwargs: Any) -> Any:
            iterator = kwargs.get("iterator", args[0] if args else None)
            if iterator is not None:
                noted.add(iterator)
            return build(*args, **kwargs)

        return noting

    handle = patch(model, "_maybe_symbolic_build", "epochs closed", make, raw=True)
    try:
        yield
    finally:
        handle.undo()
        for epochs in list(noted):
            generator = getattr(epochs, "_epoch_iterator", None)
            if inspect.isgenerator(generator):
                generator.close()


class BuiltBeforeTrace:
    """Builds a built model's compiled metrics and loss before `fit` traces its step, on one
    device too, as Keras does under a distribution strategy. Put it before `keras.Model` in a
    model class's bases; the class marks its `train_step` with `STANDARD_STEP`.

    Why: Keras's TF trainer builds them from the first batch (`_maybe_symbolic_build` ->
    `_symbolic_build`) only where the model has a strategy (`_distribute_strategy`); with
    none, they are made in the step's first trace, and TensorFlow, seeing variables made,
    traces the step again. This builds them from the data's spec (the epoch iterator's
    dataset, `_distributed_dataset`: no batch is read), where nothing can differ from the
    trace's build (`_can_build_first`); anywhere else, and where the build raises, they are
    left to the trace, as Keras leaves them on one device.
    """

    def _maybe_symbolic_build(self, iterator: Any = None, data_batch: Any = None) -> Any:
        if iterator is not None and data_batch is None and self._distribute_strategy is None:
            spec = iterator._distributed_dataset.element_spec  # a batch's shapes, unread
            if _can_build_first(self, spec):
                try:
                    self._symbolic_build(data_batch=spec)
                except Exception:  # noqa: BLE001 (the trace builds them, and says what fails)
                    pass
                return None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)


# On a model class's `train_step`: Keras's step (unpacks the batch, calls the model, then
# the compiled loss and metrics), so that a symbolic pass builds what its trace would.
STANDARD_STEP = "tfmixprec_standard_step"


def _can_build_first(model: Any, spec: Any) -> bool:
    """Whether `model`'s first trace would make variables (compiled metrics not built yet,
    or the loss of a model of several outputs: a `Mean` a loss) that a symbolic pass of
    `spec` makes the same: the model and its optimizer built (`fit` builds the optimizer
    first; an `evaluate` before any `fit` leaves it unbuilt), a graph step (not
    `run_eagerly`), the class's step Keras's own, and batches of dense tensors of known rank
    in at most `(x, y, sample_weight)` (no `None`, ragged or sparse value)."""
    optimizer = getattr(model, "optimizer", None)
    if model.run_eagerly or (optimizer is not None and not optimizer.built):
        return False
    if not getattr(type(model).train_step, STANDARD_STEP, False):
        return False
    leaves = tf.nest.flatten(spec)
    if isinstance(spec, (tuple, list)) and len(spec) > 3:
        return False
    dense = all(type(v) is tf.TensorSpec and v.shape.rank is not None for v in leaves)
    if not dense or not every_layer_built(model):
        return False
    metrics, loss = model._compile_metrics, model._compile_loss
    if metrics is not None and not metrics.built:
        return True
    outputs = getattr(model, "outputs", None) or ()
    return loss is not None and not loss.built and len(outputs) > 1


class MultiWorkerFit:
    """Makes Keras's own `fit`, `evaluate` and `predict` run under `MultiWorkerMirroredStrategy`
    across workers: keras-team/keras#20585, tensorflow/tensorflow#72388 (open; Keras 3.12 to
    3.15). Put it before `keras.Model` in a model class's bases. Keras's loop is kept.

    Why: Keras's TF trainer fails across workers in two places, both private:

    - `_maybe_symbolic_build` builds the model from the first batch, which it first reduces
      across replicas with `strategy.reduce("MEAN", batch, axis=None)` in eager mode; a
      collective strategy cannot reduce eager per-replica values ("Attempt to convert a value
      (PerReplica...) ... to a Tensor"). Only the batch's shapes matter: this builds from this
      worker's own first batch.
    - `_make_function`'s step reduces each log with `strategy.reduce("MEAN", value, axis=0)`
      across workers (its `reduce_per_replica`), which needs a batch axis: a scalar loss fails
      ("axis = 0 out of range for value with rank 0"). Here the step's scalar logs are
      vectors of one entry, so that reduction is the mean over the replicas, the value Keras
      logs on one machine. `predict` (a concatenation) needs no change.
    """

    def _maybe_symbolic_build(self, iterator: Any = None, data_batch: Any = None) -> Any:
        strategy = self.distribute_strategy
        if iterator is not None and data_batch is None and across_workers(strategy):
            local = strategy.experimental_local_results
            for _, _, batches in iterator:
                data_batch = tf.nest.map_structure(lambda v: local(v)[0], next(batches))
                break
            iterator = None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _make_function(self, step_function: Any) -> Any:
        if not across_workers(self.distribute_strategy):
            return super()._make_function(step_function)

        def step_with_vector_logs(data: Any) -> Any:
            return tf.nest.map_structure(_as_vector, step_function(data))

        return super()._make_function(step_with_vector_logs)


def update_each_copy(updates: Sequence[tuple[Any, Any, tuple]]) -> None:
    """For each `(variable, fn, args)`, calls `fn(copy, *args)` on this replica's own copy of
    the variable (on every copy in cross-replica context), in order, with one `merge_call` at
    the most for all of them: the copies of a mirrored variable then differ (each replica's
    running sum), and nothing crosses replicas.

    Why: `tf.distribute.StrategyExtended.update` does this for one variable, through a
    `merge_call` of its own under strategies that need one (MirroredStrategy and
    MultiWorkerMirroredStrategy without XLA); whether one is needed is TensorFlow's internal
    `strategy_supports_no_merge_call` (as Keras's own gradient accumulators do).

    Args:
        updates: `(variable, fn, args)` triples: a Keras or TF variable created in the
            strategy's scope, a callable `(tf.Variable, *args) -> op`, and a tuple of
            per-replica values (possibly empty).
    """
    targets = [(v.value if isinstance(v, keras.Variable) else v, fn) for v, fn, _ in updates]
    # Each update's args as one tuple: merge_call regroups nested tuples leaf by leaf.
    all_args = tuple(tuple(args) for _, _, args in updates)

    def update(distribution: Any, *per_update_args: tuple) -> None:
        for (target, fn), args in zip(targets, per_update_args):
            distribution.extended.update(target, fn, args=args, group=False)

    strategy = tf.distribute.get_strategy()
    no_merge = tf.__internal__.distribute.strategy_supports_no_merge_call()
    if tf.distribute.in_cross_replica_context() or no_merge:
        update(strategy, *all_args)
    else:
        tf.distribute.get_replica_context().merge_call(update, args=all_args)


def replace_train_step(model: Any, make_step: Any, who: str = "overflow keeper") -> None:
    """Makes `model`'s step, from its next trace on, the function `make_step(step)` returns
    for the step below it (a patch of `tfmixprec._keras.patches`, made by `who`, over what the
    model has: the class's `train_step`, a user's own, set before or since, the state
    guard's); `make_step=None` takes `who`'s patch out.

    Why: Keras traces `model.train_step` into its train function and offers no hook inside
    the step; tfmixprec's `diagnose=` keeps the batch of an overflow step there, on any model
    (a KerasHub task model's `train_step` is Keras's own). An instance attribute wins over
    the class's method for this model alone: its class, saved config and other models are
    untouched. The caller retraces (`make_train_function(force=True)`).
    """
    undo_all(model, "train_step", who)
    if make_step is not None:
        patch(model, "train_step", who, make_step)


# On a `train_step` that compiles itself with XLA where the model asks for XLA: the train
# function around it is built without XLA (`make_train_function`).
STEP_COMPILES_ITSELF = "tfmixprec_compiles_itself"


def make_train_function(model: Any) -> None:
    """`model.make_train_function(force=True)`; where the model's `train_step` compiles
    itself with XLA (it carries `STEP_COMPILES_ITSELF`) and the model asks for XLA, the train
    function Keras builds around it is built without XLA.

    Why: Keras compiles its per-batch function, `train_step` included, with XLA when
    `model.jit_compile` is set, and reads that setting only when it builds the train function
    (`_make_function`, Keras 3.12 to 3.15). XLA compiles a variable's shape into the step;
    tfmixprec's batch keeper (`overflow_batches`) grows its rows in the step where a batch is
    larger, so it runs just outside the XLA step: the step is XLA's as Keras would compile it,
    and the model's setting is put back right after the build.
    """
    jit = model.jit_compile
    outside = jit and getattr(model.train_step, STEP_COMPILES_ITSELF, False)
    if outside:
        model.jit_compile = False
    try:
        model.make_train_function(force=True)
    finally:
        if outside:
            model.jit_compile = jit


def trace_again(model: Any) -> None:
    """Has Keras trace again, at their next call, the train, test and predict functions a
    compiled model has already traced (a CPU route changes what a layer computes, and a
    traced function keeps running the layers' calls as they were traced).

    Why: Keras keeps them in `train_function` / `test_function` / `predict_function` and
    builds them again only when asked with `force=True` (Keras 3.12 to 3.15); the train
    function through `make_train_function`, which keeps its XLA setting.
    """
    if getattr(model, "train_function", None) is not None:
        make_train_function(model)
    for kind in ("test", "predict"):
        if getattr(model, f"{kind}_function", None) is not None:
            getattr(model, f"make_{kind}_function")(force=True)


def in_xla_context() -> bool:
    """Whether the function being traced now is compiled with XLA (inside a
    `tf.function(jit_compile=True)`, or called from one); False when eager.

    Why: TensorFlow says so only through its internal `control_flow_util`, which its own
    `tf.while_loop` asks to lower a loop for XLA.
    """
    if tf.executing_eagerly():
        return False
    return bool(_xla_context(tf.compat.v1.get_default_graph()))


def traced_train_functions(model: Any) -> list[Any]:
    """The concrete functions Keras has traced for `model.train_function`: those of its
    per-execution `tf.function` (the per-batch step, XLA-compiled or not, is a function called
    inside), or, where Keras called the per-batch step alone, the step's.

    Why: Keras returns a plain Python function from `_make_function` that calls its
    `tf.function`s, closure variables: Keras 3.12 to 3.15 always `multi_step_on_iterator`
    with the iterator; Keras 3.16 calls the per-batch `one_step_on_data` (wrapped by
    `_autoconvert_optionals` in a Python function, its `step_func`) directly when
    `steps_per_execution` is 1. The traced graphs are reachable only through those closures
    and TensorFlow's private list of a `tf.function`'s concrete functions.
    """
    function = getattr(model, "train_function", None)
    if not inspect.isfunction(function):
        return []  # none yet, or one set by the user (not Keras's)
    closure = inspect.getclosurevars(function).nonlocals
    for name in ("multi_step_on_iterator", "one_step_on_data"):
        traced = closure.get(name)
        if inspect.isfunction(traced):  # Keras's `_autoconvert_optionals` wrapper
            traced = inspect.getclosurevars(traced).nonlocals.get("step_func")
        if traced is not None and hasattr(traced, "_list_all_concrete_functions"):
            concrete = list(traced._list_all_concrete_functions())
            if concrete:
                return concrete
    return []  # run eagerly: nothing traced


def compiled_with_xla(traced: Any) -> bool:
    """Whether a concrete function of `traced_train_functions` is itself compiled with XLA
    (Keras 3.16's per-batch step, traced alone, under `jit_compile=True`): then every op in it
    runs inside one XLA cluster. Read from its function definition's `_XlaMustCompile`, the
    attribute TensorFlow marks a call of such a function with."""
    attr = traced.function_def.attr.get("_XlaMustCompile")
    return bool(attr is not None and attr.b)
