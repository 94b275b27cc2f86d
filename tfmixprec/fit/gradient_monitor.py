"""`GradientRangeMonitor`: during `fit`, the gradients of one fixed batch at the
optimizer's current loss scale, against float16's range."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmixprec._common.layers import all_layers, compiled_loss, loss_value
from tfmixprec._common.validate import check_int_at_least_one
from tfmixprec.fit.adoption import loss_scaling_of
from tfmixprec.fit.reader import FitReader
from tfmixprec.scaling.gradient_range import GradientRangeStats, gradient_range_stats
from tfmixprec.scaling.loss_scale import divide, multiply

__all__ = ["GradientRangeMonitor"]


def _activation_probe(model: Any, layers: list[str]) -> keras.Model:
    """A model with the outputs of `layers` and then the model's outputs."""
    if not hasattr(model, "inputs") or not model.inputs:
        raise ValueError(
            "Activation gradients (layers=...) need a functional or Sequential model; "
            f"model {model.name!r} is subclassed. Received: layers={layers!r}"
        )
    names = [layer.name for layer in model.layers]
    missing = [name for name in layers if name not in names]
    if missing:
        raise ValueError(f"No layer named {missing[0]!r} in model {model.name!r}. Layers: {names}")
    outputs = [model.get_layer(name).output for name in layers]
    return keras.Model(model.inputs, outputs + [model.outputs])


class GradientRangeMonitor(keras.callbacks.Callback):
    """Every `update_freq` batches, measures where gradients fall relative to float16's range
    (and once at the end of a `fit` shorter than that, so `weight_stats` is never left empty).

    On one batch (`data`), it computes gradients of the loss scaled by the optimizer's current
    scale, unscales them in float32, and reports the fraction that would flush to zero in
    float16 (|g| < 2^-24), that would be subnormal (< 2^-14), that would overflow (> 65504),
    and exact zeros, for the weight gradients and, optionally, for the activation gradients of
    chosen layers (functional models). This is the analysis of Figure 2 of the
    mixed-precision paper, as a tool. The logs gain `grad_underflow_fraction`,
    `grad_subnormal_fraction`, `grad_overflow_fraction` and `grad_zero_fraction`.

    At `on_train_begin` it adopts Keras's own `keras.optimizers.LossScaleOptimizer` as the
    other tfmixprec callbacks do (see `LossScaleMonitor`); without loss scaling it measures at
    a scale of 1.

    Passed to `fit`, it steps itself from its `on_train_batch_end`. Passed to
    `tfmixprec.TensorBoard(gradient_monitor=...)`, the TensorBoard callback drives it (see
    `drive_from` and `driver`): it steps the monitor once per batch and writes what it
    measures; passing the monitor to `fit` as well then still measures once per `update_freq`
    batches.

    It is not serializable (no `get_config`, not registered with `keras.saving`): it holds a
    data batch, which is not config data. Create it again with its batch.

    Args:
        data: Tuple `(x, y)` or `(x, y, sample_weight)`. The batch to measure on.
        update_freq: Int. Batches between measurements (each is one extra forward and
            backward pass plus a host read).
        layers: List of layer names. Also measure the gradients of these layers' outputs.
        loss_fn: Callable `(y_true, y_pred)`. Defaults to the compiled `model.loss`.

    Raises:
        ValueError: If `data` is not one batch or `update_freq` is not an integer >= 1.

    Example:

    >>> monitor = tfmixprec.GradientRangeMonitor((x[:64], y[:64]), update_freq=100)
    >>> model.fit(x, y, callbacks=[monitor])
    >>> monitor.weight_stats.underflow_fraction, monitor.recommend_loss_scale()
    """

    def __init__(
        self,
        data: tuple,
        update_freq: int = 100,
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
        self.update_freq = check_int_at_least_one("update_freq", update_freq)
        self.layers = list(layers or [])
        self.loss_fn = loss_fn
        self.weight_stats: GradientRangeStats | None = None
        self.activation_stats: dict[str, GradientRangeStats] = {}
        self.last_step: int | None = None
        self._step = 0  # steps counted so far in this fit
        self._reader = FitReader("GradientRangeMonitor", self.update_freq)
        self._driver: keras.callbacks.Callback | None = None
        self._loss: Callable[..., Any] | None = None
        self._probe: keras.Model | None = None
        self._compute: Any = None

    @property
    def driver(self) -> keras.callbacks.Callback | None:
        """The callback that steps this monitor, or `None` when it steps itself (read-only;
        set it with `drive_from`)."""
        return self._driver

    def drive_from(self, callback: keras.callbacks.Callback | None) -> None:
        """Lets `callback` step this monitor instead of the monitor's own batch hook.

        The driver calls `step()` once per batch (and `set_model` and `on_train_begin`); the
        monitor's `on_train_batch_end` then does nothing, so a monitor that is also passed to
        `fit` measures once per `update_freq` batches, not twice. `tfmixprec.TensorBoard`
        calls this for the `gradient_monitor` it is given.

        Args:
            callback: `keras.callbacks.Callback` or `None`. The driver; `None` hands the
                stepping back to the monitor.

        Raises:
            TypeError: If `callback` is neither a Keras callback nor `None`.
            ValueError: If another callback already drives this monitor (two drivers would
                step it twice per batch).

        Example:

        >>> monitor = tfmixprec.GradientRangeMonitor((x[:64], y[:64]))
        >>> board = tfmixprec.TensorBoard("runs/exp1", gradient_monitor=monitor)
        >>> monitor.driver is board
        True
        """
        _check_driver(callback, self._driver)
        self._driver = callback

    def _build(self) -> None:
        self._loss = (
            self.loss_fn
            if self.loss_fn is not None
            else compiled_loss(self.model, "GradientRangeMonitor")
        )
        self._probe = _activation_probe(self.model, self.layers) if self.layers else None
        self._compute = tf.function(self._gradients)

    def _forward(self, x: Any) -> tuple[list[Any], Any]:
        """The activations of `layers` and the predictions, in inference mode."""
        if self._probe is None:
            return [], self.model(x, training=False)
        results = self._probe(x, training=False)
        activations, y_pred = results[:-1], results[-1]
        if isinstance(y_pred, list) and len(y_pred) == 1:
            y_pred = y_pred[0]
        return activations, y_pred

    def _gradients(self, x: Any, y: Any, sample_weight: Any, scale: tf.Tensor) -> list[list[Any]]:
        """The unscaled float32 gradients: `[weight gradients, activation gradients]`."""
        with tf.GradientTape() as tape:
            # Record from the inputs on, so that layers which pass a tensor through
            # unchanged still have an activation gradient.
            for tensor in tf.nest.flatten(x):
                if tensor.dtype.is_floating:
                    tape.watch(tensor)
            activations, y_pred = self._forward(x)
            scaled = multiply(loss_value(self._loss, y, y_pred, sample_weight), scale)
        grads = tape.gradient(scaled, [self.model.trainable_variables, activations])
        # Cast before dividing: everything is measured in float32 (a float16 activation
        # gradient divided back into float16 would flush the very values this counts).
        return [
            [None if g is None else divide(tf.cast(g, tf.float32), scale) for g in group]
            for group in grads
        ]

    def measure(self) -> GradientRangeStats:
        """Measures now, on `data`; returns (and keeps) the weight-gradient stats.

        Returns:
            The `GradientRangeStats` of the weight gradients (also in `weight_stats`; the
            activation gradients' are in `activation_stats`).
        """
        if self._compute is None:
            self._build()
        opt = loss_scaling_of(self.model)
        scale = self._reader.state()["loss_scale"] if opt is not None else 1.0  # shared
        x, y = self.data[0], self.data[1]
        sample_weight = self.data[2] if len(self.data) == 3 else None
        # Tensors, not NumPy arrays: tf.function traces again for every new array.
        x, y = tf.nest.map_structure(tf.convert_to_tensor, (x, y))
        if sample_weight is not None:
            sample_weight = tf.convert_to_tensor(sample_weight)
        scale = tf.constant(scale, tf.float32)
        weight_grads, activation_grads = self._compute(x, y, sample_weight, scale)
        self.weight_stats = gradient_range_stats(weight_grads)
        self.activation_stats = {
            name: gradient_range_stats([g]) for name, g in zip(self.layers, activation_grads)
        }
        self.last_step = self._step
        return self.weight_stats

    def recommend_loss_scale(self, percentile: float = 1.0, which: str | None = None) -> float:
        """The loss scale that moves the `percentile`-th smallest gradient into float16's
        normal range (see `GradientRangeStats.recommend_loss_scale`), for a model that computes
        in float16 or float32; 1.0 (no scaling) for a model that computes in bfloat16 and not
        float16: bfloat16 has float32's range, so its gradients need no loss scale.

        Args:
            percentile: Float. Which of the smallest non-zero |g| must become normal.
            which: String. A layer name from `layers` (its activation gradients), or `None`
                for the weight gradients.

        Returns:
            A float power of two (at least 1; 1.0 for a bfloat16 model). Measures first if
            nothing was measured yet.

        Raises:
            ValueError: If `which` is not `None` or one of `layers`.
        """
        if self.weight_stats is None:
            self.measure()
        stats = self.weight_stats if which is None else self.activation_stats.get(which)
        if stats is None:
            raise ValueError(
                f"which must be None or one of {self.layers}. Received: which={which!r}"
            )
        if _needs_no_loss_scale(self.model):
            return 1.0
        return stats.recommend_loss_scale(percentile)

    def step(self, logs: dict | None = None, batch: int | None = None) -> bool:
        """Counts the steps up to `batch` (one step when `batch` is None); measures when an
        `update_freq`-th step is among them.

        Args:
            logs: Dict or `None`. The batch logs; a measurement adds its `grad_*` fractions.
            batch: Int or None. The index Keras passes to `on_train_batch_end` (with
                `steps_per_execution` > 1, the execution's last step): steps, not calls,
                are counted.

        Returns:
            Whether it measured.
        """
        every = self._reader.every
        due = every.due(every.steps_in_epoch if batch is None else batch)
        self._step = every.steps
        if not due:
            return False
        stats = self.measure()
        if logs is not None:
            logs.update(_log_values(stats))
        return True

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self._reader.set_model(model)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._reader.every.n = self.update_freq  # as it is now (it may be set after __init__)
        driver = self._driver  # a driven monitor shares its driver's fit
        self._reader.train_begin(self.params or getattr(driver, "params", None))
        self._step = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._reader.epoch_begin()  # a driver calls it too

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._reader.epoch_end(logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._driver is not None:
            return  # the driver calls step() itself
        self.step(logs if logs is not None else {}, batch)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._step < self.update_freq:  # a fit shorter than update_freq still measures once
            self.measure()


def _needs_no_loss_scale(model: Any) -> bool:
    """True for a model that computes in bfloat16 and in no float16 layer: bfloat16 has
    float32's range, so no gradient of it flushes to zero for want of a loss scale."""
    dtypes = {layer.dtype_policy.compute_dtype for layer in all_layers(model)}
    return "bfloat16" in dtypes and "float16" not in dtypes


def _log_values(stats: GradientRangeStats) -> dict[str, float]:
    """The `grad_*` fractions a measurement adds to the batch logs."""
    return {
        "grad_underflow_fraction": stats.underflow_fraction,
        "grad_subnormal_fraction": stats.subnormal_fraction,
        "grad_overflow_fraction": stats.overflow_fraction,
        "grad_zero_fraction": stats.zero_fraction,
    }


def _check_driver(callback: Any, driver: Any) -> None:
    """Raises unless `callback` may drive a monitor whose driver is `driver`."""
    if callback is not None and not isinstance(callback, keras.callbacks.Callback):
        raise TypeError(
            "callback must be a keras.callbacks.Callback or None. "
            f"Received: callback of type {type(callback).__name__}"
        )
    if callback is not None and driver is not None and driver is not callback:
        raise ValueError(
            f"This GradientRangeMonitor is already driven by a {type(driver).__name__} "
            "callback; one monitor can have one driver (two would step it twice per batch). "
            "Create one monitor per callback, or call drive_from(None) first. "
            f"Received: callback of type {type(callback).__name__}"
        )
