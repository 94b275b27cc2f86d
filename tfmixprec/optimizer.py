"""`LossScaleOptimizer`: dynamic or fixed loss scaling that never corrupts a step.

The scale state machine lives here and only here. Every piece of state is an optimizer
variable, so checkpoints, `.keras` files and `BackupAndRestore` carry it, and every update is a
graph op (no host sync inside a step).
"""

from __future__ import annotations

import math
import numbers
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf
from keras import ops
from keras.src.utils import tracking

__all__ = ["LossScaleOptimizer"]

_ON_MIN_SCALE = ("warn", "raise", "ignore")

# Set by `get_unscaled_gradients`, consumed by the next `apply` traced in the same thread.
# One slot per (thread, optimizer): MirroredStrategy traces each replica in its own thread.
_PENDING_UNSCALED = threading.local()


def _pending_ids() -> set[int]:
    pending = getattr(_PENDING_UNSCALED, "ids", None)
    if pending is None:
        pending = set()
        _PENDING_UNSCALED.ids = pending
    return pending


def read_now(value: Any) -> tf.Tensor:
    """Reads a (Keras) variable here, in program order: converting a Keras variable returns the
    variable itself, whose read a `tf.function` may then place after later writes. Tensors
    pass through."""
    if isinstance(value, keras.Variable):
        return value.value.read_value()
    return tf.convert_to_tensor(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_positive_finite(name: str, value: Any) -> float:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0. Received: {name}={value!r}")
    return float(value)


def _check_int_at_least_one(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1. Received: {name}={value!r}")
    return int(value)


def _resolve_inner(inner_optimizer: Any) -> keras.optimizers.Optimizer:
    if isinstance(inner_optimizer, str):
        try:
            inner_optimizer = keras.optimizers.get(inner_optimizer)
        except ValueError as err:
            raise ValueError(
                "inner_optimizer must be a Keras 3 optimizer or the name of one "
                f"(e.g. 'adam'). Received: inner_optimizer={inner_optimizer!r}"
            ) from err
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "inner_optimizer is already a LossScaleOptimizer "
            f"({type(inner_optimizer).__name__}); wrapping it again would scale the loss "
            "twice. Use it as it is, or wrap its `inner_optimizer`. Received: "
            f"inner_optimizer={inner_optimizer!r}"
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        module = type(inner_optimizer).__module__ or ""
        if module.startswith(("tf_keras", "tensorflow", "keras.optimizers.legacy")) or hasattr(
            inner_optimizer, "compute_gradients"
        ):
            raise TypeError(
                "inner_optimizer must be a Keras 3 optimizer, but received a tf-keras / "
                f"Keras 2 / TF1 optimizer of type {module}.{type(inner_optimizer).__name__}. "
                "Create it with Keras 3 instead, e.g. keras.optimizers.Adam(...)."
            )
        raise TypeError(
            "inner_optimizer must be a Keras 3 optimizer (keras.optimizers.Optimizer), "
            f"e.g. keras.optimizers.Adam(). Received: inner_optimizer={inner_optimizer!r} "
            f"of type {type(inner_optimizer).__name__}"
        )
    return inner_optimizer


def _resolve_loss_scale_alias(loss_scale: Any, initial_scale: Any, dynamic: Any) -> tuple[Any, Any]:
    """Maps TensorFlow 2's `loss_scale="dynamic" | number` onto `initial_scale`/`dynamic`."""
    if loss_scale is None:
        return initial_scale, dynamic
    if initial_scale is not None or dynamic is not None:
        raise ValueError(
            "Pass either the TensorFlow 2 argument `loss_scale` or `initial_scale`/`dynamic`, "
            f"not both. Received: loss_scale={loss_scale!r}, initial_scale={initial_scale!r}, "
            f"dynamic={dynamic!r}"
        )
    if isinstance(loss_scale, str):
        if loss_scale != "dynamic":
            raise ValueError(
                'loss_scale must be "dynamic" or a number (a fixed scale). '
                f"Received: loss_scale={loss_scale!r}"
            )
        return None, True
    if not _is_number(loss_scale):
        raise ValueError(
            'loss_scale must be "dynamic" or a number (a fixed scale). '
            f"Received: loss_scale={loss_scale!r}"
        )
    return loss_scale, False


def _divide_grad(grad: Any, scale: tf.Tensor) -> Any:
    """Divides one gradient by `scale` in float32, keeping its dtype and sparsity."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(_divide_grad(grad.values, scale), grad.indices, grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    if grad.dtype == tf.float32:
        return grad / scale
    return tf.cast(tf.cast(grad, tf.float32) / scale, grad.dtype)


def gradient_values(grads: Sequence[Any]) -> list[Any]:
    """The dense value tensors of `grads`: `None` dropped, `tf.IndexedSlices` as their values."""
    return [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]


def _all_finite(grads: Sequence[Any]) -> tf.Tensor:
    """True if no gradient holds an Inf or NaN.

    One read of each gradient: its float32 sum is non-finite if any element is (Inf and NaN
    propagate through a sum). A finite tensor whose sum exceeds float32's range (|sum| > 3.4e38,
    a diverged model) also reads as non-finite. This is about twice as fast as
    `reduce_all(is_finite(g))`, which writes a boolean copy of every gradient first.
    """
    sums = [tf.reduce_sum(tf.cast(grad, tf.float32)) for grad in gradient_values(grads)]
    if not sums:
        return tf.constant(True)
    return tf.reduce_all(tf.math.is_finite(tf.stack(sums)))


@keras.saving.register_keras_serializable(package="tfmixprec")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Loss-scaling optimizer with growth, backoff, hysteresis, bounds and counters.

    A subclass of `keras.optimizers.LossScaleOptimizer`, so Keras's
    `compile(auto_scale_loss=True)` treats it as already wrapped. Each step checks all
    gradients for Inf/NaN once, in the graph. A finite step is unscaled in float32 and applied
    by the inner optimizer; the scale grows by `growth_factor` after `growth_interval` clean
    steps. A non-finite step leaves weights, slots and `iterations` untouched and backs the
    scale off by `backoff_factor` once `hysteresis` overflows have been seen since the last
    growth. With `dynamic=False` the scale stays at `initial_scale`; overflow steps are still
    skipped and counted.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer` (or its name, e.g. `"adam"`). The
            optimizer that applies the unscaled gradients.
        initial_scale: Float. The initial (or, with `dynamic=False`, fixed) loss scale.
            Defaults to `2**15`.
        growth_interval: Int. Clean steps before the scale grows. Defaults to 2000.
            `dynamic_growth_steps` (Keras's name) is an alias.
        growth_factor: Float > 1. Multiplier applied when the scale grows.
        backoff_factor: Float in (0, 1). Multiplier applied when the scale backs off.
        min_scale: Float > 0. The scale never goes below this (may be below 1).
        max_scale: Float. The scale never grows above this.
        hysteresis: Int >= 1. Overflow steps tolerated (since the last growth) before the
            scale backs off. Every overflow step is skipped regardless.
        dynamic: Bool. `False` keeps the scale fixed at `initial_scale`.
        on_min_scale: String. What to do when a step overflows while the scale is already at
            `min_scale`: `"warn"` (one Python warning), `"raise"` (`FloatingPointError`
            naming the step) or `"ignore"`. Checked outside the graph: after each eager
            step, at the end of `fit`, or when `check_min_scale()` is called.
        accumulation_steps: Int >= 1. Gradients of this many calls to `apply` (micro-batches)
            are summed, unscaled, in float32 and their mean is applied once; an overflow in
            any micro-batch discards the whole window and backs the scale off once. The
            learning-rate schedule sees one step per applied window. Not supported under a
            multi-replica `tf.distribute` strategy.
        name: String. The optimizer's name.
        dynamic_growth_steps: Int. Keras's name for `growth_interval`.
        loss_scale: `"dynamic"` or a number. TensorFlow 2's argument: a number is a fixed
            scale (`dynamic=False`).

    Raises:
        ValueError: For an out-of-range knob or conflicting aliases.
        TypeError: If `inner_optimizer` is not a Keras 3 optimizer.

    Example:

    >>> opt = tfmixprec.LossScaleOptimizer(keras.optimizers.Adam(1e-3), hysteresis=2)
    >>> model.compile(optimizer=opt, loss="mse")
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer | str,
        initial_scale: float | None = None,
        growth_interval: int | None = None,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
        dynamic: bool | None = None,
        on_min_scale: str = "warn",
        accumulation_steps: int = 1,
        name: str | None = None,
        *,
        dynamic_growth_steps: int | None = None,
        loss_scale: str | float | None = None,
        **kwargs: Any,
    ) -> None:
        # Everything is validated before anything is built or changed.
        initial_scale, dynamic = _resolve_loss_scale_alias(loss_scale, initial_scale, dynamic)
        if dynamic_growth_steps is not None:
            if growth_interval is not None and growth_interval != dynamic_growth_steps:
                raise ValueError(
                    "growth_interval and its Keras alias dynamic_growth_steps disagree; pass "
                    f"one of them. Received: growth_interval={growth_interval!r}, "
                    f"dynamic_growth_steps={dynamic_growth_steps!r}"
                )
            growth_interval = dynamic_growth_steps
        initial_scale = 2.0**15 if initial_scale is None else initial_scale
        growth_interval = 2000 if growth_interval is None else growth_interval
        dynamic = True if dynamic is None else dynamic

        initial_scale = _check_positive_finite("initial_scale", initial_scale)
        growth_interval = _check_int_at_least_one("growth_interval", growth_interval)
        hysteresis = _check_int_at_least_one("hysteresis", hysteresis)
        accumulation_steps = _check_int_at_least_one("accumulation_steps", accumulation_steps)
        if not _is_number(growth_factor) or not (1 < growth_factor < math.inf):
            raise ValueError(
                f"growth_factor must be a finite number > 1. Received: "
                f"growth_factor={growth_factor!r}"
            )
        if not _is_number(backoff_factor) or not (0 < backoff_factor < 1):
            raise ValueError(
                f"backoff_factor must be in (0, 1). Received: backoff_factor={backoff_factor!r}"
            )
        min_scale = _check_positive_finite("min_scale", min_scale)
        max_scale = _check_positive_finite("max_scale", max_scale)
        if min_scale > max_scale:
            raise ValueError(
                "min_scale must be <= max_scale. Received: "
                f"min_scale={min_scale!r}, max_scale={max_scale!r}"
            )
        if not min_scale <= initial_scale <= max_scale:
            raise ValueError(
                f"initial_scale must be within [min_scale, max_scale] = [{min_scale!r}, "
                f"{max_scale!r}]; change initial_scale or widen the bounds. Received: "
                f"initial_scale={initial_scale!r}"
            )
        if not isinstance(dynamic, bool):
            raise ValueError(f"dynamic must be True or False. Received: dynamic={dynamic!r}")
        if on_min_scale not in _ON_MIN_SCALE:
            raise ValueError(
                f"on_min_scale must be one of {list(_ON_MIN_SCALE)}. "
                f"Received: on_min_scale={on_min_scale!r}"
            )
        inner_optimizer = _resolve_inner(inner_optimizer)

        super().__init__(
            inner_optimizer,
            initial_scale=initial_scale,
            dynamic_growth_steps=growth_interval,
            name=name,
            **kwargs,
        )
        self.growth_interval = growth_interval
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.hysteresis = hysteresis
        self.dynamic = dynamic
        self.on_min_scale = on_min_scale
        self.accumulation_steps = accumulation_steps
        self._min_scale_reported = False

    # ------------------------------------------------------------------ state
    @tracking.no_automatic_dependency_tracking
    def build(self, var_list: Sequence[Any]) -> None:
        """Creates the scale state (as variables) and builds the inner optimizer.

        Args:
            var_list: List of variables. The model's trainable variables.
        """

        def state(name: str, dtype: str, value: float) -> keras.Variable:
            # All replicas compute the same value; take the first replica's write.
            return self.add_variable(
                shape=(),
                dtype=dtype,
                initializer=keras.initializers.Constant(value),
                aggregation="only_first_replica",
                name=name,
            )

        # `dynamic_scale` and `step_counter` keep Keras's names so code reading them works.
        self.dynamic_scale = state("dynamic_scale", "float32", self.initial_scale)
        self.step_counter = state("step_counter", "int", 0)
        self.hysteresis_tracker = state("hysteresis_tracker", "int", self.hysteresis)
        self._overflow_steps = state("overflow_steps", "int", 0)
        self._consecutive_overflows = state("consecutive_overflows", "int", 0)
        self._last_overflow_iteration = state("last_overflow_iteration", "int", -1)
        self._step_applied = state("step_applied", "int", 0)
        self._min_scale_overflow_iteration = state("min_scale_overflow_iteration", "int", -1)
        if self.accumulation_steps > 1:
            self._micro_step = state("micro_step", "int", 0)
            self._window_finite = state("window_finite", "int", 1)
            self._accumulators = [
                self.add_variable(
                    shape=v.shape,
                    dtype="float32",
                    initializer="zeros",
                    aggregation="only_first_replica",
                    name="accumulated_gradient",
                )
                for v in var_list
            ]
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    def _state_or_default(self, attr: str, default: float, dtype: tf.DType) -> Any:
        if self.built:
            return getattr(self, attr)
        return tf.constant(default, dtype=dtype)

    @property
    def loss_scale(self) -> Any:
        """The current loss scale (a float32 variable; a constant before the first step)."""
        return self._state_or_default("dynamic_scale", self.initial_scale, tf.float32)

    @property
    def overflow_steps(self) -> Any:
        """Total number of skipped (overflow) steps."""
        return self._state_or_default("_overflow_steps", 0, tf.int64)

    @property
    def consecutive_overflows(self) -> Any:
        """Overflow steps in a row, up to and including the last step (0 after a clean step)."""
        return self._state_or_default("_consecutive_overflows", 0, tf.int64)

    @property
    def last_overflow_iteration(self) -> Any:
        """The inner optimizer's `iterations` at the last overflow step, -1 if none yet."""
        return self._state_or_default("_last_overflow_iteration", -1, tf.int64)

    @property
    def step_applied(self) -> Any:
        """1 if the last step was applied, 0 if it was skipped (or no step yet)."""
        return self._state_or_default("_step_applied", 0, tf.int64)

    @property
    def good_steps(self) -> Any:
        """Clean steps since the scale last changed (the growth counter)."""
        return self._state_or_default("step_counter", 0, tf.int64)

    def state_logs(self) -> dict[str, tf.Tensor]:
        """The state as float32 tensors for training logs, read here in program order.

        No host read: safe inside a step (after `apply`, the values include that step).

        Returns:
            Dict with `loss_scale`, `overflow_steps` and `skipped_fraction` (overflow steps
            over all steps attempted).
        """
        overflows = tf.cast(read_now(self.overflow_steps), tf.float32)
        applied = tf.cast(read_now(self.iterations), tf.float32)
        return {
            "loss_scale": tf.cast(read_now(self.loss_scale), tf.float32),
            "overflow_steps": overflows,
            "skipped_fraction": overflows / tf.maximum(overflows + applied, 1.0),
        }

    def read_state(self) -> dict[str, float | int]:
        """Reads the scale state to the host, as Python numbers (also under tf.distribute).

        Call it outside the training step (callbacks do, at their logging interval).

        Returns:
            Dict with `loss_scale`, `good_steps`, `hysteresis_tracker`, `overflow_steps`,
            `consecutive_overflows`, `last_overflow_iteration`, `step_applied`, `iterations`.
        """
        values = {
            "loss_scale": self.loss_scale,
            "good_steps": self.good_steps,
            "hysteresis_tracker": (
                self.hysteresis_tracker if self.built else tf.constant(self.hysteresis)
            ),
            "overflow_steps": self.overflow_steps,
            "consecutive_overflows": self.consecutive_overflows,
            "last_overflow_iteration": self.last_overflow_iteration,
            "step_applied": self.step_applied,
            "iterations": self.iterations,
        }
        state = {name: value.numpy().item() for name, value in values.items()}
        state["loss_scale"] = float(state["loss_scale"])
        return state

    # ---------------------------------------------------------- loss scaling
    def scale_loss(self, loss: Any) -> Any:
        """Multiplies `loss` by the current loss scale (in float32 or wider).

        Args:
            loss: Tensor. The loss to scale.

        Returns:
            The scaled loss.
        """
        _pending_ids().discard(id(self))  # a new step starts: forget a stale flag
        scale = self.dynamic_scale if self.built else self.initial_scale
        loss = ops.convert_to_tensor(loss)
        if loss.dtype in (tf.float16, tf.bfloat16):
            loss = ops.cast(loss, "float32")
        return ops.multiply(loss, ops.cast(scale, loss.dtype))

    def get_scaled_loss(self, loss: Any) -> Any:
        """TensorFlow 2's name for `scale_loss`; also accepts a zero-argument callable.

        Args:
            loss: Tensor or callable returning a tensor. The loss to scale.

        Returns:
            The scaled loss (a callable if `loss` was one).

        Example:

        >>> with tf.GradientTape() as tape:
        ...     loss = loss_fn(y, model(x))
        ...     scaled = opt.get_scaled_loss(loss)
        """
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads: Sequence[Any]) -> list[Any]:
        """Divides gradients of the scaled loss by the loss scale, in float32.

        `None` entries stay `None`; `tf.IndexedSlices` stay sparse. The next
        `apply`/`apply_gradients` of this step applies them as they are (no second unscale).

        Args:
            grads: List of tensors, `tf.IndexedSlices` or `None`. Gradients of the scaled loss.

        Returns:
            The list of unscaled gradients.

        Example:

        >>> grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        >>> opt.apply_gradients(zip(grads, model.trainable_variables))
        """
        if self._scale_is_one:
            unscaled = list(grads)
        else:
            scale = self.dynamic_scale if self.built else tf.constant(self.initial_scale)
            unscaled = [_divide_grad(g, ops.cast(scale, "float32")) for g in grads]
        _pending_ids().add(id(self))
        return unscaled

    def _unscale_for_apply(self, grads: list[Any], trainable_variables: Sequence[Any]) -> list:
        pending = _pending_ids()
        if id(self) in pending:
            pending.discard(id(self))
            return grads
        if self._scale_is_one:
            return grads  # g / 1 == g: save a pass over every gradient
        scale = ops.cast(self.dynamic_scale, "float32")
        return [
            g if g is None or self._overwrite_variable_with_gradient(v) else _divide_grad(g, scale)
            for g, v in zip(grads, trainable_variables)
        ]

    @property
    def _scale_is_one(self) -> bool:
        """A fixed scale of 1 (no loss scaling): unscaling is the identity."""
        return not self.dynamic and self.initial_scale == 1.0

    # ------------------------------------------------------------------ step
    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """Applies a step, or skips it if any gradient is Inf/NaN.

        Gradients of the scaled loss are unscaled here, unless they came from
        `get_unscaled_gradients` in this step.

        Args:
            grads: List of gradients (tensors, `tf.IndexedSlices` or `None`).
            trainable_variables: List of variables, or `None` for the built ones.
        """
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        grads = list(grads)
        tvs = self._trainable_variables if trainable_variables is None else trainable_variables
        grads = self._unscale_for_apply(grads, list(tvs))
        if self.accumulation_steps > 1:
            self._accumulate(grads, list(tvs))
        else:
            super().apply(grads, trainable_variables)
        if tf.executing_eagerly() and not tf.distribute.has_strategy():
            self.check_min_scale()

    def _accumulate(self, grads: list[Any], trainable_variables: list[Any]) -> None:
        strategy = tf.distribute.get_strategy()
        if strategy.num_replicas_in_sync > 1:
            raise ValueError(
                "accumulation_steps > 1 is not supported under a tf.distribute strategy with "
                f"{strategy.num_replicas_in_sync} replicas yet. Use accumulation_steps=1 and a "
                f"larger global batch instead. Received: "
                f"accumulation_steps={self.accumulation_steps!r}"
            )
        finite = self.check_finite(grads)
        accumulators = [
            self._accumulators[self._get_variable_index(v)] for v in trainable_variables
        ]
        for acc, grad in zip(accumulators, grads):
            if grad is None:
                continue
            if isinstance(grad, tf.IndexedSlices):
                values = tf.where(finite, tf.cast(grad.values, tf.float32), 0.0)
                acc.value.scatter_add(tf.IndexedSlices(values, grad.indices, grad.dense_shape))
            else:
                acc.assign_add(tf.where(finite, tf.cast(grad, tf.float32), 0.0))
        self._window_finite.assign(ops.where(finite, self._window_finite, 0))
        self._micro_step.assign_add(1)

        def end_of_window() -> None:
            window_ok = ops.equal(self._window_finite, 1)
            steps = float(self.accumulation_steps)
            final = [
                None if g is None else ops.cast(acc / steps, v.dtype)
                for acc, g, v in zip(accumulators, grads, trainable_variables)
            ]
            # A bad window reaches the one finite check as a NaN: skipped, backed off once.
            first = next(i for i, g in enumerate(final) if g is not None)
            final[first] = ops.where(window_ok, final[first], float("nan"))
            keras.optimizers.LossScaleOptimizer.apply(self, final, trainable_variables)
            for acc in accumulators:
                acc.assign(ops.zeros_like(acc))
            self._micro_step.assign(0)
            self._window_finite.assign(1)

        ops.cond(
            ops.greater_equal(self._micro_step, self.accumulation_steps),
            end_of_window,
            lambda: None,
        )

    def check_finite(self, grads: Sequence[Any]) -> tf.Tensor:
        """Returns a scalar bool: True if every gradient is finite on every replica.

        Args:
            grads: List of gradients (tensors, `tf.IndexedSlices` or `None`).

        Returns:
            A boolean scalar tensor, identical on all replicas.
        """
        finite = _all_finite(grads)
        ctx = tf.distribute.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            # Gradients are not all-reduced yet: every replica must take the same branch.
            bad = ctx.all_reduce(
                tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.float32)
            )
            finite = tf.equal(bad, 0.0)
        return finite

    def _stateful_handle_finite_grads(self, grads: Sequence[Any], trainable_variables: Any) -> None:
        # `grads` are already unscaled (see `apply`).
        self.inner_optimizer.apply(grads, trainable_variables=trainable_variables)
        self._consecutive_overflows.assign(0)
        self._step_applied.assign(1)
        if not self.dynamic:
            self.step_counter.assign_add(1)
            return
        counter = self.step_counter + 1
        grow = ops.greater_equal(counter, self.growth_interval)
        new_scale = ops.minimum(
            ops.multiply(self.dynamic_scale, self.growth_factor), self.max_scale
        )
        self.dynamic_scale.assign(ops.where(grow, new_scale, self.dynamic_scale))
        self.step_counter.assign(ops.where(grow, ops.zeros_like(counter), counter))
        self.hysteresis_tracker.assign(
            ops.where(
                grow,
                ops.cast(self.hysteresis, self.hysteresis_tracker.dtype),
                self.hysteresis_tracker,
            )
        )

    def _stateful_handle_non_finite_grads(self) -> None:
        iteration = ops.cast(self.iterations, self._last_overflow_iteration.dtype)
        # 0-based index of this step among all steps attempted (skipped ones included).
        attempted = ops.add(iteration, ops.cast(self._overflow_steps, iteration.dtype))
        self._overflow_steps.assign_add(1)
        self._consecutive_overflows.assign_add(1)
        self._last_overflow_iteration.assign(iteration)
        self._step_applied.assign(0)
        self.step_counter.assign(0)
        if not self.dynamic:
            return
        scale = self.dynamic_scale
        at_min = ops.less_equal(scale, self.min_scale)
        first_at_min = ops.logical_and(at_min, ops.less(self._min_scale_overflow_iteration, 0))
        self._min_scale_overflow_iteration.assign(
            ops.where(first_at_min, attempted, self._min_scale_overflow_iteration)
        )
        tracker = ops.maximum(self.hysteresis_tracker - 1, 0)
        self.hysteresis_tracker.assign(tracker)
        new_scale = ops.maximum(ops.multiply(scale, self.backoff_factor), self.min_scale)
        self.dynamic_scale.assign(ops.where(ops.equal(tracker, 0), new_scale, scale))

    def check_min_scale(self) -> None:
        """Warns or raises (per `on_min_scale`) if a step overflowed at `min_scale`.

        Reads one variable, so call it outside the training step. It runs on its own after
        every eager step, at the end of `fit`, every 50 batches of a `MixedPrecisionModel`'s
        `fit`, and at the logging interval of `LossScaleMonitor` and `OverflowGuard`.

        Raises:
            FloatingPointError: With `on_min_scale="raise"`, naming the step.
        """
        if self.on_min_scale == "ignore" or self._min_scale_reported or not self.built:
            return
        step = int(self._min_scale_overflow_iteration.numpy())
        if step < 0:
            return
        self._min_scale_reported = True
        message = (
            f"Gradients were not finite at step {step} (0-based, skipped steps counted) "
            "although the loss scale was "
            f"already at min_scale={self.min_scale!r}: that step was skipped. Lowering the "
            "scale cannot fix this; likely causes are NaN/Inf in the inputs or labels, a "
            "learning rate that is too high, or a layer (softmax, loss, output) that must "
            "run in float32. Fix the data or model, or lower min_scale."
        )
        if self.on_min_scale == "raise":
            raise FloatingPointError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """Called by Keras at the end of `fit`; also reports a `min_scale` overflow."""
        super().finalize_variable_values(var_list)
        self.check_min_scale()

    # --------------------------------------------------------- serialization
    def get_config(self) -> dict[str, Any]:
        """Returns every knob and the serialized inner optimizer."""
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "initial_scale": self.initial_scale,
            "growth_interval": self.growth_interval,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "hysteresis": self.hysteresis,
            "dynamic": self.dynamic,
            "on_min_scale": self.on_min_scale,
            "accumulation_steps": self.accumulation_steps,
        }

    @classmethod
    def from_config(
        cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None
    ) -> LossScaleOptimizer:
        """Creates the optimizer from `get_config()` (also Keras's own LSO config)."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)
