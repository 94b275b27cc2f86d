"""The loss-scale state machine as one unit: config, state, and the functions over them.

`LossScaleConfig` is frozen and validated. `check(grads, indices, n)` is the step's finite
check (one read of each gradient; whether all are finite and which are not). `LossScale` holds
the state as variables and has the small functions a step needs: `scale(loss)`,
`unscale(grads, divisor)` (and the two sides of the unscaling contract, `unscale_returned` /
`unscale_received`), `adjust(finite, iteration, evidence)` (the transition, as graph ops,
counting per variable which gradients were not finite) and `snapshot(iterations)`, the one
reader of the values every other part of tfmixprec shows (loss scale, whether the last step
overflowed, total overflow steps, skipped fraction). Nothing else computes those values.

The unscaling contract (which gradients reaching `apply` are already unscaled) is held by the
unit's `tfmixprec.unscaling.UnscaleLedger`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from tfmixprec._common.validate import (
    check_bool,
    check_float32_scale,
    check_int_at_least_one,
    is_number,
)
from tfmixprec.scaling.unscaling import UnscaleLedger, gradient_values

__all__ = ["LossScaleConfig"]  # what the package exports; the rest is internal

# The values `snapshot()` returns; `fit` logs and callbacks show these and only these.
LOG_KEYS = ("loss_scale", "overflow", "overflow_steps", "skipped_fraction")


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """The knobs of a dynamic or fixed loss scale, validated on creation.

    Args:
        initial_scale: Float. The first (or, with `dynamic=False`, the only) scale.
        dynamic: Bool. `False` keeps the scale at `initial_scale`; the bounds then do not apply.
        growth_interval: Int >= 1. Clean steps before the scale grows (dynamic only).
        growth_factor: Float > 1. Multiplier on growth.
        backoff_factor: Float in (0, 1). Multiplier on backoff.
        min_scale: Float. The scale never backs off below this.
        max_scale: Float. The scale never grows above this.
        hysteresis: Int >= 1. Overflows (since the last growth) before the scale backs off.

    Raises:
        ValueError: For a value out of range, naming it.
        TypeError: For a `dynamic` that is not a bool.
    """

    initial_scale: float = 2.0**15
    dynamic: bool = True
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    hysteresis: int = 1

    def __post_init__(self) -> None:
        check_bool("dynamic", self.dynamic)
        fields = {
            "initial_scale": check_float32_scale("initial_scale", self.initial_scale),
            "growth_interval": check_int_at_least_one("growth_interval", self.growth_interval),
            "hysteresis": check_int_at_least_one("hysteresis", self.hysteresis),
            "min_scale": check_float32_scale("min_scale", self.min_scale),
            "max_scale": check_float32_scale("max_scale", self.max_scale),
        }
        if not is_number(self.growth_factor) or not (1 < self.growth_factor < 2.0**64):
            raise ValueError(
                "growth_factor must be a finite number > 1. "
                f"Received: growth_factor={self.growth_factor!r}"
            )
        if not is_number(self.backoff_factor) or not (0 < self.backoff_factor < 1):
            raise ValueError(
                "backoff_factor must be in (0, 1). "
                f"Received: backoff_factor={self.backoff_factor!r}"
            )
        low, high, initial = fields["min_scale"], fields["max_scale"], fields["initial_scale"]
        if self.dynamic and low > high:
            raise ValueError(
                f"min_scale must be <= max_scale. Received: min_scale={low!r}, max_scale={high!r}"
            )
        if self.dynamic and not low <= initial <= high:
            raise ValueError(
                f"initial_scale must be within [min_scale, max_scale] = [{low!r}, {high!r}]; "
                "change initial_scale or widen the bounds (or use dynamic=False for a fixed "
                f"scale). Received: initial_scale={initial!r}"
            )
        fields["growth_factor"] = float(self.growth_factor)
        fields["backoff_factor"] = float(self.backoff_factor)
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @property
    def is_identity(self) -> bool:
        """A fixed scale of 1: scaling and unscaling do nothing."""
        return not self.dynamic and self.initial_scale == 1.0


def default_config(float16: bool) -> LossScaleConfig:
    """The loss scale tfmixprec picks when it picks for you (compile, `make_train_step`, a
    callback adopting Keras's optimizer): for a model that computes in float16, a dynamic scale
    from 2^15 (Keras's recipe); for bfloat16 and float32 a fixed scale of 1, because their
    range is float32's and no scaling is needed (Inf/NaN steps are still skipped and counted).
    The one place this choice is made."""
    return LossScaleConfig() if float16 else LossScaleConfig(initial_scale=1.0, dynamic=False)


def format_scale(scale: float) -> str:
    """A loss scale for people: 32768.0 -> '32768', 0.25 -> '0.25' (whole scales without
    exponent notation)."""
    return str(int(scale)) if scale >= 1 and float(scale).is_integer() else f"{scale:g}"


def read_now(value: Any) -> tf.Tensor:
    """Reads a variable at this point of the program (a Keras variable converted lazily may be
    read after later writes in a `tf.function`). Tensors pass through."""
    if isinstance(value, keras.Variable):
        value = value.value
    if isinstance(value, tf.Variable):
        return value.value()  # one op (`read_value()` adds an `Identity`)
    return tf.convert_to_tensor(value)


def _wide_dtype(dtype: tf.DType) -> tf.DType:
    """float64 stays float64; everything narrower is computed in float32."""
    return tf.float64 if dtype == tf.float64 else tf.float32


def _widen(value: Any) -> tf.Tensor:
    value = tf.convert_to_tensor(value)
    return tf.cast(value, _wide_dtype(value.dtype))


def multiply(value: Any, scale: Any) -> tf.Tensor:
    """`value * scale` in float32 (float64 stays float64): the scaled loss, never in float16
    (`value`: the loss, any float dtype; `scale`: a scalar tensor or number)."""
    value = _widen(value)
    return value * tf.cast(scale, value.dtype)


def divide(grad: Any, divisor: Any) -> Any:
    """`grad / divisor` in float32 (float64 for float64): one gradient of the scaled loss
    (a tensor, `tf.IndexedSlices` or `None`) unscaled, in `grad`'s dtype (`None` stays
    `None`, sparse stays sparse)."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(divide(grad.values, divisor), grad.indices, grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    wide = _wide_dtype(grad.dtype)
    quotient = tf.cast(grad, wide) / tf.cast(divisor, wide)
    return quotient if grad.dtype == wide else tf.cast(quotient, grad.dtype)


def all_finite(grads: Sequence[Any]) -> tf.Tensor:
    """True if no gradient holds an Inf or NaN, on any replica (see `check`)."""
    grads = list(grads)
    return check(grads, range(len(grads)), len(grads))[0]


def check(
    grads: Sequence[Any], indices: Sequence[int], num_variables: int, across_replicas: bool = True
) -> tuple[tf.Tensor, tf.Tensor]:
    """The finite check of one step: whether every gradient is finite, and the evidence of
    which are not.

    One read of each gradient: its float32 sum is non-finite if any element is. A finite
    tensor whose sum exceeds float32's range (|sum| > 3.4e38, a diverged model) also reads
    as non-finite. About twice as fast as `reduce_all(is_finite(g))`. Under a strategy the
    gradients are not all-reduced yet, so the per-gradient verdicts are (one all-reduce of a
    vector with one number a gradient): every replica takes the same branch and blames the
    same variables. A clean step costs the flag only: read the evidence with
    `nonfinite_flags`, on an overflow step.

    Args:
        grads: The step's gradients (`None` for a variable without one).
        indices: The position of each gradient's variable among the optimizer's.
        num_variables: The optimizer's number of variables.
        across_replicas: Bool. False: this replica's verdicts only, no all-reduce (a
            micro-batch of gradient accumulation; the window's are all-reduced at its end).

    Returns:
        `(finite, evidence)`: a scalar bool, and a float32 vector with one entry a variable
        of the optimizer, not finite exactly where the flag saw that variable's gradient as
        not finite (an Inf or NaN, or a float32 sum past float32's range, on any replica).
    """
    where, sums, axes = [], [], {}
    for index, grad in zip(indices, grads):
        if grad is not None:
            where.append(index)
            values = tf.cast(gradient_values([grad])[0], tf.float32)
            sums.append(tf.reduce_sum(values, _axes(values, axes)))
    if not sums:
        return tf.constant(True), tf.zeros([num_variables], tf.float32)
    evidence = tf.stack(sums)
    ctx = tf.distribute.get_replica_context()
    if across_replicas and ctx is not None and ctx.num_replicas_in_sync > 1:
        bad = tf.cast(tf.logical_not(tf.math.is_finite(evidence)), tf.float32)
        bad = ctx.all_reduce(tf.distribute.ReduceOp.SUM, bad)
        evidence = tf.where(bad > 0.0, tf.constant(float("inf")), tf.constant(0.0))
    finite = tf.reduce_all(tf.math.is_finite(evidence))
    if where != list(range(num_variables)):  # a part of the variables, or another order
        evidence = tf.scatter_nd(tf.constant(where, tf.int32)[:, None], evidence, [num_variables])
    return finite, evidence


def _axes(values: tf.Tensor, made: dict[int, tf.Tensor]) -> tf.Tensor | None:
    """All of `values`' axes, one constant a rank for the whole check (None: rank unknown)."""
    rank = values.shape.rank
    if rank is None:
        return None
    if rank not in made:
        made[rank] = tf.constant(list(range(rank)), tf.int32)
    return made[rank]


def nonfinite_flags(evidence: tf.Tensor, dtype: Any = tf.int32) -> tf.Tensor:
    """1 (True, for `dtype=tf.bool`) for each variable whose gradient held an Inf or NaN,
    from `check`'s evidence."""
    flags = tf.logical_not(tf.math.is_finite(evidence))
    return flags if dtype == tf.bool else tf.cast(flags, dtype)


class LossScaleState(NamedTuple):
    """The loss-scale state as values: one field a variable of `LossScale`, under the name
    `next_state` reads and returns (`STATE_FIELDS`).

    Each field is a tensor (or, when the state is read from `LossScale`, a value read at that
    point of the step). The counters are integers of one dtype (the optimizer's: int64 in
    Keras); `scale` and `last_overflow_scale` are float32.
    """

    scale: tf.Tensor  # float32 scalar: the loss scale
    good_steps: tf.Tensor  # clean steps since the scale last grew (or was backed off)
    hysteresis_tracker: tf.Tensor  # overflows left before the scale backs off
    overflow_steps: tf.Tensor  # skipped steps, in all
    consecutive_overflows: tf.Tensor  # skipped steps in a row, now
    last_overflow_iteration: tf.Tensor  # applied steps before the last skip (-1: none)
    min_scale_overflow_iteration: tf.Tensor  # step of the first overflow at min_scale (-1)
    last_overflow_scale: tf.Tensor  # float32: the scale the last overflow used (0: none)
    min_scale_overflows: tf.Tensor  # overflow steps at min_scale since the scale last grew
    longest_overflow_run: tf.Tensor  # since `reset_longest_overflow_run`
    # One entry a variable (None before `LossScale.build`): the overflow steps its gradient
    # was not finite in, and the last such step (-1: never).
    nonfinite_steps: tf.Tensor | None = None
    last_nonfinite_step: tf.Tensor | None = None


# The loss-scale state, by the names `next_state` reads and returns (the variables of
# `LossScale`; `nonfinite_steps` and `last_nonfinite_step` hold one entry a variable).
STATE_FIELDS = LossScaleState._fields


def initial_state(
    config: LossScaleConfig, num_variables: int | None = None, dtype: Any = tf.int64
) -> LossScaleState:
    """The state a new `LossScale` starts in, as constant tensors (counters of `dtype`).
    With `num_variables`, the per-variable attribution fields too."""

    def count(value: int, shape: Any = ()) -> tf.Tensor:
        return tf.fill(shape, tf.constant(value, dtype))

    vectors = {}
    if num_variables is not None:
        vectors = {
            "nonfinite_steps": count(0, [num_variables]),
            "last_nonfinite_step": count(-1, [num_variables]),
        }
    return LossScaleState(
        scale=tf.constant(config.initial_scale, tf.float32),
        good_steps=count(0),
        hysteresis_tracker=count(config.hysteresis),
        overflow_steps=count(0),
        consecutive_overflows=count(0),
        last_overflow_iteration=count(-1),
        min_scale_overflow_iteration=count(-1),
        last_overflow_scale=tf.constant(0.0, tf.float32),
        min_scale_overflows=count(0),
        longest_overflow_run=count(0),
        **vectors,
    )


def step_number(iterations: Any, overflow_steps: Any) -> tf.Tensor:
    """The 0-based number of a step with skipped steps counted: applied steps before it
    (`iterations`) plus overflow steps before it. The one place this convention is computed."""
    overflow_steps = tf.convert_to_tensor(overflow_steps)
    return tf.cast(iterations, overflow_steps.dtype) + overflow_steps


def next_state(
    config: LossScaleConfig,
    state: LossScaleState,
    finite: bool,
    iteration: Any,
    nonfinite: Any = None,
) -> LossScaleState:
    """The loss-scale transition after one step, as a pure function of values.

    In pseudocode (`config`'s knobs by name; `step` is the step's 0-based number, skipped
    steps counted: `iteration + overflow_steps`):

        if finite:
            consecutive_overflows = 0
            good_steps += 1
            if dynamic and good_steps >= growth_interval:       # grow
                scale = min(scale * growth_factor, max_scale)
                good_steps = 0
                min_scale_overflows = 0
                hysteresis_tracker = hysteresis
        else:                                                   # the step was skipped
            last_overflow_scale = scale
            overflow_steps += 1
            consecutive_overflows += 1
            longest_overflow_run = max(longest_overflow_run, consecutive_overflows)
            last_overflow_iteration = iteration
            good_steps = 0
            for each variable v whose gradient was not finite (nonfinite[v] == 1):
                nonfinite_steps[v] += 1
                last_nonfinite_step[v] = step
            if dynamic:
                if scale <= min_scale:                          # `on_min_scale` reads these
                    min_scale_overflows += 1
                    if min_scale_overflow_iteration < 0:
                        min_scale_overflow_iteration = step
                hysteresis_tracker = max(hysteresis_tracker - 1, 0)  # 0 if hysteresis == 1
                if hysteresis_tracker == 0:                     # back off
                    scale = max(scale * backoff_factor, min_scale)

    A fixed scale (`dynamic=False`) never changes; its steps are still counted. The branches
    on values (`grow`, `scale <= min_scale`, ...) are `tf.where` selects, not conditionals:
    the state is made of mirrored variables whose replica writes would need a `merge_call`,
    which a `cond` branch in replica context may not make.

    Args:
        config: `LossScaleConfig`.
        state: `LossScaleState`. The state before the step.
        finite: Python bool. Whether the step's gradients were finite (the caller branches
            on a tensor: `LossScale.adjust`).
        iteration: Int tensor. Applied steps before this step (the optimizer's `iterations`).
        nonfinite: Int or bool vector, or None. After an overflow, 1 (True) for each
            variable whose gradient was not finite (`nonfinite_flags`), counted against it;
            None counts nothing.

    Returns:
        `LossScaleState`. A field the step leaves alone is `state`'s own object (`is`), so a
        caller assigns only the fields that changed.
    """
    if not isinstance(finite, bool):
        raise TypeError(
            "next_state takes finite as a Python bool (branch on a tensor with tf.cond, as "
            f"LossScale.adjust does). Received: finite={finite!r}"
        )
    if finite:
        return state._replace(**_after_finite(config, state))
    return state._replace(**_after_overflow(config, state, iteration, nonfinite))


def reads(config: LossScaleConfig, finite: bool) -> tuple[str, ...]:
    """The fields of the state `next_state` reads for a finite step or for an overflow step
    (it overwrites the others or leaves them alone): `LossScale.adjust` reads only these."""
    if finite:
        return ("good_steps", *_GROWTH_READS) if config.dynamic else ("good_steps",)
    if not config.dynamic:
        return _OVERFLOW_READS
    # With a hysteresis of 1 every overflow backs off: the tracker is not read, it becomes 0.
    backoff = _BACKOFF_READS if config.hysteresis > 1 else _BACKOFF_READS[:-1]
    return _OVERFLOW_READS + backoff


_GROWTH_READS = ("scale", "min_scale_overflows", "hysteresis_tracker")
_OVERFLOW_READS = (
    "scale",
    "overflow_steps",
    "consecutive_overflows",
    "longest_overflow_run",
    "nonfinite_steps",
    "last_nonfinite_step",
)
_BACKOFF_READS = ("min_scale_overflow_iteration", "min_scale_overflows", "hysteresis_tracker")


def _after_finite(config: LossScaleConfig, state: LossScaleState) -> dict[str, tf.Tensor]:
    """A clean step: the run of overflows ends; the scale grows every `growth_interval`.
    (One constant a value: the counters share one dtype.)"""
    zero = tf.zeros_like(state.good_steps)
    one = tf.ones_like(zero)
    new = {"consecutive_overflows": zero}
    counter = state.good_steps + one
    if not config.dynamic:
        return {**new, "good_steps": counter}
    grow = counter >= config.growth_interval
    scale = state.scale
    grown = tf.minimum(scale * config.growth_factor, config.max_scale)
    at_min, tracker = state.min_scale_overflows, state.hysteresis_tracker
    full = one if config.hysteresis == 1 else tf.constant(config.hysteresis, tracker.dtype)
    return {
        **new,
        "scale": tf.where(grow, grown, scale),
        "good_steps": tf.where(grow, zero, counter),
        "min_scale_overflows": tf.where(grow, zero, at_min),
        "hysteresis_tracker": tf.where(grow, full, tracker),
    }


def _after_overflow(
    config: LossScaleConfig, state: LossScaleState, iteration: Any, nonfinite: Any
) -> dict[str, tf.Tensor]:
    """An overflow step: counted, attributed to the variables whose gradients were not finite,
    and (dynamic scale) the scale backs off once `hysteresis` overflows were seen. (One
    constant a value: the counters share one dtype.)"""
    overflows = state.overflow_steps
    zero, one = tf.zeros_like(overflows), tf.ones_like(overflows)
    iteration = tf.cast(iteration, overflows.dtype)
    this_step = step_number(iteration, overflows)
    run = state.consecutive_overflows + one
    new = {
        "last_overflow_scale": state.scale,
        "overflow_steps": overflows + one,
        "consecutive_overflows": run,
        "longest_overflow_run": tf.maximum(state.longest_overflow_run, run),
        "last_overflow_iteration": iteration,
        "good_steps": zero,
    }
    if nonfinite is not None and state.nonfinite_steps is not None:
        nonfinite = tf.convert_to_tensor(nonfinite)
        hit = nonfinite if nonfinite.dtype == tf.bool else nonfinite > 0
        counts = state.nonfinite_steps
        new["nonfinite_steps"] = counts + tf.cast(nonfinite, counts.dtype)
        new["last_nonfinite_step"] = tf.where(hit, this_step, state.last_nonfinite_step)
    if not config.dynamic:
        return new
    return {**new, **_backed_off(config, state, this_step, zero, one)}


def _backed_off(
    config: LossScaleConfig, state: LossScaleState, this_step: Any, zero: Any, one: Any
) -> dict[str, tf.Tensor]:
    """A dynamic scale's overflow: counted at `min_scale`, and backed off once `hysteresis`
    overflows were seen (with a hysteresis of 1, every time: the tracker, 0 or 1, is now 0)."""
    scale, at_min = state.scale, state.min_scale_overflows
    floor = tf.constant(config.min_scale, scale.dtype)
    at_floor = scale <= floor
    first_at_min = tf.logical_and(at_floor, state.min_scale_overflow_iteration < zero)
    backed_off = tf.maximum(scale * config.backoff_factor, floor)
    tracker = zero
    if config.hysteresis > 1:
        tracker = tf.maximum(state.hysteresis_tracker - one, zero)
        backed_off = tf.where(tf.equal(tracker, zero), backed_off, scale)
    return {
        "min_scale_overflow_iteration": tf.where(
            first_at_min, this_step, state.min_scale_overflow_iteration
        ),
        "min_scale_overflows": tf.where(at_floor, at_min + one, at_min),
        "hysteresis_tracker": tracker,
        "scale": backed_off,
    }


class LossScale(tf.Module):
    """The scale state (variables) and the step's functions over it.

    Args:
        config: `LossScaleConfig`. The knobs.
        add_variable: Callable `(name, dtype, initial_value, shape=()) -> variable` creating
            one state variable (the optimizer's, so checkpoints and `.keras` files carry it).
    """

    def __init__(self, config: LossScaleConfig, add_variable: Callable[..., Any]) -> None:
        super().__init__(name="loss_scale")
        self.config = config
        self._add_variable = add_variable
        # Keras's own two variables first, in Keras's order and with its names, so Keras's
        # checkpoints restore into them.
        self.good_steps = add_variable("step_counter", "int", 0)
        self.scale_variable = add_variable("dynamic_scale", "float32", config.initial_scale)
        self.hysteresis_tracker = add_variable("hysteresis_tracker", "int", config.hysteresis)
        self.overflow_steps = add_variable("overflow_steps", "int", 0)
        self.consecutive_overflows = add_variable("consecutive_overflows", "int", 0)
        self.last_overflow_iteration = add_variable("last_overflow_iteration", "int", -1)
        self.min_scale_overflow_iteration = add_variable("min_scale_overflow_iteration", "int", -1)
        self.last_overflow_scale = add_variable("last_overflow_scale", "float32", 0.0)
        # For `OverflowGuard`: overflow steps taken at `min_scale` since
        # the scale last grew, and the longest run of consecutive overflow steps since the
        # last `reset_longest_overflow_run()` (exact with several steps per execution).
        self.min_scale_overflows = add_variable("min_scale_overflows", "int", 0)
        self.longest_overflow_run = add_variable("longest_overflow_run", "int", 0)
        self.ledger = UnscaleLedger()  # not checkpointed: it describes one step
        # Which variables' gradients were not finite (made by `build`, one entry a variable).
        self.nonfinite_steps: Any = None
        self.last_nonfinite_step: Any = None

    def build(self, num_variables: int) -> None:
        """Creates the per-variable state: the unscaling record and the overflow attribution
        (per variable, the overflow steps its gradient was not finite in, and the last one)."""
        self.ledger.build(num_variables)
        self.num_variables = num_variables
        add = self._add_variable
        self.nonfinite_steps = add("nonfinite_steps", "int", 0, (num_variables,))
        self.last_nonfinite_step = add("last_nonfinite_step", "int", -1, (num_variables,))

    def start_at(self, scale: float) -> None:
        """Before the first step: the scale starts at `scale` (validated as `initial_scale`,
        within the bounds), and the config says so."""
        self.config = dataclasses.replace(self.config, initial_scale=scale)
        self.scale_variable.assign(self.config.initial_scale)

    def restart_at(self, scale: float) -> None:
        """After a repair (`PrecisionRepair`), between steps: the scale at `scale` (within the
        bounds), and the counts of growth, hysteresis and overflows at `min_scale` from the
        start: the overflows the repaired layers caused are not the scale's to answer for.
        A fixed scale (`dynamic=False`) is the user's: left as it is."""
        if not self.config.dynamic:
            return
        low, high = self.config.min_scale, self.config.max_scale
        self.scale_variable.assign(min(max(float(scale), low), high))
        self.good_steps.assign(0)
        self.hysteresis_tracker.assign(self.config.hysteresis)
        self.min_scale_overflows.assign(0)
        self.min_scale_overflow_iteration.assign(-1)

    # ------------------------------------------------------------ the step
    def step_scale(self) -> tf.Tensor | None:
        """The scale read now, for a traced step to scale, unscale and branch with; None
        without scaling (nothing to read) and eagerly (each use reads)."""
        if self.config.is_identity or tf.executing_eagerly():
            return None
        return read_now(self.scale_variable)

    def scale(self, loss: Any, scale: Any = None) -> tf.Tensor:
        """`loss * scale` (`scale`: the scale read already, else read here), computed in
        float32 (float64 stays float64). Starts a step: the gradients reaching
        `unscale_received` are scaled until `unscale_returned` runs."""
        if self.config.is_identity:
            return _widen(loss)
        self.ledger.clear()
        return multiply(loss, read_now(self.scale_variable) if scale is None else scale)

    def unscale(
        self, grads: Sequence[Any], divisor: Any = None, keep: Sequence[bool] | None = None
    ) -> list[Any]:
        """Divides each gradient by `divisor` (default: the current scale) in float32.

        `None` stays `None`, `tf.IndexedSlices` stay sparse, float64 is divided in float64.
        Gradients whose `keep` entry is True are returned as they are (float8 variables'
        "gradients" are new values, not gradients).
        """
        grads = list(grads)
        if self.config.is_identity:
            return grads
        divisor = read_now(self.scale_variable) if divisor is None else divisor
        keep = [False] * len(grads) if keep is None else list(keep)
        return [g if k else divide(g, divisor) for g, k in zip(grads, keep)]

    def unscale_returned(
        self,
        grads: Sequence[Any],
        keep: Sequence[bool],
        indices: list[int] | None,
        knew_float8: bool = False,
    ) -> list[Any]:
        """Unscales `grads` for the caller (TF 2's `get_unscaled_gradients`) and records, for
        this replica, that the gradients of the variables at `indices` (all of them if None:
        before the optimizer is built) are now unscaled."""
        grads = list(grads)
        if self.config.is_identity:
            return grads
        scale = read_now(self.scale_variable)
        check = self.ledger.record(grads, scale, indices, knew_float8)
        with tf.control_dependencies([check]):
            return self.unscale(grads, scale, keep=keep)

    def unscale_received(
        self,
        grads: Sequence[Any],
        keep: Sequence[bool],
        indices: list[int],
        has_float8: bool,
        scale: Any = None,
    ) -> list[Any]:
        """Unscales the gradients `apply` received, each unless `unscale_returned` already
        did (see `tfmixprec.unscaling`). `indices`: their variables' positions; `scale`: the
        scale they were scaled with, where read already."""
        grads = list(grads)
        if self.config.is_identity:
            return grads
        scale = read_now(self.scale_variable) if scale is None else scale
        return self.ledger.unscale_for_apply(
            grads, indices, scale, has_float8, lambda g, i, d: g if keep[i] else divide(g, d)
        )

    def adjust(
        self, finite: bool | tf.Tensor, iteration: Any, evidence: Any = None, scale: Any = None
    ) -> None:
        """The transition after one step (`next_state`), assigned to the state variables.

        Args:
            finite: Bool or scalar bool tensor. Whether the step's gradients were finite. A
                Python bool builds only that branch (the optimizer calls each from a `cond`).
            iteration: Int tensor or variable. Applied steps so far (the optimizer's
                `iterations`), before this step; read only for an overflow.
            evidence: The vector from `check`, or `None`. On an overflow, it tells which
                variables' gradients were not finite (counted in the attribution state).
            scale: The scale the step used, where read before the branch (not read again).
        """
        if not isinstance(finite, bool):
            tf.cond(
                finite,
                lambda: self.adjust(True, iteration, scale=scale),
                lambda: self.adjust(False, iteration, evidence, scale),
            )
            return
        flags = None
        if not finite and evidence is not None and self.nonfinite_steps is not None:
            flags = nonfinite_flags(evidence, tf.bool)
        state = self.state_now(reads(self.config, finite), {"scale": scale})
        new = next_state(self.config, state, finite, iteration, flags)
        variables = self.variables_by_name()
        for name, before, after in zip(STATE_FIELDS, state, new):
            if after is not before:  # only the fields the step changed
                variables[name].assign(after)

    def state_now(
        self, names: Sequence[str] = STATE_FIELDS, known: dict[str, Any] | None = None
    ) -> LossScaleState:
        """The state variables' values, read at this point of the step (`read_now`); with
        `names`, only those fields (the others `None`: a branch reads what it uses); `known`:
        values read already this step (None: not known), not read again."""
        variables = self.variables_by_name()
        known = {k: v for k, v in (known or {}).items() if v is not None}
        wanted = [name for name in names if name in variables]
        read = {n: known[n] if n in known else read_now(variables[n]) for n in wanted}
        return LossScaleState(**{name: read.get(name) for name in STATE_FIELDS})

    def variables_by_name(self) -> dict[str, Any]:
        """The state variables under the names `next_state` uses (`STATE_FIELDS`)."""
        found = {name: getattr(self, name) for name in STATE_FIELDS if name != "scale"}
        found["scale"] = self.scale_variable
        return {name: variable for name, variable in found.items() if variable is not None}

    def attribution_variables(self) -> list[Any]:
        """The variables the overflow attribution added (none of them before `build`)."""
        vectors = [self.nonfinite_steps, self.last_nonfinite_step]
        return [self.last_overflow_scale] + [v for v in vectors if v is not None]

    # ------------------------------------------------------------ readers
    def snapshot(self, iterations: Any) -> dict[str, tf.Tensor]:
        """The values every reader shows, as float32 tensors read here (no host sync).

        Args:
            iterations: Int tensor or variable. Applied steps (the optimizer's `iterations`).

        Returns:
            Dict with `LOG_KEYS`: `loss_scale`, `overflow` (1.0 if the last step was skipped),
            `overflow_steps` (total) and `skipped_fraction` (overflow steps over all steps);
            and the step numbers: `step`, the steps attempted so far (skipped ones counted:
            the 0-based number of the next step), and `last_overflow_step` (-1: none yet).
        """
        return {**self.log_values(iterations), **self.step_numbers(iterations)}

    def log_values(self, iterations: Any, skipped: Any = None) -> dict[str, tf.Tensor]:
        """`snapshot()`'s `LOG_KEYS` alone: what a step puts in the logs. `skipped`: whether
        the step was skipped, where the caller read it already (else read here)."""
        overflows = tf.cast(read_now(self.overflow_steps), tf.float32)
        attempted = overflows + tf.cast(read_now(iterations), tf.float32)
        if skipped is None:
            skipped = read_now(self.consecutive_overflows) > 0
        return {
            "loss_scale": read_now(self.scale_variable),
            "overflow": tf.cast(skipped, tf.float32),
            "overflow_steps": overflows,
            # no step yet (a window's first micro-batches): 0, as overflows / max(attempted, 1)
            "skipped_fraction": tf.math.divide_no_nan(overflows, attempted),
        }

    def step_numbers(self, iterations: Any) -> dict[str, tf.Tensor]:
        """`snapshot()`'s step numbers alone (0-based, skipped steps counted): `step` and
        `last_overflow_step`."""
        total = read_now(self.overflow_steps)
        last = step_number(read_now(self.last_overflow_iteration), total - 1)
        return {
            "step": step_number(read_now(iterations), total),
            "last_overflow_step": tf.where(total > 0, last, tf.constant(-1, last.dtype)),
        }
