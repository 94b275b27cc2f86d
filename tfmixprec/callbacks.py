"""Keras callbacks that read the optimizer's loss-scale state and the step logs.

They never keep their own copy of the scale: they read the optimizer's variables, and only at
their logging interval (values put into `logs` on other batches are tensors, not host reads).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._validate import check_int_at_least_one
from tfmixprec.loss_scale import LOG_KEYS
from tfmixprec.optimizer import LossScaleOptimizer
from tfmixprec.unscaling import gradient_values

__all__ = [
    "LossScaleMonitor",
    "OverflowGuard",
    "GradientRangeMonitor",
    "GradientRangeStats",
    "gradient_range_stats",
    "loss_scale_optimizer_of",
]

FLOAT16_TINIEST = 2.0**-24  # smallest float16 subnormal: below it, values flush to zero
FLOAT16_SMALLEST_NORMAL = 2.0**-14
FLOAT16_MAX = 65504.0


def loss_scale_optimizer_of(model: Any, who: str) -> LossScaleOptimizer:
    """Returns `model.optimizer` if it is a tfmixprec `LossScaleOptimizer`, else raises."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, LossScaleOptimizer):
        raise TypeError(
            f"{who} reads the loss-scale state of a tfmixprec.LossScaleOptimizer, but "
            f"model.optimizer is {type(optimizer).__name__}. Compile with "
            "optimizer=tfmixprec.LossScaleOptimizer(your_optimizer), or use "
            "tfmixprec.MixedPrecisionModel, whose compile() wraps it for you."
        )
    return optimizer


def format_scale(scale: float) -> str:
    """32768.0 -> '32768'; 0.25 -> '0.25' (no exponent notation for whole scales)."""
    return str(int(scale)) if scale >= 1 and float(scale).is_integer() else f"{scale:g}"


@keras.saving.register_keras_serializable(package="tfmixprec")
class LossScaleMonitor(keras.callbacks.Callback):
    """Adds `loss_scale`, `overflow`, `overflow_steps` and `skipped_fraction` to the logs.

    At every batch end the values are added as tensors read from the optimizer (no host
    sync); at epoch end as Python floats. With `verbose=1`, every `log_every` batches it
    prints one line when there were overflows since the last report, e.g.
    `step 1200: 3 overflows since last report, loss scale 32768 -> 4096`.

    Args:
        verbose: Int. 0 (silent) or 1 (print overflow events).
        log_every: Int. Batches between reports (the only host reads it makes).

    Example:

    >>> model.fit(x, y, callbacks=[tfmixprec.LossScaleMonitor(verbose=1)])
    """

    def __init__(self, verbose: int = 0, log_every: int = 100) -> None:
        super().__init__()
        if verbose not in (0, 1):
            raise ValueError(f"verbose must be 0 or 1. Received: verbose={verbose!r}")
        self.verbose = verbose
        self.log_every = check_int_at_least_one("log_every", log_every)
        self.events: list[str] = []
        self._step = 0
        self._reported = (0, None)
        self._snapshot: Any = None
        self._snapshot_of: Any = None

    def get_config(self) -> dict[str, Any]:
        return {"verbose": self.verbose, "log_every": self.log_every}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LossScaleMonitor:
        return cls(**config)

    def on_train_begin(self, logs: dict | None = None) -> None:
        opt = loss_scale_optimizer_of(self.model, "LossScaleMonitor")
        self._step = 0
        state = opt.read_state()
        self._reported = (state["overflow_steps"], state["loss_scale"])

    def _values(self, opt: LossScaleOptimizer) -> dict[str, Any]:
        # One compiled call per batch instead of several eager ops: the values stay on the
        # device (tensors), nothing is read to the host here.
        if self._snapshot is None or self._snapshot_of is not opt:
            self._snapshot = tf.function(opt.snapshot)
            self._snapshot_of = opt
        return self._snapshot()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        logs = logs if logs is not None else {}
        opt = loss_scale_optimizer_of(self.model, "LossScaleMonitor")
        self._step += 1
        if not all(key in logs for key in LOG_KEYS):
            # Keras's own train_step: compute them here (tfmixprec's returns them already,
            # computed in the graph, which costs nothing per batch).
            logs.update(self._values(opt))
        if self._step % self.log_every == 0:
            self._report(opt)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = logs if logs is not None else {}
        opt = loss_scale_optimizer_of(self.model, "LossScaleMonitor")
        logs.update({k: float(v.numpy()) for k, v in self._values(opt).items()})
        self._report(opt)

    def _report(self, opt: LossScaleOptimizer) -> None:
        state = opt.read_state()
        overflows, scale = state["overflow_steps"], state["loss_scale"]
        before_overflows, before_scale = self._reported
        if overflows > before_overflows:
            line = (
                f"step {self._step}: {overflows - before_overflows} overflow"
                f"{'s' if overflows - before_overflows != 1 else ''} since last report, "
                f"loss scale {format_scale(before_scale)} -> {format_scale(scale)}"
            )
            self.events.append(line)
            if self.verbose:
                print(line)
        self._reported = (overflows, scale)
        opt.check_min_scale()


@keras.saving.register_keras_serializable(package="tfmixprec")
class OverflowGuard(keras.callbacks.Callback):
    """Stops training on a divergence, not on an ordinary overflow.

    It stops (sets `model.stop_training`) when the loss scale has sat at `min_scale` for
    `patience` steps, or after `max_consecutive` overflow steps in a row: that is bad data or a
    real divergence, not a scale finding its level. Unlike `keras.callbacks.TerminateOnNaN` an
    isolated overflow never stops it.

    Args:
        patience: Int. Steps at `min_scale` (still overflowing or not) before stopping.
        max_consecutive: Int. Consecutive overflow steps before stopping.
        restore_weights: Bool. On stopping, restore the last weights seen after an applied step
            with a finite loss (copied to the host at every check; costs memory and time).
        raise_error: Bool. Raise `FloatingPointError` with the message instead of only stopping.
        check_every: Int. Batches between checks (each check reads two variables).
        verbose: Int. 1 prints the stop message.

    Example:

    >>> guard = tfmixprec.OverflowGuard(patience=200, max_consecutive=20)
    >>> model.fit(x, y, callbacks=[guard]); guard.stop_message
    """

    def __init__(
        self,
        patience: int = 100,
        max_consecutive: int = 20,
        restore_weights: bool = False,
        raise_error: bool = False,
        check_every: int = 1,
        verbose: int = 1,
    ) -> None:
        super().__init__()
        self.patience = check_int_at_least_one("patience", patience)
        self.max_consecutive = check_int_at_least_one("max_consecutive", max_consecutive)
        self.check_every = check_int_at_least_one("check_every", check_every)
        for name, value in (("restore_weights", restore_weights), ("raise_error", raise_error)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False. Received: {name}={value!r}")
        self.restore_weights = restore_weights
        self.raise_error = raise_error
        self.verbose = verbose
        self.stopped_step: int | None = None
        self.stop_message: str | None = None
        self._step = 0
        self._at_min_since: int | None = None
        self._good_weights: list[np.ndarray] | None = None

    def get_config(self) -> dict[str, Any]:
        return {
            "patience": self.patience,
            "max_consecutive": self.max_consecutive,
            "restore_weights": self.restore_weights,
            "raise_error": self.raise_error,
            "check_every": self.check_every,
            "verbose": self.verbose,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> OverflowGuard:
        return cls(**config)

    def on_train_begin(self, logs: dict | None = None) -> None:
        loss_scale_optimizer_of(self.model, "OverflowGuard")
        self._step = 0
        self._at_min_since = None
        self.stopped_step = None
        self.stop_message = None
        if self.restore_weights:
            self._good_weights = self.model.get_weights()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        logs = logs or {}
        self._step += 1
        if self._step % self.check_every:
            return
        opt = loss_scale_optimizer_of(self.model, "OverflowGuard")
        state = opt.read_state()
        consecutive = state["consecutive_overflows"]
        at_min = opt.dynamic and state["loss_scale"] <= opt.min_scale
        if at_min and self._at_min_since is None:
            self._at_min_since = self._step
        elif not at_min:
            self._at_min_since = None
        if self.restore_weights and consecutive == 0:
            loss = logs.get("loss")
            if loss is None or math.isfinite(float(loss)):
                self._good_weights = self.model.get_weights()
        opt.check_min_scale()  # on_min_scale="raise" raises here, "warn" warns once
        reason = None
        if consecutive >= self.max_consecutive:
            reason = (
                f"{consecutive} consecutive overflow steps (max_consecutive={self.max_consecutive})"
            )
        elif (
            self._at_min_since is not None and self._step - self._at_min_since + 1 >= self.patience
        ):
            reason = (
                f"the loss scale has sat at min_scale={opt.min_scale:g} for "
                f"{self._step - self._at_min_since + 1} steps (patience={self.patience})"
            )
        if reason is not None:
            self._stop(reason)

    def _stop(self, reason: str) -> None:
        self.stopped_step = self._step
        restored = ""
        if self.restore_weights and self._good_weights is not None:
            self.model.set_weights(self._good_weights)
            restored = " The last weights with a finite loss were restored."
        self.stop_message = (
            f"OverflowGuard stopped training at step {self._step}: {reason}. This is not a "
            "loss scale finding its level: likely causes are NaN/Inf in the inputs or labels, "
            "a learning rate that is too high, or a layer (softmax, loss, output) that must "
            f"run in float32 (see tfmixprec.audit(model)).{restored}"
        )
        self.model.stop_training = True
        if self.verbose:
            print(self.stop_message)
        if self.raise_error:
            raise FloatingPointError(self.stop_message)


@dataclasses.dataclass
class GradientRangeStats:
    """Where gradient magnitudes fall relative to float16's range.

    Fractions are of all values. `histogram` maps `floor(log2|g|)` to a count (zeros are not
    in it; see `zero_fraction`).
    """

    count: int
    zero_fraction: float
    underflow_fraction: float  # 0 < |g| < 2^-24: flushes to zero in float16
    subnormal_fraction: float  # 2^-24 <= |g| < 2^-14: float16 subnormal (lost precision)
    overflow_fraction: float  # |g| > 65504 (or Inf/NaN): overflows float16
    histogram: dict[int, int]
    min_abs_nonzero: float
    max_abs: float
    log2_abs: np.ndarray = dataclasses.field(repr=False)

    def percentile(self, q: float) -> float:
        """The q-th percentile (0-100) of the non-zero |g|."""
        if self.log2_abs.size == 0:
            return 0.0
        return float(2.0 ** np.percentile(self.log2_abs, q))

    def recommend_loss_scale(self, percentile: float = 1.0, max_scale: float = 2.0**24) -> float:
        """The power-of-two scale that lifts the `percentile`-th smallest non-zero |g| into
        float16's normal range (>= 2^-14) without pushing the largest past 65504.

        Args:
            percentile: Float in [0, 100]. Which of the smallest gradients must be normal.
            max_scale: Float. Upper bound on the answer.

        Returns:
            A float power of two (at least 1).
        """
        if not 0 <= percentile <= 100:
            raise ValueError(f"percentile must be in [0, 100]. Received: percentile={percentile!r}")
        if self.log2_abs.size == 0:
            return 1.0
        small = np.percentile(self.log2_abs, percentile)
        exponent = math.ceil(math.log2(FLOAT16_SMALLEST_NORMAL) - small)
        if self.max_abs > 0 and math.isfinite(self.max_abs):
            exponent = min(exponent, math.floor(math.log2(FLOAT16_MAX / self.max_abs)))
        exponent = min(exponent, math.floor(math.log2(max_scale)))
        return float(2.0 ** max(exponent, 0))


def gradient_range_stats(grads: Sequence[Any]) -> GradientRangeStats:
    """Computes, in float32, where gradient values fall relative to float16's range.

    Args:
        grads: List of tensors, arrays, `tf.IndexedSlices` or `None`.

    Returns:
        A `GradientRangeStats`.

    Example:

    >>> stats = tfmixprec.gradient_range_stats([np.array([0.0, 1e-9, 1e-6, 1.0])])
    >>> stats.underflow_fraction
    0.25
    """
    parts = [
        np.abs(np.asarray(tf.cast(grad, tf.float32)).ravel()) for grad in gradient_values(grads)
    ]
    values = np.concatenate(parts) if parts else np.zeros((0,), np.float32)
    count = int(values.size)
    if count == 0:
        return GradientRangeStats(0, 0.0, 0.0, 0.0, 0.0, {}, 0.0, 0.0, np.zeros((0,), np.float32))
    finite = np.isfinite(values)
    zeros = values == 0
    nonzero = values[(~zeros) & finite]
    log2_abs = np.log2(nonzero).astype(np.float32)
    bins, counts = np.unique(np.floor(log2_abs).astype(np.int64), return_counts=True)
    return GradientRangeStats(
        count=count,
        zero_fraction=float(zeros.sum()) / count,
        underflow_fraction=float((nonzero < FLOAT16_TINIEST).sum()) / count,
        subnormal_fraction=float(
            ((nonzero >= FLOAT16_TINIEST) & (nonzero < FLOAT16_SMALLEST_NORMAL)).sum()
        )
        / count,
        overflow_fraction=float((nonzero > FLOAT16_MAX).sum() + (~finite).sum()) / count,
        histogram={int(b): int(c) for b, c in zip(bins, counts)},
        min_abs_nonzero=float(nonzero.min()) if nonzero.size else 0.0,
        max_abs=float(values[finite].max()) if finite.any() else math.inf,
        log2_abs=log2_abs,
    )


@keras.saving.register_keras_serializable(package="tfmixprec")
class GradientRangeMonitor(keras.callbacks.Callback):
    """Every `every_n_steps`, measures where gradients fall relative to float16's range.

    On one batch (`data`), it computes gradients of the loss scaled by the optimizer's current
    scale, unscales them in float32, and reports the fraction that would flush to zero in
    float16 (|g| < 2^-24), that would be subnormal (< 2^-14), that would overflow (> 65504),
    and exact zeros, for the weight gradients and, optionally, for the activation gradients of
    chosen layers (functional models). This is the analysis of Figure 2 of the
    mixed-precision paper, as a tool. The logs gain `grad_underflow_fraction`,
    `grad_subnormal_fraction`, `grad_overflow_fraction` and `grad_zero_fraction`.

    Args:
        data: Tuple `(x, y)` or `(x, y, sample_weight)`. The batch to measure on.
        every_n_steps: Int. Batches between measurements (each is one extra forward and
            backward pass plus a host read).
        layers: List of layer names. Also measure the gradients of these layers' outputs.
        loss_fn: Callable `(y_true, y_pred)`. Defaults to the compiled `model.loss`.

    Example:

    >>> monitor = tfmixprec.GradientRangeMonitor((x[:64], y[:64]), every_n_steps=100)
    >>> model.fit(x, y, callbacks=[monitor])
    >>> monitor.weight_stats.underflow_fraction, monitor.recommend_loss_scale()
    """

    def __init__(
        self,
        data: tuple,
        every_n_steps: int = 100,
        layers: Sequence[str] | None = None,
        loss_fn: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
            raise ValueError(
                "data must be one batch as a tuple (x, y) or (x, y, sample_weight). "
                f"Received: data of type {type(data).__name__}"
            )
        self.data = tuple(data)
        self.every_n_steps = check_int_at_least_one("every_n_steps", every_n_steps)
        self.layers = list(layers or [])
        self.loss_fn = loss_fn
        self.weight_stats: GradientRangeStats | None = None
        self.activation_stats: dict[str, GradientRangeStats] = {}
        self.last_step: int | None = None
        self._step = 0
        self._driver: Any = None  # a TensorBoard callback that drives this monitor
        self._probe: Any = None
        self._compute: Any = None

    def get_config(self) -> dict[str, Any]:
        # The data batch is not serializable; a restored monitor needs it passed again.
        return {"every_n_steps": self.every_n_steps, "layers": self.layers}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GradientRangeMonitor:
        raise TypeError(
            "GradientRangeMonitor holds a data batch and cannot be rebuilt from its config "
            f"alone; create it with GradientRangeMonitor(data, **config). Received: {config!r}"
        )

    def _resolve_loss(self) -> Callable[..., Any]:
        if self.loss_fn is not None:
            return self.loss_fn
        loss = getattr(self.model, "loss", None)
        if isinstance(loss, (str, keras.losses.Loss)) or callable(loss):
            return keras.losses.get(loss) if isinstance(loss, str) else loss
        raise ValueError(
            "GradientRangeMonitor needs a loss: the model's compiled loss "
            f"{loss!r} is not a single loss. Pass loss_fn=... ."
        )

    def _build(self) -> None:
        model = self.model
        loss_fn = self._resolve_loss()
        if self.layers:
            if not hasattr(model, "inputs") or not model.inputs:
                raise ValueError(
                    "Activation gradients (layers=...) need a functional or Sequential model; "
                    f"model {model.name!r} is subclassed. Received: layers={self.layers!r}"
                )
            names = [layer.name for layer in model.layers]
            missing = [name for name in self.layers if name not in names]
            if missing:
                raise ValueError(
                    f"No layer named {missing[0]!r} in model {model.name!r}. Layers: {names}"
                )
            outputs = [model.get_layer(name).output for name in self.layers]
            self._probe = keras.Model(model.inputs, outputs + [model.outputs])
        else:
            self._probe = None

        def compute(x, y, sample_weight, scale):
            with tf.GradientTape() as tape:
                # Record from the inputs on, so that layers which pass a tensor through
                # unchanged still have an activation gradient.
                for tensor in tf.nest.flatten(x):
                    if tensor.dtype.is_floating:
                        tape.watch(tensor)
                if self._probe is not None:
                    results = self._probe(x, training=False)
                    activations, y_pred = results[:-1], results[-1]
                    if isinstance(y_pred, list) and len(y_pred) == 1:
                        y_pred = y_pred[0]
                else:
                    activations, y_pred = [], model(x, training=False)
                if sample_weight is None:
                    loss = loss_fn(y, y_pred)
                else:
                    loss = loss_fn(y, y_pred, sample_weight)
                scaled = tf.cast(loss, tf.float32) * scale
            grads = tape.gradient(scaled, [model.trainable_variables, activations])
            return [
                [None if g is None else tf.cast(g, tf.float32) / scale for g in group]
                for group in grads
            ]

        self._compute = tf.function(compute)

    def measure(self) -> GradientRangeStats:
        """Measures now, on `data`; returns (and keeps) the weight-gradient stats."""
        if self._compute is None:
            self._build()
        opt = getattr(self.model, "optimizer", None)
        scale = opt.read_state()["loss_scale"] if isinstance(opt, LossScaleOptimizer) else 1.0
        x, y = self.data[0], self.data[1]
        sample_weight = self.data[2] if len(self.data) == 3 else None
        x = tf.nest.map_structure(tf.convert_to_tensor, x)
        weight_grads, activation_grads = self._compute(x, y, sample_weight, tf.constant(scale))
        self.weight_stats = gradient_range_stats(weight_grads)
        self.activation_stats = {
            name: gradient_range_stats([g]) for name, g in zip(self.layers, activation_grads)
        }
        self.last_step = self._step
        return self.weight_stats

    def recommend_loss_scale(self, percentile: float = 1.0, which: str | None = None) -> float:
        """The loss scale that moves the `percentile`-th smallest gradient into float16's
        normal range (see `GradientRangeStats.recommend_loss_scale`).

        Args:
            percentile: Float. Which of the smallest non-zero |g| must become normal.
            which: String. A layer name from `layers` (its activation gradients), or `None`
                for the weight gradients.
        """
        if self.weight_stats is None:
            self.measure()
        stats = self.weight_stats if which is None else self.activation_stats.get(which)
        if stats is None:
            raise ValueError(
                f"which must be None or one of {self.layers}. Received: which={which!r}"
            )
        return stats.recommend_loss_scale(percentile)

    def step(self, logs: dict | None = None) -> bool:
        """Counts one batch; measures on every `every_n_steps`-th. Returns whether it did."""
        self._step += 1
        if self._step % self.every_n_steps:
            return False
        stats = self.measure()
        if logs is not None:
            logs.update(
                {
                    "grad_underflow_fraction": stats.underflow_fraction,
                    "grad_subnormal_fraction": stats.subnormal_fraction,
                    "grad_overflow_fraction": stats.overflow_fraction,
                    "grad_zero_fraction": stats.zero_fraction,
                }
            )
        return True

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._step = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._driver is not None:
            return  # the TensorBoard callback calls step() itself
        self.step(logs if logs is not None else {})
