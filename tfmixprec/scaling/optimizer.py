"""`LossScaleOptimizer`: a thin Keras adapter over the loss-scale unit in `loss_scale.py`.

The adapter turns Keras's optimizer calls into the unit's functions: `scale_loss` scales,
`apply` unscales (by the run-time unscaling contract) and hands the finite check and the
apply/skip decision to Keras's own `LossScaleOptimizer.apply`, whose hooks call back into
the unit's transition. All state is variables; nothing that decides a step is Python state.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmixprec._common.text import docs_page
from tfmixprec._common.validate import check_int_at_least_one
from tfmixprec._keras.graph import every_layer_built
from tfmixprec._keras.optimizer_hooks import (
    KerasLossScaleHooks,
    built_variables,
    no_automatic_dependency_tracking,
)
from tfmixprec.scaling.accumulation import GradientAccumulator
from tfmixprec.scaling.attribution import OverflowReport, build_report
from tfmixprec.scaling.loss_scale import (
    LossScale,
    LossScaleConfig,
    all_finite,
    check,
    nonfinite_flags,
    read_now,
)
from tfmixprec.scaling.optimizer_args import (
    check_on_min_scale,
    config_from_arguments,
    resolve_optimizer,
)
from tfmixprec.scaling.state_file import load, save
from tfmixprec.scaling.step_notes import StepNotes

__all__ = ["LossScaleOptimizer"]  # and `resolve_optimizer`, from `optimizer_args`

# What `read_state()` returns; `get_config()` writes `CONFIG_NAMES` besides name and inner.
STATE_NAMES = (
    "loss_scale",
    "good_steps",
    "hysteresis_tracker",
    "overflow_steps",
    "consecutive_overflows",
    "last_overflow_iteration",
    "iterations",
    "min_scale_overflows",
    "longest_overflow_run",
)
CONFIG_NAMES = (
    "initial_scale",
    "dynamic_growth_steps",
    "growth_factor",
    "backoff_factor",
    "min_scale",
    "max_scale",
    "hysteresis",
    "dynamic",
    "on_min_scale",
    "accumulation_steps",
)


def _unscale_targets(
    opt: Any, grads: list[Any], variables: Sequence[Any] | None
) -> tuple[list[bool], list[int] | None]:
    """For `get_unscaled_gradients`: which gradients to leave alone (float8 variables, which
    Keras overwrites with their gradient) and the positions of the gradients' variables (None
    before the optimizer is built). Without `variables`, the gradients must be one per
    variable of the optimizer."""
    if variables is not None:
        variables = list(variables)
        keep = [opt.overwrites_with_gradient(v) for v in variables]
        return keep, [opt.variable_index(v) for v in variables] if opt.built else None
    if not opt.built:
        return [False] * len(grads), None
    tracked = opt.tracked_variables()
    if len(grads) != len(tracked):
        raise ValueError(
            f"get_unscaled_gradients() received {len(grads)} gradients but the optimizer "
            f"trains {len(tracked)} variables, so it cannot tell whose gradients are unscaled. "
            "Pass get_unscaled_gradients(grads, variables)."
        )
    return [opt.overwrites_with_gradient(v) for v in tracked], list(range(len(tracked)))


def _min_scale_report(state: Any) -> str | None:
    """The message for the first overflow at `min_scale` of `state`, or None (one host read)."""
    step = int(state.min_scale_overflow_iteration.numpy())
    if step < 0:
        return None
    return (
        f"Gradients were not finite at step {step} (0-based, skipped steps counted) "
        f"although the loss scale was already at min_scale={state.config.min_scale!r}, "
        "where lowering it cannot help: that step was skipped. Likely causes are NaN/Inf in "
        "the inputs or labels, a learning rate that is too high, or a layer (softmax, loss, "
        "output) that must run in float32; fix the data or model, or lower min_scale. "
        f"{docs_page('guides/why-overflow')}"
    )


@keras.saving.register_keras_serializable(package="tfmixprec")
class LossScaleOptimizer(KerasLossScaleHooks):
    """Loss-scaling optimizer with growth, backoff, hysteresis, bounds and counters.

    A subclass of `keras.optimizers.LossScaleOptimizer`, so Keras's
    `compile(auto_scale_loss=True)` treats it as already wrapped. Each step checks all
    gradients for Inf/NaN once, in the graph (all replicas agree). A finite step is unscaled
    in float32 and applied by the inner optimizer; the scale grows by `growth_factor` after
    `growth_interval` clean steps. A non-finite step leaves weights, slots and `iterations`
    untouched and backs the scale off by `backoff_factor` once `hysteresis` overflows have been
    seen since the last growth. With `dynamic=False` the scale stays at `initial_scale` (the
    bounds do not apply); overflow steps are still skipped and counted.

    Args:
        inner_optimizer: `keras.optimizers.Optimizer` (or its name, e.g. `"adam"`). The
            optimizer that applies the unscaled gradients.
        initial_scale, growth_interval, growth_factor, backoff_factor, min_scale, max_scale,
            hysteresis, dynamic: the loss-scale knobs, see `tfmixprec.loss_scale.
            LossScaleConfig` (defaults `2**15`, 2000, 2.0, 0.5, 1.0, `2**24`, 1, True).
        on_min_scale: String. What to do when a step overflows while the scale is already at
            `min_scale`: `"warn"` (one Python warning), `"raise"` (`FloatingPointError`
            naming the step) or `"ignore"`. Checked outside the graph: after each eager
            step, at the end of `fit`, or when `check_min_scale()` is called.
        accumulation_steps: Int >= 1. Gradients of this many calls to `apply` (micro-batches)
            are summed, unscaled, in float32 and their mean is applied once (see
            `tfmixprec.accumulation`). Not supported under a multi-replica strategy.
        name: String. The optimizer's name.
        dynamic_growth_steps: Int. Keras's name for `growth_interval`.
        loss_scale: `"dynamic"` or a number. TensorFlow 2's argument: a number is a fixed
            scale (`dynamic=False`).

    Raises:
        ValueError: For an out-of-range knob or conflicting aliases.
        TypeError: If `inner_optimizer` is not a Keras 3 optimizer or is already a
            `LossScaleOptimizer`, or `dynamic` is not a bool.

    Example:

    >>> opt = tfmixprec.LossScaleOptimizer(keras.optimizers.Adam(1e-3), hysteresis=2)
    >>> float(opt.loss_scale)
    32768.0
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer | str,
        initial_scale: float | None = None,
        growth_interval: int | None = None,
        growth_factor: float = LossScaleConfig.growth_factor,
        backoff_factor: float = LossScaleConfig.backoff_factor,
        min_scale: float = LossScaleConfig.min_scale,
        max_scale: float = LossScaleConfig.max_scale,
        hysteresis: int = LossScaleConfig.hysteresis,
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
        knobs = dict(growth_factor=growth_factor, backoff_factor=backoff_factor)
        knobs.update(min_scale=min_scale, max_scale=max_scale, hysteresis=hysteresis)
        config = config_from_arguments(
            initial_scale, growth_interval, dynamic, dynamic_growth_steps, loss_scale, **knobs
        )
        accumulation_steps = check_int_at_least_one("accumulation_steps", accumulation_steps)
        on_min_scale = check_on_min_scale(on_min_scale)
        inner_optimizer = resolve_optimizer(inner_optimizer)
        growth_steps = config.growth_interval if config.dynamic else None
        super().__init__(inner_optimizer, config.initial_scale, growth_steps, name=name, **kwargs)
        self.loss_scale_config = config
        self.on_min_scale = on_min_scale
        self.accumulation_steps = accumulation_steps
        self._min_scale_reported = False  # host-side: one report per optimizer
        self._loss_scale = LossScale(
            config,
            lambda name, dtype, value, shape=(): self._state_variable(name, shape, dtype, value),
        )
        self._accumulator: GradientAccumulator | None = None  # made by `build`
        self._notes = StepNotes()  # what one part of a traced step reuses from another

    def _state_variable(self, name: str, shape: tuple, dtype: str, value: float) -> Any:
        # All replicas compute the same value; take the first replica's write.
        return self.add_variable(
            shape=shape,
            dtype=dtype,
            initializer=keras.initializers.Constant(value),
            aggregation="only_first_replica",
            name=name,
        )

    @no_automatic_dependency_tracking
    def build(self, var_list: Sequence[Any]) -> None:
        """Builds the inner optimizer (and the accumulation sums) for `var_list`.

        Args:
            var_list: List of variables. The model's trainable variables.
        """
        if self.built:  # once, as Keras's optimizers
            return
        self._loss_scale.build(len(var_list))
        if self.accumulation_steps > 1:
            self._accumulator = GradientAccumulator(
                self.accumulation_steps, self._state_variable, var_list
            )
        if not self.inner_optimizer.built:  # built already: adopted from Keras's optimizer
            self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    # ------------------------------------------------------------ the knobs (the config's)
    @property
    def dynamic(self) -> bool:
        """`False`: the scale stays at `initial_scale` (the bounds do not apply)."""
        return self.loss_scale_config.dynamic

    @property
    def growth_interval(self) -> int:
        """Clean steps before the scale grows (Keras: `dynamic_growth_steps`)."""
        return self.loss_scale_config.growth_interval

    @property
    def growth_factor(self) -> float:
        """The multiplier on growth."""
        return self.loss_scale_config.growth_factor

    @property
    def backoff_factor(self) -> float:
        """The multiplier on backoff."""
        return self.loss_scale_config.backoff_factor

    @property
    def min_scale(self) -> float:
        """The scale never backs off below this."""
        return self.loss_scale_config.min_scale

    @property
    def max_scale(self) -> float:
        """The scale never grows above this."""
        return self.loss_scale_config.max_scale

    @property
    def hysteresis(self) -> int:
        """Overflows (since the scale last grew) before it backs off."""
        return self.loss_scale_config.hysteresis

    # ------------------------------------------------------------ the state variables
    # One name each (`tfmixprec.loss_scale.LossScale` holds them), and the names Keras's and
    # TF 2's optimizers give two of them: `dynamic_scale` and `step_counter` (Keras's own code
    # and checkpoints use them on this subclass), `dynamic_counter` (TF 2 code reads it).
    @property
    def loss_scale(self) -> keras.Variable:
        """The scale (a float32 variable)."""
        return self._loss_scale.scale_variable

    @property
    def dynamic_scale(self) -> keras.Variable:
        """Keras's name for `loss_scale`."""
        return self._loss_scale.scale_variable

    @property
    def good_steps(self) -> keras.Variable:
        """Clean steps since the scale last grew or backed off."""
        return self._loss_scale.good_steps

    @property
    def step_counter(self) -> keras.Variable:
        """Keras's name for `good_steps`."""
        return self._loss_scale.good_steps

    @property
    def dynamic_counter(self) -> keras.Variable:
        """TensorFlow 2's name for `good_steps`."""
        return self._loss_scale.good_steps

    @property
    def hysteresis_tracker(self) -> keras.Variable:
        """Overflows left before the scale backs off."""
        return self._loss_scale.hysteresis_tracker

    @property
    def overflow_steps(self) -> keras.Variable:
        """Skipped steps, in all."""
        return self._loss_scale.overflow_steps

    @property
    def consecutive_overflows(self) -> keras.Variable:
        """Skipped steps in a row, now."""
        return self._loss_scale.consecutive_overflows

    @property
    def last_overflow_iteration(self) -> keras.Variable:
        """Applied steps at the last skip."""
        return self._loss_scale.last_overflow_iteration

    @property
    def last_overflow_scale(self) -> keras.Variable:
        """The scale the last overflow used."""
        return self._loss_scale.last_overflow_scale

    @property
    def min_scale_overflows(self) -> keras.Variable:
        """Overflow steps at `min_scale` since the scale last grew."""
        return self._loss_scale.min_scale_overflows

    @property
    def longest_overflow_run(self) -> keras.Variable:
        """The longest run of consecutive overflow steps since `reset_longest_overflow_run()`."""
        return self._loss_scale.longest_overflow_run

    # ------------------------------------------------------------ loss scaling
    def scale_loss(self, loss: Any) -> tf.Tensor:
        """Multiplies `loss` by the current scale, in float32, and starts a step: gradients
        of it passed to `apply` are unscaled there (Keras 3's way), with the scale read here."""
        scale = self._loss_scale.step_scale()
        if scale is not None:  # for this graph's next `apply` (`step_notes`)
            self._notes.note("scaled_with", scale)
        return self._loss_scale.scale(loss, scale)

    def get_scaled_loss(self, loss: Any) -> tf.Tensor | Callable[[], tf.Tensor]:
        """TensorFlow 2's name for `scale_loss`; also accepts a zero-argument callable.

        Example:

        >>> scaled = opt.get_scaled_loss(tf.constant(2.0))
        >>> float(scaled) == 2.0 * float(opt.loss_scale)
        True
        """
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(
        self, grads: Sequence[Any], variables: Sequence[Any] | None = None
    ) -> list[Any]:
        """Divides gradients of the scaled loss by the scale, in float32 (TF 2's way).

        The next `apply`/`apply_gradients` applies what it receives as it is, in any
        `tf.function`, thread or replica; passing it the *scaled* gradients after all raises
        (README, "The unscaling contract").

        Args:
            grads: List of tensors, `tf.IndexedSlices` or `None`. Gradients of the scaled loss.
            variables: Optional list of the gradients' variables. Variables that Keras
                overwrites with their "gradient" (float8 scale/amax) are left alone.

        Returns:
            The list of unscaled gradients (`None` kept, sparse kept sparse).

        Example:

        >>> grads = opt.get_unscaled_gradients([tf.constant([32768.0])])
        >>> grads[0].numpy()
        array([1.], dtype=float32)
        """
        grads = list(grads)
        keep, indices = _unscale_targets(self, grads, variables)
        knew_float8 = variables is not None
        return self._loss_scale.unscale_returned(grads, keep, indices, knew_float8)

    # ------------------------------------------------------------ the step
    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        """Unscales (unless already unscaled this step), then applies or skips the step.

        Args:
            grads: List of gradients (tensors, `tf.IndexedSlices` or `None`).
            trainable_variables: List of variables, or `None` for the built ones.
        """
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        # The scale the gradients were scaled with, if `scale_loss` read it in this graph
        # since the last `apply`; else read here. A new step: nothing noted before is its own.
        scale = self._notes.here("scaled_with", unwritten=self._loss_scale.scale_variable)
        self._notes.forget()
        scale = self._loss_scale.step_scale() if scale is None else scale
        if scale is not None:  # for the branches and the batch keeper: read once
            self._notes.note("scale", scale)
        tracked = self.tracked_variables()
        variables = tracked if trainable_variables is None else list(trainable_variables)
        keep = [self.overwrites_with_gradient(v) for v in variables]
        indices = [self.variable_index(v) for v in variables]
        has_float8 = any(map(self.overwrites_with_gradient, tracked))
        grads = self._loss_scale.unscale_received(grads, keep, indices, has_float8, scale)
        if self._accumulator is None:
            super().apply(grads, trainable_variables)
        else:  # this replica's flags only: the window's are all-reduced once, at its end
            _, evidence = check(grads, indices, len(tracked), across_replicas=False)
            flags = nonfinite_flags(evidence)
            self._accumulator.add(grads, indices, flags, self.apply_when, tracked)
        if tf.executing_eagerly() and not tf.distribute.has_strategy():
            self.check_min_scale()

    def check_finite(self, grads: Sequence[Any]) -> tf.Tensor:
        """Returns a scalar bool: True if every gradient is finite on every replica."""
        return all_finite(grads)

    def check_step(
        self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """The step's finite check: `(finite, evidence)`, `evidence` a vector over the
        optimizer's variables, not finite where a variable's gradient held an Inf or NaN on any
        replica (see `tfmixprec.loss_scale.check`). `apply` calls it once per step."""
        tracked = self.tracked_variables()
        variables = tracked if trainable_variables is None else list(trainable_variables)
        indices = [self.variable_index(v) for v in variables]
        return check(grads, indices, len(tracked))

    def note_step(self, finite: tf.Tensor) -> None:
        """While tracing, after the apply-or-skip branch on `finite` in this graph: the flag
        `skipped()` returns here, until the next `apply` in this thread (in any graph)."""
        self._notes.note("finite", finite)

    def apply_finite_step(
        self, grads: Sequence[Any], trainable_variables: Any, scale: Any = None
    ) -> None:
        """Applies already unscaled gradients through the inner optimizer; counts a clean step
        (`scale`: the step's scale, where read before the branch)."""
        self.inner_optimizer.apply(grads, trainable_variables=trainable_variables)
        self._loss_scale.adjust(True, self.iterations, scale=scale)

    def skip_step(self, evidence: Any = None, scale: Any = None) -> None:
        """Leaves weights and slots alone; counts the overflow (and, given `evidence` from
        `check_step`, which variables' gradients were not finite) and backs the scale off
        (`scale`: the step's scale, where read before the branch)."""
        self._loss_scale.adjust(False, self.iterations, evidence, scale)

    # ------------------------------------------------------------ readers
    def last_overflow_step(self) -> tf.Tensor:
        """The last overflow step (0-based, skipped steps counted; -1: none), read in the
        graph."""
        return self._loss_scale.step_numbers(self.iterations)["last_overflow_step"]

    def snapshot(self, skipped: tf.Tensor | None = None) -> dict[str, tf.Tensor]:
        """The loss-scale values for logs, read in the graph (no host sync; after `apply`
        they include that step). See `LossScale.snapshot`. With accumulation only the
        micro-batch that ends a window can be an overflow step: `overflow` is 0 inside one.
        `skipped`: `skipped()` as the caller read it after this step's `apply` (one read)."""
        skipped = self.skipped() if skipped is None else skipped
        return self._loss_scale.log_values(self.iterations, skipped)

    def scale_used(self) -> tf.Tensor | None:
        """While tracing, after an `apply` in this graph (this `tf.function`, this replica):
        the loss scale that step used, read before its apply-or-skip branch (on an overflow
        step, the scale that overflowed), with no read; else None."""
        return self._notes.here("scale")

    def skipped(self) -> tf.Tensor:
        """Whether the step that just ran was skipped (a scalar bool, read in the graph):
        after `apply`, its gradients were not finite. With accumulation only the micro-batch
        that ends a window can be skipped. Right after an `apply` that branched in this graph
        (this `tf.function`, this replica), its finite check's own flag: no read."""
        finite = None
        if self._accumulator is None and not tf.executing_eagerly():
            finite = self._notes.here("finite")
        if finite is not None:  # its negation, made once in this graph
            made = [op for op in finite.consumers() if op.type == "LogicalNot"]
            return made[0].outputs[0] if made else tf.logical_not(finite)
        skipped = read_now(self._loss_scale.consecutive_overflows) > 0
        if self._accumulator is not None:
            ended = tf.equal(read_now(self._accumulator.micro_step), 0)
            skipped = tf.logical_and(skipped, ended)
        return skipped

    def read_state(self) -> dict[str, float | int]:
        """Reads the whole scale state to the host as Python numbers (also under strategies).

        Call it outside the step (callbacks do, at their logging interval).

        Returns:
            Dict keyed by `STATE_NAMES`: `loss_scale` (a float) and the integer counters,
            and the step numbers of `LossScale.snapshot`: `step` (steps attempted so far,
            skipped ones counted) and `last_overflow_step` (-1: none).
        """
        state = {name: getattr(self, name).numpy().item() for name in STATE_NAMES}
        numbers = self._loss_scale.step_numbers(self.iterations)
        state.update({key: int(value.numpy()) for key, value in numbers.items()})
        return {**state, "loss_scale": float(state["loss_scale"])}

    # ------------------------------------------------------------ overflow attribution
    def overflow_sources(self) -> tuple[list[Any], list[int], list[int]]:
        """Per variable (in the optimizer's order), the overflow steps its gradient was not
        finite in and the last one (-1: never): host reads, for `overflow_report`."""
        if self._loss_scale.nonfinite_steps is None:  # not built yet
            return [], [], []
        counts = self._loss_scale.nonfinite_steps.numpy().tolist()
        last_steps = self._loss_scale.last_nonfinite_step.numpy().tolist()
        return self.tracked_variables(), counts, last_steps

    def overflow_scale(self) -> float:
        """The scale the last step used if it overflowed (before the backoff), else the
        current scale: the scale to replay a bad batch at (`tfmixprec.explain_overflow`)."""
        last = float(self._loss_scale.last_overflow_scale.numpy())
        if int(self.consecutive_overflows.numpy()) > 0 and last > 0:  # 0: not recorded
            return last
        return float(self.loss_scale.numpy())

    def overflow_report(self, model: keras.Model | None = None) -> OverflowReport:
        """Per layer, the overflow steps its gradients took part in: layers named by `model`,
        or by their variables' paths (`tfmixprec.overflow_report(model)` passes the model)."""
        overflows = int(self.overflow_steps.numpy())
        last = int(self.last_overflow_step().numpy()) if overflows else -1
        return build_report(*self.overflow_sources(), overflows, last, model)

    # ------------------------------------------------------------ reporting
    def check_min_scale(self) -> None:
        """Warns or raises (per `on_min_scale`) if a step overflowed at `min_scale`.

        Reads one variable, so call it outside the step. It runs on its own after every eager
        step, at the end of `fit`, every 50 batches of a `MixedPrecisionModel`'s `fit`, and at
        the logging interval of `LossScaleMonitor` and `OverflowGuard`.

        Raises:
            FloatingPointError: With `on_min_scale="raise"`, naming the step.
        """
        if self.on_min_scale == "ignore" or self._min_scale_reported:
            return
        message = _min_scale_report(self._loss_scale)
        if message is None:
            return
        self._min_scale_reported = True
        if self.on_min_scale == "raise":
            raise FloatingPointError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def get_config(self) -> dict[str, Any]:
        """Every knob (Keras's key `dynamic_growth_steps` for the interval) and the inner
        optimizer, serialized."""
        inner = keras.saving.serialize_keras_object(self.inner_optimizer)
        config = {"name": self.name, "inner_optimizer": inner}
        return {**config, **{key: getattr(self, key) for key in CONFIG_NAMES}}

    # ------------------------------------------------------------ upkeep (outside the step)
    def reset_longest_overflow_run(self) -> None:
        """Starts `longest_overflow_run` from 0 again (outside the step; `OverflowGuard` calls
        it at `on_train_begin`, then reads the longest run at each check)."""
        self._loss_scale.longest_overflow_run.assign(0)

    def start_at(self, scale: float) -> None:
        """Before the first step, starts the scale at `scale` (`CalibrationReport.apply`):
        the scale and `initial_scale` in the config.

        Raises:
            ValueError: If `scale` is not a valid `initial_scale` for the bounds.
        """
        self._loss_scale.start_at(scale)
        self.loss_scale_config = self._loss_scale.config
        self.initial_scale = self.loss_scale_config.initial_scale  # Keras's attribute

    def restart_at(self, scale: float) -> None:
        """After `PrecisionRepair` moved layers to float32, between steps: the scale at `scale`
        (clipped to the bounds) and the growth and `min_scale` counts from the start (so the
        end of `fit` does not report an overflow at `min_scale` the repair fixed)."""
        self._loss_scale.restart_at(scale)
        self._min_scale_reported = False

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """Called by Keras at the end of `fit`; also reports a `min_scale` overflow and a
        gradient accumulation window the `fit` left partly summed."""
        super().finalize_variable_values(var_list)
        self.check_min_scale()
        summed = int(self._accumulator.micro_step.numpy()) if self._accumulator else 0
        if summed:
            warnings.warn(
                f"fit ended inside a gradient accumulation window: {summed} of "
                f"{self.accumulation_steps} micro-batches are summed, and the next fit's "
                "first window counts them (its first applied step covers them). Make the "
                "steps of a fit a multiple of accumulation_steps, or call "
                "optimizer.discard_partial_window() to drop them. "
                f"{docs_page('guides/fit-and-callbacks')}",
                RuntimeWarning,
                stacklevel=2,
            )

    def discard_partial_window(self) -> int:
        """Drops the micro-batches summed so far in the current accumulation window (call it
        outside the step, e.g. after a `fit`).

        Returns:
            How many micro-batches were dropped (0 without accumulation).
        """
        if self._accumulator is None:
            return 0
        summed = int(self._accumulator.micro_step.numpy())
        self._accumulator.clear()
        return summed

    # ------------------------------------------------------------ serialization
    def save_own_variables(self, store: Any) -> None:
        """Writes the state for a `.keras` / `.weights.h5` file: tfmixprec's own variables by
        name, with a format version (see `tfmixprec.scaling.state_file`), the inner optimizer's by
        position."""
        save(*self._own_and_inner(), store, self._trained())

    def load_own_variables(self, store: Any) -> None:
        """Reads a file's state: by name; a file from tfmixprec 0.1 to 0.3 (by position)
        through the layout of the release that wrote it (what it lacks starts fresh). A file
        whose state does not fit this optimizer is refused with a `ValueError` before
        anything is assigned."""
        load(*self._own_and_inner(), store, f"optimizer {self.name!r}", self._trained())

    def _trained(self) -> list[Any]:
        """The variables it was built with (none before it is built)."""
        return self.tracked_variables() if self.built else []

    def _own_and_inner(self) -> tuple[list[Any], list[Any]]:
        inner = list(self.inner_optimizer.variables)
        everything = list(self.variables)  # its own, then the inner optimizer's
        return everything[: len(everything) - len(inner)], inner

    @classmethod
    def from_keras(cls, keras_optimizer: Any, **kwargs: Any) -> LossScaleOptimizer:
        """The tfmixprec equivalent of Keras's own `keras.optimizers.LossScaleOptimizer`: the
        same inner optimizer object (its slots and `iterations` included), initial scale and
        `dynamic_growth_steps`, and, if Keras's was built (used), built for the same variables
        with its current scale and step counter. Create it in the strategy scope the model's
        variables belong to. `kwargs` override the other constructor arguments.

        Raises:
            TypeError: If `keras_optimizer` is not Keras's own `LossScaleOptimizer`.
        """
        return _from_keras(cls, keras_optimizer, kwargs)

    @classmethod
    def from_config(
        cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None
    ) -> LossScaleOptimizer:
        """Creates the optimizer from `get_config()` (also from Keras's own LSO config)."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


def _from_keras(cls: type, keras_optimizer: Any, kwargs: dict[str, Any]) -> LossScaleOptimizer:
    if not isinstance(keras_optimizer, keras.optimizers.LossScaleOptimizer) or isinstance(
        keras_optimizer, LossScaleOptimizer
    ):
        raise TypeError(
            "from_keras() converts Keras's own keras.optimizers.LossScaleOptimizer. Received: "
            f"keras_optimizer of type {type(keras_optimizer).__module__}."
            f"{type(keras_optimizer).__name__}"
        )
    scales = [float(keras_optimizer.initial_scale)]
    if keras_optimizer.built:  # Keras's scale has no bounds: widen tfmixprec's to hold it
        scales.append(float(keras_optimizer.dynamic_scale.numpy()))
    settings = dict(
        initial_scale=scales[0],
        growth_interval=keras_optimizer.dynamic_growth_steps,
        min_scale=min(LossScaleConfig.min_scale, *scales),
        max_scale=max(LossScaleConfig.max_scale, *scales),
        name=keras_optimizer.name,
    )
    new = cls(keras_optimizer.inner_optimizer, **{**settings, **kwargs})
    if keras_optimizer.built:
        with keras.name_scope(new.name, caller=new):
            new.build(built_variables(keras_optimizer))
        new.loss_scale.assign(keras_optimizer.dynamic_scale)
        new.good_steps.assign(keras_optimizer.step_counter)
    return new


def build_before_fit(model: Any, optimizer: Any = None) -> None:
    """Makes `model`'s optimizer's variables (or `optimizer`'s, for `model`'s variables)
    before a step that trains `model` is traced, where the model is built and no strategy is
    in use (Keras makes them itself under one): else Keras makes them in the step's first
    trace, and TensorFlow, seeing variables made, traces the step again
    (`MixedPrecisionModel.fit`, the callbacks' `on_train_begin` and `make_train_step`).

    A model built with a layer still unbuilt (a subclassed model called once in inference,
    whose layer runs in training only) is left to Keras: that layer makes its variables in
    the trace, and an optimizer built without them would not know them."""
    optimizer = model.optimizer if optimizer is None else optimizer
    if optimizer.built or not model.built or tf.distribute.has_strategy():
        return
    if not every_layer_built(model):
        return
    if model.distribute_strategy is tf.distribute.get_strategy():  # the model's: none
        optimizer.build(model.trainable_variables)
