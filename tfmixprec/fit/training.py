"""The mixed-precision `train_step` for `model.fit`, and helpers for GradientTape loops.

The step is Keras's own: forward pass under the model's policy, loss in float32, scaled by
`optimizer.scale_loss`; `optimizer.apply` unscales in float32, checks once for Inf/NaN, clips
(the inner optimizer's clipping) after unscaling, then applies or skips through the loss-scale
state machine. The logs gain the optimizer's `snapshot()`: `loss_scale`, `overflow`,
`overflow_steps`, `skipped_fraction`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf
from keras import ops

from tfmixprec._common.layers import iter_layers
from tfmixprec._common.text import docs_page
from tfmixprec._keras.fit import STANDARD_STEP, BuiltBeforeTrace, MultiWorkerFit, epochs_closed
from tfmixprec._keras.graph import Functional, functional_init_arguments
from tfmixprec._keras.losses import as_compiled
from tfmixprec.fit.hooks import FitWatch, ProgressBar
from tfmixprec.fit.overflow_batches import (
    OverflowBatches,
    cannot_keep_batches,
    set_keeper,
    stop_keeping_for_callbacks,
)
from tfmixprec.precision import cpu_bfloat16, cpu_float16
from tfmixprec.scaling.loss_scale import default_config
from tfmixprec.scaling.optimizer import LossScaleOptimizer, build_before_fit
from tfmixprec.scaling.optimizer_args import resolve_optimizer
from tfmixprec.scaling.state_guard import (
    KERAS_RESULTS,
    defers_results,
    guard_state,
    metrics_after_guard,
    results_after_guard,
    results_deferred,
)

__all__ = [
    "MixedPrecisionMixin",
    "MixedPrecisionModel",
    "MixedPrecisionFunctional",
    "compute_unscaled_gradients",
    "make_train_step",
]

LOSS_SCALING = ("auto", "dynamic", "none")


def _computes_in(model: Any, dtype: str) -> bool:
    if model.dtype_policy.compute_dtype == dtype:
        return True
    return any(layer.dtype_policy.compute_dtype == dtype for layer in iter_layers(model))


def _layers_compute_in(model: Any, dtype: str) -> bool:
    """Whether a layer of `model` computes in `dtype`, judged by its layers alone: the model's
    own policy follows the global policy where it was built or loaded (a float16 model loaded
    under `mixed_bfloat16` has a bfloat16 model policy), and an `InputLayer` computes nothing."""
    return any(
        layer.dtype_policy.compute_dtype == dtype
        for layer in iter_layers(model)
        if not isinstance(layer, keras.layers.InputLayer)
    )


def route_slow_cpu_kernels(model: Any) -> None:
    """float16 without a GPU: the remapper off, convolution/Dense products in float32
    (`cpu_float16`); bfloat16 layers on a CPU: the routes of `cpu_bfloat16`. What `compile`
    and `make_train_step` do to a model (`tfmixprec bench` too); nothing on a GPU."""
    if _computes_in(model, "float16"):
        cpu_float16.route_around_fused_matmul("mixed_float16")
        cpu_float16.fast_float16_layers(model)
    cpu_bfloat16.fast_bfloat16_layers(model)


def _ensure_loss_scale_optimizer(
    optimizer: Any,
    float16: bool,
    loss_scaling: str = "auto",
    accumulation_steps: int = 1,
) -> LossScaleOptimizer:
    """Returns a tfmixprec `LossScaleOptimizer` for `optimizer`, never wrapping twice.

    A tfmixprec optimizer is returned as it is (an unbuilt one with `accumulation_steps=1`
    takes the `accumulation_steps` asked for here). Keras's own (unbuilt) `LossScaleOptimizer` is
    replaced by a tfmixprec one with the same inner optimizer and settings. Anything else is
    wrapped: with a dynamic scale for float16 (`loss_scaling="auto"` or `"dynamic"`), and with
    a fixed scale of 1 otherwise (no scaling, but Inf/NaN steps are still skipped and counted).

    Args:
        optimizer: `keras.optimizers.Optimizer` or its name.
        float16: Bool. Whether the model computes in float16.
        loss_scaling: String. `"auto"`, `"dynamic"` (also for bfloat16/float32) or `"none"`
            (a fixed scale of 1 even for float16).
        accumulation_steps: Int. Passed to a new wrapper; must match an existing one.

    Returns:
        A `tfmixprec.LossScaleOptimizer`.
    """
    if loss_scaling not in LOSS_SCALING:
        raise ValueError(
            f"loss_scaling must be one of {list(LOSS_SCALING)}. "
            f"Received: loss_scaling={loss_scaling!r}"
        )
    if isinstance(optimizer, LossScaleOptimizer):
        return _with_accumulation(optimizer, accumulation_steps)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if optimizer.built:
            raise ValueError(
                "Received a Keras LossScaleOptimizer that has already been used (its scale "
                "state exists). Pass its inner optimizer, or a tfmixprec.LossScaleOptimizer. "
                f"Received: optimizer={optimizer!r}"
            )
        return LossScaleOptimizer.from_keras(optimizer, accumulation_steps=accumulation_steps)
    config = default_config(loss_scaling == "dynamic" or (loss_scaling == "auto" and float16))
    return LossScaleOptimizer(
        optimizer,
        initial_scale=config.initial_scale,
        dynamic=config.dynamic,
        accumulation_steps=accumulation_steps,
    )


def _optimizer_for(
    model: Any, optimizer: Any, loss_scaling: str = "auto", accumulation_steps: int = 1
) -> LossScaleOptimizer:
    """The tfmixprec optimizer `compile` and `make_train_step` use for `model` (see
    `_ensure_loss_scale_optimizer`); float16 layers on a CPU get the fast products. A dynamic
    scale given for a bfloat16 model is kept, with one warning that it is not needed."""
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):  # the user's name
        optimizer = resolve_optimizer(optimizer, "optimizer")
    float16 = _computes_in(model, "float16")
    given = optimizer
    optimizer = _ensure_loss_scale_optimizer(optimizer, float16, loss_scaling, accumulation_steps)
    bfloat16_only = _layers_compute_in(model, "bfloat16") and not _layers_compute_in(
        model, "float16"
    )
    if optimizer is given and optimizer.dynamic and bfloat16_only:
        warnings.warn(
            "The model computes in bfloat16, whose range is float32's: it needs no loss "
            "scaling, yet its tfmixprec.LossScaleOptimizer has a dynamic scale from "
            f"{optimizer.loss_scale_config.initial_scale:g}. Pass the plain optimizer (e.g. "
            "compile(optimizer='adam')): tfmixprec then uses a fixed scale of 1, which still "
            f"skips Inf/NaN steps. {docs_page('guides/fit-and-callbacks')}",
            UserWarning,
            stacklevel=3,
        )
    route_slow_cpu_kernels(model)
    return optimizer


def _with_accumulation(optimizer: LossScaleOptimizer, steps: int) -> LossScaleOptimizer:
    """A tfmixprec optimizer as it is; an unbuilt one without accumulation takes `steps`."""
    if steps != 1 and optimizer.accumulation_steps == 1 and not optimizer.built:
        optimizer.accumulation_steps = steps
    elif steps != 1 and optimizer.accumulation_steps != steps:
        raise ValueError(
            f"The optimizer already has accumulation_steps={optimizer.accumulation_steps}; "
            "set it on the optimizer or here, not both differently. Received: "
            f"accumulation_steps={steps!r}"
        )
    return optimizer


def _with_fit_watch(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`fit`'s arguments with a `FitWatch` first among the callbacks (positional or not), so
    that every other callback, History and the progress bar see the epoch's overflow count, and
    tfmixprec's `ProgressBar` last unless the caller gave a progress bar. A
    `keras.callbacks.CallbackList` the caller built is used as it is."""
    positional = len(args) > 5  # fit(x, y, batch_size, epochs, verbose, callbacks, ...)
    callbacks = args[5] if positional else kwargs.get("callbacks")
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return args, kwargs
    watch = FitWatch()
    callbacks = [watch, *(callbacks or [])]
    if not any(isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks):
        callbacks.append(ProgressBar(watch.reader))  # last: shows what others added
    if positional:
        return (*args[:5], callbacks, *args[6:]), kwargs
    return args, {**kwargs, "callbacks": callbacks}


class MixedPrecisionMixin(BuiltBeforeTrace, MultiWorkerFit):
    """Gives a Keras model class tfmixprec's mixed-precision `train_step` and `compile`.

    Put it before `keras.Model` in the bases: `class MyModel(MixedPrecisionMixin, keras.Model)`.
    `compile` wraps the optimizer in a `tfmixprec.LossScaleOptimizer` (dynamic scale for
    float16; a fixed scale of 1 for bfloat16/float32, which still skips Inf/NaN steps). The
    logs gain `loss_scale` and `overflow` (1.0 on a skipped step). A skipped step changes no
    variable: its loss and metrics do not count in the epoch's means (`guard_state`).
    """

    def compile(
        self,
        optimizer: Any = "rmsprop",
        *args: Any,
        loss_scaling: str = "auto",
        accumulation_steps: int = 1,
        **kwargs: Any,
    ) -> None:
        """Compiles the model with a tfmixprec `LossScaleOptimizer`.

        Args:
            optimizer: `keras.optimizers.Optimizer`, its name, or a `LossScaleOptimizer`.
            *args: Passed to `keras.Model.compile`.
            loss_scaling: String. `"auto"` (dynamic for float16, none otherwise),
                `"dynamic"` or `"none"`.
            accumulation_steps: Int >= 1. Micro-batches per applied step.
            **kwargs: Passed to `keras.Model.compile`.
        """
        optimizer = _optimizer_for(self, optimizer, loss_scaling, accumulation_steps)
        super().compile(optimizer, *args, **kwargs)

    def fit(self, *args: Any, **kwargs: Any) -> keras.callbacks.History:
        """`keras.Model.fit`, plus (see `tfmixprec.fit.hooks.FitWatch`) the epoch's number of
        overflow steps as `overflow` in the epoch logs and a check of `on_min_scale` every 50
        batches. The optimizer's variables are made first where the model is built, so that
        the step is traced once (Keras makes them in its first trace, which TensorFlow then
        traces again)."""
        if isinstance(getattr(self, "optimizer", None), LossScaleOptimizer):
            args, kwargs = _with_fit_watch(args, kwargs)
            build_before_fit(self)
        try:
            with epochs_closed(self):  # a fit left early frees its data iterator on return
                return super().fit(*args, **kwargs)
        finally:  # Keras skips on_train_end when fit raises: the callbacks' keeping ends here
            stop_keeping_for_callbacks(self)

    def compile_from_config(self, config: dict[str, Any]) -> None:
        """Recompiles a loaded model (`keras.models.load_model`) through `compile`."""
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)  # so saved slots can be loaded

    def train_step(self, data: Any) -> dict[str, Any]:
        """Keras's own `train_step` (it scales the loss with `optimizer.scale_loss` and
        `optimizer.apply` unscales, checks and applies or skips), plus the loss-scale logs."""
        if not isinstance(self.optimizer, LossScaleOptimizer):
            raise TypeError(
                "MixedPrecisionModel.train_step needs a tfmixprec.LossScaleOptimizer; compile "
                f"the model with compile(). Received: optimizer={self.optimizer!r}"
            )
        # A skipped step changes nothing; the results are read once, after the guard puts
        # the metrics back (the means over the applied steps), not also inside it.
        later = defers_results(self)
        with guard_state(self, self.optimizer) as guarded:
            with results_after_guard(self) if later else contextlib.nullcontext():
                logs = super().train_step(data)
        logs = dict(metrics_after_guard(self, logs, guarded, every_result=later))
        logs.update(self.optimizer.snapshot(guarded.skipped))
        return logs

    train_step.tfmixprec_guarded = True  # the callbacks wrap no further guard around it
    setattr(train_step, STANDARD_STEP, True)  # Keras's step: built before its trace

    def get_metrics_result(self) -> dict[str, Any]:
        """Keras's `get_metrics_result`; inside this model's own `train_step` nothing, where
        the step reads each result after its state guard (`metrics_after_guard`), once."""
        if results_deferred(self):
            return {}
        return super().get_metrics_result()

    setattr(get_metrics_result, KERAS_RESULTS, True)

    def keep_overflow_batches(self, limit: int) -> OverflowBatches | None:
        """From the next traced step on, keeps the batches of the first `limit` overflow
        steps (and the newest one's) on the device, for `tfmixprec.explain_overflow`.
        `limit=0` stops keeping. Either way the step is traced again. (The callbacks'
        `diagnose=` switch keeps batches the same way for the length of a `fit`, or reads the
        ones kept here.)

        The step writes its batch into the keeper's variables (one device copy of the batch
        a step, in its own dtype, no conditional and no host read), with XLA
        (`jit_compile=True`) or without; `MixedPrecisionModel.fit` polls it after a step
        that overflowed (the counts in the one read the callbacks share; the rows grown
        where a batch did not fit), and `kept` copies a batch to the host when read.

        Args:
            limit: Int >= 0. How many overflow batches to keep at the most.

        Returns:
            The `OverflowBatches` whose `kept` list fills as overflow steps happen, or None.

        Raises:
            ValueError: If `limit` is not an int >= 0, the model runs under a multi-replica
                strategy, or its optimizer accumulates gradients.
        """
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"limit must be an int >= 0. Received: limit={limit!r}")
        reason = cannot_keep_batches(self) if limit else None
        if reason is not None:
            raise ValueError(reason)
        return set_keeper(self, OverflowBatches(limit, "user") if limit else None)


@keras.saving.register_keras_serializable(package="tfmixprec")
class MixedPrecisionModel(MixedPrecisionMixin, keras.Model):
    """A `keras.Model` with tfmixprec's mixed-precision `train_step`.

    Use it like `keras.Model`: functional (`MixedPrecisionModel(inputs, outputs)`) or as the
    base class of a subclassed model.

    Example:

    >>> inputs = keras.Input((784,))
    >>> outputs = keras.layers.Dense(10, dtype="float32")(inputs)
    >>> model = tfmixprec.MixedPrecisionModel(inputs, outputs)
    >>> model.compile(optimizer="adam", loss="mse")
    >>> history = model.fit(x, y)  # history.history["loss_scale"], ["overflow"]
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Keras makes `Model(inputs, outputs)` functional by rewriting the class's bases in
        # place, which would break every later subclassed use of this class. Functional use
        # gets its own class instead, a subclass of this one.
        if cls is MixedPrecisionModel and functional_init_arguments(args, kwargs):
            return MixedPrecisionFunctional.__new__(MixedPrecisionFunctional, *args, **kwargs)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if functional_init_arguments(args, kwargs) and not isinstance(self, Functional):
            raise TypeError(
                f"{type(self).__name__} is a subclass of MixedPrecisionModel called with "
                "inputs/outputs. Subclass tfmixprec.MixedPrecisionFunctional for functional "
                "models, or call MixedPrecisionModel(inputs, outputs) directly."
            )
        super().__init__(*args, **kwargs)


@keras.saving.register_keras_serializable(package="tfmixprec")
class MixedPrecisionFunctional(MixedPrecisionModel, Functional):
    """The class of `MixedPrecisionModel(inputs, outputs)`: a functional model with
    tfmixprec's `train_step`. Subclass it for functional models with extra methods."""


def compute_unscaled_gradients(
    tape: tf.GradientTape,
    loss: Any,
    variables: Sequence[Any],
    optimizer: LossScaleOptimizer,
) -> tuple[list[Any], tf.Tensor]:
    """Gradients of `loss * scale`, unscaled in float32, and whether all are finite.

    The scale enters as the backward pass's seed (`output_gradients`), which is the same
    as differentiating the scaled loss, so the tape need not have recorded the scaling. The
    next `optimizer.apply` in this step applies the gradients as they are.

    Args:
        tape: `tf.GradientTape`. The tape that recorded `loss`.
        loss: Scalar tensor. The (unscaled) loss; float16 losses are cast to float32.
        variables: List of variables to differentiate.
        optimizer: `tfmixprec.LossScaleOptimizer`. Provides the scale.

    Returns:
        `(grads, finite)`: the unscaled gradients (`None` kept) and a scalar bool tensor.

    Example:

    >>> with tf.GradientTape() as tape:
    ...     loss = loss_fn(y, model(x, training=True))
    >>> variables = model.trainable_variables
    >>> grads, finite = tfmixprec.compute_unscaled_gradients(tape, loss, variables, opt)
    >>> opt.apply(grads, variables)  # skips the step if not finite
    """
    if not isinstance(optimizer, LossScaleOptimizer):
        raise TypeError(
            "optimizer must be a tfmixprec.LossScaleOptimizer (wrap yours: "
            f"tfmixprec.LossScaleOptimizer(opt)). Received: optimizer of type "
            f"{type(optimizer).__name__}"
        )
    if not optimizer.built:
        optimizer.build(list(variables))
    loss = ops.cast(loss, "float32")
    seed = ops.cast(optimizer.loss_scale, "float32")
    grads = tape.gradient(loss, variables, output_gradients=seed)
    grads = optimizer.get_unscaled_gradients(grads, variables)
    return grads, optimizer.check_finite(grads)


def _loss_function(loss_fn: Any) -> Callable[..., Any]:
    """`loss_fn` as `make_train_step` calls it: a callable as it is; a Keras loss's name
    (`"mse"`) as Keras's `compile` takes it, in a `LossFunctionWrapper` (the mean over the
    batch, in float32)."""
    if isinstance(loss_fn, str):
        try:
            return as_compiled(keras.losses.get(loss_fn))
        except ValueError as err:
            raise ValueError(
                "loss_fn must be a callable or the name of a Keras loss, as compile(loss=...) "
                "takes it (e.g. 'mse', 'sparse_categorical_crossentropy'). "
                f"Received: loss_fn={loss_fn!r}"
            ) from err
    if not callable(loss_fn):
        raise TypeError(
            "loss_fn must be a callable (e.g. a keras.losses.Loss) or the name of a Keras "
            f"loss. Received: loss_fn={loss_fn!r}"
        )
    return loss_fn


def make_train_step(
    model: keras.Model,
    loss_fn: Callable[..., Any],
    optimizer: Any,
    jit_compile: bool = False,
) -> Callable[..., dict[str, Any]]:
    """Builds a compiled mixed-precision step for a custom training loop.

    Args:
        model: `keras.Model`. The model to train.
        loss_fn: Callable `(y_true, y_pred)` or `(y_true, y_pred, sample_weight)` returning the
            loss (e.g. a `keras.losses.Loss`), or the name of a Keras loss (`"mse"`), as
            Keras's `compile(loss=...)` takes it.
        optimizer: `keras.optimizers.Optimizer`, its name (`"sgd"`), or a
            `tfmixprec.LossScaleOptimizer`; a plain one is wrapped (dynamic scale if the model
            computes in float16, else a fixed scale of 1).
        jit_compile: Bool. Compile the step with XLA.

    Returns:
        A `tf.function` `step(x, y, sample_weight=None)` returning
        `{"loss", "loss_scale", "overflow", "overflow_steps", "skipped_fraction"}`; its
        `optimizer` attribute is the wrapper used.

    Raises:
        TypeError: If `model` is not a `keras.Model`, or `loss_fn` or `optimizer` is neither
            one nor a name.
        ValueError: If `loss_fn` or `optimizer` is a name Keras does not know.

    Example:

    >>> step = tfmixprec.make_train_step(model, "mse", "adam")
    >>> for x, y in dataset:
    ...     logs = step(x, y)
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"model must be a keras.Model. Received: model of type {type(model).__name__}"
        )
    loss_fn = _loss_function(loss_fn)
    optimizer = _optimizer_for(model, optimizer)
    build_before_fit(model, optimizer)  # not in the first trace: the step traced once

    def step(x: Any, y: Any, sample_weight: Any = None) -> dict[str, Any]:
        with guard_state(model, optimizer) as guarded:  # a skipped step changes no variable
            with tf.GradientTape() as tape:
                y_pred = model(x, training=True)
                if sample_weight is None:
                    loss = loss_fn(y, y_pred)
                else:
                    loss = loss_fn(y, y_pred, sample_weight)
                scaled_loss = optimizer.scale_loss(loss)
            variables = model.trainable_variables
            optimizer.apply(tape.gradient(scaled_loss, variables), variables)
        return {"loss": ops.cast(loss, "float32"), **optimizer.snapshot(guarded.skipped)}

    compiled = tf.function(step, jit_compile=jit_compile)
    compiled.optimizer = optimizer
    return compiled
