"""Every use of Keras internals (`keras.src`, private attributes and hooks), each with its reason.

A Keras release that changes one of these touches this file only. Minimum versions: see
`pyproject.toml` (CI also runs the optimizer and training tests on them).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

# Why: keras-team/keras#20585 (see `MultiWorkerFit`): tfmixprec's fix must apply exactly where
# Keras's trainer takes its multi-worker path, so it asks Keras's own test.
from keras.src.backend.tensorflow.trainer import (
    _collective_all_reduce_multi_worker as _keras_multi_worker,
)

# Why: Keras makes `Model(inputs, outputs)` functional by rewriting the class's bases in
# place; `MixedPrecisionModel.__new__` routes functional use to its own subclass instead, so
# it needs Keras's test for functional arguments and the Functional class.
from keras.src.models.functional import Functional  # noqa: F401  (re-exported)
from keras.src.models.model import functional_init_arguments  # noqa: F401  (re-exported)

# Why: the optimizer's `build` sets attributes that Keras's tracker must not collect twice
# (the parent `LossScaleOptimizer.build` is decorated the same way).
from keras.src.utils.tracking import no_automatic_dependency_tracking  # noqa: F401

# Why: see `in_xla_context`.
from tensorflow.python.ops.control_flow_util import (
    GraphOrParentsInXlaContext as _xla_context,
)

from tfmixprec._patches import patch, patches_of, undo_all

__all__: list[str] = []  # private module: nothing here is part of the package's API


def all_sublayers(model: Any) -> list[Any]:
    """Every layer inside `model`, nested ones included, in Keras's own order.

    Why: `Layer._flatten_layers` is the only walk that reaches layers nested in subclassed
    models and in attributes; there is no public equivalent.
    """
    return list(model._flatten_layers(include_self=False, recursive=True))


def producing_layer(tensor: Any) -> Any:
    """The layer (Keras operation) that produced a symbolic tensor of a functional model, or None.

    Why: Keras records it only in the tensor's private `_keras_history`; the public
    `model.outputs` carry no link back to their layers.
    """
    history = getattr(tensor, "_keras_history", None)
    return None if history is None else history.operation


def producing_output_index(tensor: Any) -> int | None:
    """Which output of its producing layer a symbolic tensor is (a nested model's outputs are
    numbered in `keras.tree.flatten` order), or None.

    Why: as `producing_layer`, Keras keeps it only in the private `_keras_history`.
    """
    history = getattr(tensor, "_keras_history", None)
    return None if history is None else history.tensor_index


def build_shapes(model: Any) -> dict[str, Any] | None:
    """The input shapes a subclassed model was built with (`{argument name: shape}`), or None.

    Why: Keras keeps them only in the private `_build_shapes_dict`; `model.inputs` is empty for
    subclassed models.
    """
    return getattr(model, "_build_shapes_dict", None)


def built_variables(optimizer: Any) -> list[Any]:
    """The variables a built Keras optimizer was built with.

    Why: Keras keeps them only in the private `_trainable_variables`; tfmixprec's
    `LossScaleOptimizer.from_keras` builds its replacement of a used Keras
    `LossScaleOptimizer` for the same variables.
    """
    return list(optimizer._trainable_variables)


def set_compiled_optimizer(model: Any, optimizer: Any) -> None:
    """Makes `model.save` write `optimizer` as the compiled optimizer.

    Why: Keras writes the optimizer it was given at `compile()`, kept in the private
    `_compile_config`, and `load_model` compiles with it again; after the callbacks replace
    Keras's `LossScaleOptimizer` by tfmixprec's, the file must name the new one, else the
    loaded model gets Keras's again and the saved optimizer variables do not fit it.
    """
    config = getattr(model, "_compile_config", None)
    if config is not None:
        config.config["optimizer"] = optimizer


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


# Why: the audit reads a `.keras` archive as Keras's saving library lays it out (its
# `saving_lib`): the model's config and its variables, with the optimizer's in a group of its
# own (an `inner_optimizer` group inside it for a loss-scale wrapper).
ARCHIVE_CONFIG = "config.json"
ARCHIVE_WEIGHTS = "model.weights.h5"


def saved_optimizer_wrapped(weights: Any) -> bool | None:
    """Whether the optimizer state in an open `model.weights.h5` (an `h5py.File`) is a
    loss-scale wrapper's (it has an inner optimizer), or None when it holds none."""
    if "optimizer" not in weights:
        return None
    return "inner_optimizer" in weights["optimizer"]


def loss_tracker_count(model: Any) -> Any:
    """The step count of the `Mean` behind the `loss` of `fit`'s logs, or None.

    Why: Keras keeps that metric as the private `_loss_tracker`; its count says whether any
    step of the epoch was applied (after a skipped step is put back), where its result alone
    reads 0 for no step at all."""
    tracker = getattr(model, "_loss_tracker", None)
    return getattr(tracker, "count", None)


def tensorboard_batch_work(callback: Any) -> bool:
    """Whether Keras's own `on_train_batch_end` would write anything (else it is skipped)."""
    return bool(
        callback.update_freq != "epoch"
        or callback._should_write_train_graph
        or callback._should_trace
        or callback.write_steps_per_second
    )


class KerasLossScaleHooks(keras.optimizers.LossScaleOptimizer):
    """Keras's `LossScaleOptimizer`, with its private hooks mapped onto named methods.

    Why: Keras's `apply` (`_tf_apply`) does the finite check and the apply/skip `cond` in a
    cross-replica context under strategies that need `merge_call`; a `cond` in replica context
    whose branch calls the inner optimizer is not allowed. So tfmixprec keeps Keras's `apply`
    and its structure, and maps its private parts onto named methods that subclasses
    implement: `check_step` (the finite check, with per-variable flags), `apply_finite_step`
    and `skip_step`. Keras 3.12 to 3.15 have the same `_tf_apply`. `apply_when` runs the same
    step only at the end of an accumulation window (the `cond` on the window, like the one on
    the finite flag, in cross-replica context where the strategy needs it).
    """

    def check_step(self, grads: Sequence[Any], trainable_variables: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def apply_finite_step(self, grads: Sequence[Any], trainable_variables: Any) -> None:
        raise NotImplementedError

    def skip_step(self, evidence: Any = None) -> None:
        raise NotImplementedError

    # Why: Keras's `_tf_apply` asks `check_finite(grads)` for one bool, so its skip branch
    # cannot know which variables' gradients were not finite (the gradients' variables are
    # not passed to `check_finite`). This keeps Keras's structure (a `merge_call` and the
    # `cond` in cross-replica context where the strategy needs it) with `check_step`, which
    # also returns the per-variable flags, and hands them to the skip branch.
    def _tf_apply(self, grads: Sequence[Any], trainable_variables: Any = None) -> None:
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._checked_step(grads, trainable_variables)
            return

        def in_cross_replica(distribution: Any, grads: Any, variables: Any) -> None:
            self._cross_replica_step(distribution, (grads, variables), lambda g, v: (g, v))

        tf.distribute.get_replica_context().merge_call(
            in_cross_replica, args=(grads, trainable_variables)
        )

    def apply_when(self, ready: Any, window: Any, clear: Any) -> None:
        """If `ready`, applies or skips the gradients `window()` returns, as `apply` does,
        then calls `clear()`; else does nothing.

        For gradient accumulation: `ready` (a scalar bool every replica computes alike) says
        the window is full; `window()` returns `(grads, variables)`, each replica's own (read
        from its accumulators, in that replica's context). Nothing crosses replicas unless
        `ready`; then, as in `apply`, the finite flags and the gradients are all-reduced once.
        `clear()` runs in replica or in cross-replica context.
        """
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        if tf.__internal__.distribute.strategy_supports_no_merge_call():

            def step() -> None:
                self._checked_step(*window())
                clear()

            with tf.name_scope("accumulation_window"):
                tf.cond(ready, step, lambda: None)
            return

        def in_cross_replica(distribution: Any, ready: Any) -> None:
            def step() -> None:
                self._cross_replica_step(distribution, (), window)
                clear()

            with tf.name_scope("accumulation_window"):
                tf.cond(distribution.experimental_local_results(ready)[0], step, lambda: None)

        tf.distribute.get_replica_context().merge_call(in_cross_replica, args=(ready,))

    def _checked_step(self, grads: Any, variables: Any) -> None:
        """In replica context: the finite check, then apply or skip."""
        finite, evidence = self.check_step(grads, variables)
        with tf.name_scope("apply_or_skip"):
            tf.cond(
                finite,
                lambda: self.apply_finite_step(grads, variables),
                lambda: self.skip_step(evidence),
            )

    def _cross_replica_step(self, distribution: Any, args: tuple, step_args: Any) -> None:
        """In cross-replica context: each replica checks `step_args(*its args)`; the `cond`
        is here, since a `cond` in replica context must not call `merge_call` (the inner
        optimizer does)."""
        each_replica = distribution.extended.call_for_each_replica
        checked = each_replica(lambda *a: self.check_step(*step_args(*a)), args=args)
        # Every replica computed the same values (the flags are all-reduced).
        finite, evidence = (distribution.experimental_local_results(v)[0] for v in checked)

        def apply_fn() -> None:
            each_replica(lambda *a: self.apply_finite_step(*step_args(*a)), args=args)

        with tf.name_scope("apply_or_skip"):
            tf.cond(finite, apply_fn, lambda: self.skip_step(evidence))

    # Keras's hooks (called from `LossScaleOptimizer._common_apply` / `_tf_apply`).
    def _stateful_handle_finite_grads(self, grads: Sequence[Any], trainable_variables: Any) -> None:
        self.apply_finite_step(grads, trainable_variables)

    def _stateful_handle_non_finite_grads(self) -> None:
        self.skip_step()

    # Why: TensorFlow checkpoints (`tf.train.Checkpoint`) reach an optimizer's variables
    # through Keras's private `_variables` list, by position: a tfmixprec release that added
    # a state variable shifted the rest, and a checkpoint of one release restored into the
    # wrong variables of the next (0.2.0 into 0.3.0: a shape error). Every tfmixprec state
    # variable is also an attribute of its loss-scale unit or its accumulator (tracked by
    # name: `_loss_scale/overflow_steps`, ...), and Keras's own two by `_iterations` and
    # `_learning_rate`: without the positional list, a checkpoint of any release restores
    # each variable by its name, and what an older one lacks stays as it is.
    # Keras's own LossScaleOptimizer also tracks its two variables by name (`step_counter`,
    # `dynamic_scale`): under those names a checkpoint of Keras's restores into tfmixprec's.
    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict:
        children = dict(super()._trackable_children(save_type, **kwargs))
        children.pop("_variables", None)
        children.update(step_counter=self.step_counter, dynamic_scale=self.dynamic_scale)
        return children

    # Why: Keras keeps these as private helpers of the base optimizer.
    def tracked_variables(self) -> list[Any]:
        """The variables the optimizer was built with."""
        return list(self._trainable_variables)

    def variable_index(self, variable: Any) -> int:
        """The position of `variable` among `tracked_variables()`."""
        return self._get_variable_index(variable)

    def overwrites_with_gradient(self, variable: Any) -> bool:
        """True for variables whose "gradient" is a new value (float8 scale/amax variables)."""
        return bool(self._overwrite_variable_with_gradient(variable))


def across_workers(strategy: Any) -> bool:
    """True under a `MultiWorkerMirroredStrategy` with more than one worker: where Keras's TF
    trainer takes its multi-worker path (Keras's own test, so the fix below applies exactly
    there)."""
    return bool(_keras_multi_worker(strategy))


def _as_vector(value: Any) -> Any:
    if isinstance(value, tf.Tensor) and value.shape.rank == 0:
        return tf.reshape(value, [1])
    return value


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
    for the step below it (a patch of `tfmixprec._patches`, made by `who`, over what the
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
    """The concrete functions Keras has traced for `model.train_function` (its per-execution
    `tf.function`; the per-batch step, XLA-compiled or not, is a function called inside).

    Why: Keras 3.12 to 3.15 return a plain Python function from `_make_function` that calls
    its `tf.function` (`multi_step_on_iterator`, a closure variable) with the iterator; the
    traced graphs are reachable only through that closure and TensorFlow's private list of a
    `tf.function`'s concrete functions.
    """
    function = getattr(model, "train_function", None)
    if not inspect.isfunction(function):
        return []  # none yet, or one set by the user (not Keras's)
    traced = inspect.getclosurevars(function).nonlocals.get("multi_step_on_iterator")
    if traced is None or not hasattr(traced, "_list_all_concrete_functions"):
        return []  # run eagerly: nothing traced
    return list(traced._list_all_concrete_functions())


# Why: an inference call of a model replaces the losses its layers added with `add_loss` (Keras
# keeps them in the private `_losses`, read by `model.losses`); tfmixprec's observing call puts
# them back as they were.
def call_losses(layer: Any) -> list[Any]:
    """The losses `layer` added in its last call (`add_loss`)."""
    return list(getattr(layer, "_losses", []))


def set_call_losses(layer: Any, losses: list[Any]) -> None:
    """Puts back what `call_losses` returned."""
    if hasattr(layer, "_losses"):
        layer._losses[:] = losses


# Why: `tfmixprec.cpu_float16` computes a float16 layer's product in float32 (TensorFlow's
# float16 CPU kernels are slow; benchmarks/RESULTS.md, 2b). Keras's `Dense`, `EinsumDense`
# and convolution layers have no hook for the product's dtype, so these re-implement their
# `call` (Keras 3.12 to 3.15) with the product in float32 and the rest as Keras does it.
def float32_product_call(layer: Any, inputs: Any, training: Any = None) -> Any:
    """`Dense.call` / `EinsumDense.call` with the product in float32.

    The kernel is read in float16 first, so its gradient passes a float16 cast and overflows
    where a float16 product's would; bias and activation stay in float16, as in Keras.
    """
    kernel = tf.cast(keras.ops.cast(layer.kernel, layer.compute_dtype), tf.float32)
    inputs = tf.cast(inputs, tf.float32)
    if isinstance(layer, keras.layers.EinsumDense):
        x = tf.einsum(layer.equation, inputs, kernel)
    else:
        x = keras.ops.matmul(inputs, kernel)
    x = tf.cast(x, layer.compute_dtype)
    if layer.bias is not None:
        x = keras.ops.add(x, layer.bias)
    if layer.activation is not None:
        x = layer.activation(x)
    return x


def _read_in_float32(layer: Any, variable: Any) -> tf.Tensor:
    """A kernel read in the compute dtype, then cast to float32: its gradient passes a
    float16 cast and overflows where a float16 product's would."""
    return tf.cast(keras.ops.cast(variable, layer.compute_dtype), tf.float32)


def _convolution_in_float32(layer: Any, inputs: tf.Tensor) -> tf.Tensor:
    """The convolution of `layer`'s own `call` (Keras's `Conv1D`, transposed, depthwise and
    separable convolutions call `keras.ops` directly, not `convolution_op`), in float32."""
    ops, common = keras.ops, dict(padding=layer.padding, data_format=layer.data_format)
    if isinstance(layer, keras.layers.SeparableConv1D | keras.layers.SeparableConv2D):
        depthwise = _read_in_float32(layer, layer.depthwise_kernel)
        pointwise = _read_in_float32(layer, layer.pointwise_kernel)
        return ops.separable_conv(
            inputs, depthwise, pointwise, layer.strides, dilation_rate=layer.dilation_rate, **common
        )
    kernel = _read_in_float32(layer, layer.kernel)
    if isinstance(layer, keras.layers.DepthwiseConv1D | keras.layers.DepthwiseConv2D):
        return ops.depthwise_conv(
            inputs, kernel, layer.strides, dilation_rate=layer.dilation_rate, **common
        )
    if "Transpose" in type(layer).__name__:
        return ops.conv_transpose(
            inputs,
            kernel,
            list(layer.strides),
            output_padding=layer.output_padding,
            dilation_rate=layer.dilation_rate,
            **common,
        )
    if layer.padding == "causal":  # Conv1D: pad the past, as Keras's own call does
        left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
        axis = 1 if layer.data_format == "channels_last" else 2
        inputs = ops.pad(inputs, [(left, 0) if i == axis else (0, 0) for i in range(3)])
        common["padding"] = "valid"
    return ops.conv(
        inputs, kernel, list(layer.strides), dilation_rate=layer.dilation_rate, **common
    )


def float32_convolution_call(layer: Any, inputs: Any) -> Any:
    """A convolution layer's `call` (one that does not use `convolution_op`) with the
    convolution in float32; bias and activation in float16, as in Keras."""
    x = tf.cast(_convolution_in_float32(layer, tf.cast(inputs, tf.float32)), layer.compute_dtype)
    if layer.bias is not None:
        channels = (layer.bias.shape[0],)
        shape = (1,) * (layer.rank + 1) + channels
        if layer.data_format != "channels_last":
            shape = (1,) + channels + (1,) * layer.rank
        x = keras.ops.add(x, keras.ops.reshape(layer.bias, shape))
    if layer.activation is not None:
        x = layer.activation(x)
    return x


# Why: `tfmixprec.cpu_bfloat16` computes a `ReversibleEmbedding`'s reverse projection (a
# language model's logits, its largest matmul) in the layer's compute dtype. Keras does not
# autocast an embedding's variables, so under `mixed_bfloat16` its `call(reverse=True)`
# multiplies bfloat16 activations by the float32 table, and the product runs in float32.
# Its public `reverse_dtype` would change that, but it is saved in the layer's config and
# leaves the logits in bfloat16; this re-implements Keras's reverse `call` (Keras 3.12 to
# 3.15; a Keras without `keras.layers.ReversibleEmbedding` has nothing routed) with the product
# in the compute dtype and the logits returned in float32, as Keras returns them.
REVERSIBLE_EMBEDDING = getattr(keras.layers, "ReversibleEmbedding", None)


def reverse_called(layer: Any) -> bool | None:
    """Whether a functional model calls `layer` with `reverse=True` (Keras keeps each
    symbolic call in the private `_inbound_nodes`, with its arguments); None when the layer
    has no symbolic calls (a subclassed model's: it may be)."""
    nodes = getattr(layer, "_inbound_nodes", None) or []
    if not nodes:
        return None
    return any(bool(node.arguments.kwargs.get("reverse", False)) for node in nodes)


def compute_dtype_reverse_call(layer: Any, inputs: Any, reverse: bool = False) -> Any:
    """`ReversibleEmbedding.call` with the reverse product in the layer's compute dtype."""
    if not reverse:
        return type(layer).call(layer, inputs, reverse=False)
    # bfloat16 only: under another policy (a layer moved to float16 later) the product stays
    # in float32, as Keras computes it against the float32 table.
    dtype = "bfloat16" if layer.compute_dtype == "bfloat16" else "float32"
    if layer.tie_weights:
        kernel = keras.ops.transpose(keras.ops.cast(layer.embeddings, dtype))
    else:
        kernel = keras.ops.cast(layer.reverse_embeddings, dtype)
    logits = keras.ops.cast(keras.ops.matmul(keras.ops.cast(inputs, dtype), kernel), "float32")
    if layer.logit_soft_cap is not None:
        cap = layer.logit_soft_cap
        logits = keras.ops.multiply(keras.ops.tanh(keras.ops.divide(logits, cap)), cap)
    return logits


# Why: `tfmixprec.cpu_float16` computes attention's score and value products in float32: in
# float16 they run TensorFlow's Eigen einsum and batched matmul, not oneDNN's (on a GPT-2
# step, 199 ms of op time against 145 for the same products in float32). Keras's
# `MultiHeadAttention` computes them in `_compute_attention`, which its docstring invites
# subclasses to override (Keras 3.12 to 3.15); this runs Keras's own with the projected
# query, key and value cast to float32, and casts the output back, on Keras's explicit path
# only (dropout, attention scores returned, or not 4-D): there the softmax layer casts the
# scores to its float16 policy, so a score past 65504 is `inf`, as in float16. On its other
# path (`ops.dot_product_attention`, no softmax layer) float32 scores could not overflow, so
# that path runs in float16, as Keras runs it.
def float32_attention(
    layer: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
) -> Any:
    """`MultiHeadAttention._compute_attention` with the products in float32."""
    returns_scores = kwargs.get("return_attention_scores", args[2] if len(args) > 2 else False)
    if not (layer._dropout > 0.0 or returns_scores or len(query.shape) != 4):
        return type(layer)._compute_attention(layer, query, key, value, *args, **kwargs)
    output, scores = type(layer)._compute_attention(
        layer,
        tf.cast(query, tf.float32),
        tf.cast(key, tf.float32),
        tf.cast(value, tf.float32),
        *args,
        **kwargs,
    )
    return tf.cast(output, layer.compute_dtype), scores


# Why: Keras's float8 `Dense` / `EinsumDense` quantize inside their private `_float8_call`,
# which has no hook to see the tensors it quantizes. `tfmixprec.float8` counts, in the step,
# the values that saturate or round to zero: this replaces `_float8_call` on the instance (the
# class, the config and the saved file are untouched) with one that hands `forward` the
# inputs and the kernel first (read from `_kernel`, as Keras does) and, for that call only,
# puts `output` in front of the layer's activation. `output` then sits after the bias, where
# the gradient is the one Keras quantizes to e5m2 right after its product (adding a bias does
# not change a gradient). Replica threads call it one at a time; the lock makes sure of it.
# The swap lasts one Python call of the layer, i.e. while a training function is traced: a
# `get_config()` from another thread at that moment would see the wrapper (not guarded).
# Keras 3.12 to 3.15 call `self._float8_call(inputs, training=...)` from `quantized_call`.
def watch_float8_call(layer: Any, forward: Any, output: Any) -> None:
    original = type(layer)._float8_call.__get__(layer)
    lock = threading.Lock()

    def call(inputs: Any, training: Any = None, **kwargs: Any) -> Any:
        if not training:
            return original(inputs, training=training, **kwargs)
        forward(inputs, layer._kernel)
        with lock, _before_activation(layer, output):
            return original(inputs, training=training, **kwargs)

    patch(layer, "_float8_call", _FLOAT8_WATCH, lambda _: call, raw=True)


_FLOAT8_WATCH = "float8 counters"  # who patches a float8 layer's `_float8_call` to count


def _before_activation(layer: Any, output: Any) -> Any:
    """A `with` patch: for the block, `output` sits in front of `layer`'s activation (after
    its bias)."""

    def make(activation: Any) -> Any:
        return output if activation is None else (lambda x: activation(output(x)))

    return patch(layer, "activation", "float8 output watch", make, raw=True)


def float8_call_watched(layer: Any) -> bool:
    """Whether `watch_float8_call` replaced `layer`'s `_float8_call`."""
    return bool(patches_of(layer, "_float8_call", _FLOAT8_WATCH))


# Why: a replay outside the step (`diagnosis`, `calibration`) differentiates a float8 layer's
# call eagerly and looks at the tensors it quantizes, and Keras's float8 `Dense` /
# `EinsumDense` allow neither: their private `_float8_call` hands its variables themselves to
# `ops.custom_gradient`, whose eager form then finds variables read inside and asks Keras's
# gradient functions for their gradients (`variables=`), which they do not give ("too many
# values to unpack"; `fit` works: a `tf.function` traces it another way), and the output
# gradient it quantizes exists only inside it. Within the block, each float8 layer of
# `layers` runs the class's `_float8_call` (so the in-step counters of `watch_float8_call`
# count no replay) with those variables read through a `keras.StatelessScope`, mapped to
# their values read under the caller's tape (the gradients reach the variables as in the
# step); `output(layer, x)` sits before the activation, as in `watch_float8_call`, and
# `seen(layer, inputs, result)` follows the call. Keras 3.12 to 3.15 read `_kernel` and the
# six `*_scale` / `*_amax_history` variables there. Callers hold `_layers.CALLS_LOCK` (they
# run inside `watch_leaf_calls`).
FLOAT8_VARIABLES = (
    "inputs_scale",
    "inputs_amax_history",
    "kernel_scale",
    "kernel_amax_history",
    "outputs_grad_scale",
    "outputs_grad_amax_history",
)


@contextlib.contextmanager
def float8_replayed(layers: Sequence[Any], seen: Any, output: Any) -> Iterator[None]:
    quantized = [x for x in layers if getattr(x, "quantization_mode", None) == "float8"]
    with contextlib.ExitStack() as patches:
        for layer in quantized:
            call = _replayed_call(layer, seen, output)
            made = patch(layer, "_float8_call", "float8 replay", lambda _, c=call: c, raw=True)
            patches.callback(made.undo)
        yield


def _replayed_call(layer: Any, seen: Any, output: Any) -> Any:
    original = type(layer)._float8_call.__get__(layer)

    def call(inputs: Any, training: Any = None, **kwargs: Any) -> Any:
        variables = [layer._kernel, *(getattr(layer, name) for name in FLOAT8_VARIABLES)]
        values = [(v, tf.identity(tf.convert_to_tensor(v.value))) for v in variables]
        with _before_activation(layer, lambda x: output(layer, x)):
            with keras.StatelessScope(state_mapping=values):
                result = original(inputs, training=training, **kwargs)
        seen(layer, (inputs,), result)
        return result

    return call


# Why: Keras names a float8 layer's scale and amax-history variables `<tensor>_scale` and
# `<tensor>_amax_history` (`FLOAT8_VARIABLES`) and marks them `overwrite_with_gradient`: the
# optimizer assigns their "gradient", the new scale or history (a non-finite amax lands
# there). A report names the quantized tensor such a variable belongs to.
def float8_variable_role(variable: Any) -> str | None:
    """`"outputs_grad amax history"`, `"inputs scale"`, ... for a float8 layer's scale or
    amax-history variable; None for any other variable."""
    name = getattr(variable, "name", "").rsplit("/", 1)[-1].split(":")[0]
    if not getattr(variable, "overwrite_with_gradient", False) or name not in FLOAT8_VARIABLES:
        return None
    for kind in ("_amax_history", "_scale"):
        if name.endswith(kind):
            return f"{name[: -len(kind)]} {kind[1:].replace('_', ' ')}"
    return None
