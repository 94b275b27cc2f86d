"""Tests of gradient_range_stats, GradientRangeStats and GradientRangeMonitor."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec import GradientRangeMonitor, LossScaleOptimizer
from tfmixprec.scaling.gradient_range import FLOAT16_MAX, FLOAT16_SMALLEST_NORMAL, FLOAT16_TINIEST


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batch_logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.batch_logs.append({k: (v, type(v)) for k, v in logs.items()})


def test_float16_range_constants():
    assert FLOAT16_TINIEST == float(np.finfo(np.float16).smallest_subnormal)
    assert FLOAT16_SMALLEST_NORMAL == float(np.finfo(np.float16).smallest_normal)
    assert FLOAT16_MAX == float(np.finfo(np.float16).max)


def test_gradient_range_stats_exact_counts():
    values = np.array([0.0, 0.0, 1e-9, 2.0**-20, 2.0**-14, 1.0, 70000.0, -1e-8], dtype=np.float32)
    stats = tfmixprec.gradient_range_stats([values[:4], None, tf.constant(values[4:])])
    assert stats.count == 8
    assert stats.zero_fraction == 2 / 8
    assert stats.underflow_fraction == 2 / 8
    assert stats.subnormal_fraction == 1 / 8
    assert stats.overflow_fraction == 1 / 8
    assert stats.histogram == {-30: 1, -27: 1, -20: 1, -14: 1, 0: 1, 16: 1}
    assert stats.max_abs == 70000.0
    assert stats.min_abs_nonzero == np.float32(1e-9)


def test_gradient_range_stats_sparse_and_inf():
    sparse = tf.IndexedSlices(tf.constant([[np.inf, 1e-30]]), tf.constant([0]), tf.constant([5, 2]))
    stats = tfmixprec.gradient_range_stats([sparse])
    assert stats.count == 2
    assert stats.overflow_fraction == 0.5 and stats.underflow_fraction == 0.5
    empty = tfmixprec.gradient_range_stats([None])
    assert empty.count == 0 and empty.recommend_loss_scale() == 1.0


def test_recommend_loss_scale():
    stats = tfmixprec.gradient_range_stats([np.full(10, 2.0**-30, np.float32)])
    assert (
        stats.recommend_loss_scale() == 2.0**16
    )  # 2^-30 * 2^16 = 2^-14, float16's smallest normal
    capped = tfmixprec.gradient_range_stats([np.array([2.0**-30, 2.0**10], np.float32)])
    assert capped.recommend_loss_scale(percentile=0) == 32.0  # 1024 * 64 would pass 65504
    assert tfmixprec.gradient_range_stats([np.ones(3)]).recommend_loss_scale() == 1.0
    with pytest.raises(ValueError, match=r"percentile must be in \[0, 100\].*=101"):
        stats.recommend_loss_scale(101)


def _linear_model(scale=1.0):
    """y = x @ w with w = 0 and target 1: the weight gradient is exactly -2 * x."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Identity(name="hidden")(inputs)
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros", name="out")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=scale), loss="mse"
    )
    return model


@pytest.mark.parametrize("scale", [1.0, 2.0**10])
def test_gradient_monitor_on_known_gradients(scale):
    model = _linear_model(scale)
    x = np.array([[1e-10, 2.0**-21, 1.0, 0.0]], np.float32)  # grads: -2x
    y = np.ones((1, 1), np.float32)
    monitor = GradientRangeMonitor((x, y), update_freq=2, layers=["hidden"])
    assert monitor.driver is None  # standalone: it steps itself from on_train_batch_end
    recorder = Recorder()
    model.fit(
        np.repeat(x, 4, 0),
        np.repeat(y, 4, 0),
        batch_size=1,
        verbose=0,
        callbacks=[monitor, recorder],
    )
    stats = monitor.weight_stats
    assert (stats.count, stats.zero_fraction) == (4, 0.25)
    assert (stats.underflow_fraction, stats.subnormal_fraction) == (0.25, 0.25)
    assert stats.histogram == {-33: 1, -20: 1, 1: 1}
    assert monitor.last_step == 4
    logged = [logs for logs in recorder.batch_logs if "grad_underflow_fraction" in logs]
    assert len(logged) == 2  # every 2 of 4 batches
    assert logged[0]["grad_underflow_fraction"][0] == 0.25
    # Activation gradient of `hidden` (dL/dh = -2 * w = 0): all exact zeros.
    assert monitor.activation_stats["hidden"].zero_fraction == 1.0
    # Lifting 2e-10 (the smallest, percentile 0) above 2^-14: 2^19; capped by |g|=2 -> 2^14.
    assert monitor.recommend_loss_scale(percentile=0) == 2.0**14
    with pytest.raises(ValueError, match=r"which must be None or one of \['hidden'\]"):
        monitor.recommend_loss_scale(which="nope")


def test_gradient_monitor_bad_input():
    with pytest.raises(ValueError, match=r"data must be one batch.*type ndarray"):
        GradientRangeMonitor(np.ones((2, 2)))
    with pytest.raises(
        ValueError, match=r"^update_freq must be an integer >= 1. Received: update_freq=0$"
    ):
        GradientRangeMonitor((1, 2), update_freq=0)
    model = _linear_model()
    monitor = GradientRangeMonitor((np.ones((1, 4)), np.ones((1, 1))), layers=["missing"])
    monitor.set_model(model)
    with pytest.raises(ValueError, match=r"No layer named 'missing'"):
        monitor.measure()


def _counting(monitor):
    """Records the step of each measurement."""
    calls = []
    measure = monitor.measure

    def counted():
        stats = measure()
        calls.append(monitor.last_step)
        return stats

    monitor.measure = counted
    return calls


class _Driver(keras.callbacks.Callback):
    """A callback that steps a monitor itself, as tfmixprec.TensorBoard does."""

    def __init__(self, monitor):
        super().__init__()
        self.monitor = monitor
        monitor.drive_from(self)

    def on_train_batch_end(self, batch, logs=None):
        self.monitor.step(logs)


def _fit_four_batches(model, callbacks):
    x = np.array([[1e-10, 2.0**-21, 1.0, 0.0]] * 4, np.float32)
    model.fit(x, np.ones((4, 1), np.float32), batch_size=1, verbose=0, callbacks=callbacks)


def test_driven_monitor_measures_once_per_interval_even_if_also_in_fit():
    model = _linear_model()
    monitor = GradientRangeMonitor((np.ones((1, 4)), np.ones((1, 1))), update_freq=2)
    calls = _counting(monitor)
    driver = _Driver(monitor)
    assert monitor.driver is driver
    recorder = Recorder()
    _fit_four_batches(model, [driver, monitor, recorder])  # the monitor is in fit's list too
    assert calls == [2, 4]  # stepped once per batch (by the driver), not twice
    assert monitor.last_step == 4
    logged = [i for i, logs in enumerate(recorder.batch_logs) if "grad_zero_fraction" in logs]
    assert logged == [1, 3]


def test_standalone_monitor_steps_itself():
    model = _linear_model()
    monitor = GradientRangeMonitor((np.ones((1, 4)), np.ones((1, 1))), update_freq=2)
    calls = _counting(monitor)
    _fit_four_batches(model, [monitor])
    assert monitor.driver is None
    assert calls == [2, 4]
    # Handed back: a driver released with drive_from(None) no longer silences the monitor.
    driver = _Driver(monitor)
    monitor.drive_from(None)
    assert monitor.driver is None
    _fit_four_batches(model, [monitor])
    assert calls == [2, 4, 2, 4]
    assert driver.monitor is monitor


def test_drive_from_errors():
    monitor = GradientRangeMonitor((np.ones((1, 4)), np.ones((1, 1))))
    with pytest.raises(
        TypeError, match=r"callback must be a keras.callbacks.Callback or None.*type str"
    ):
        monitor.drive_from("board")
    first = _Driver(monitor)
    monitor.drive_from(first)  # the same driver again: nothing changes
    assert monitor.driver is first
    with pytest.raises(
        ValueError, match=r"already driven by a _Driver callback.*drive_from\(None\)"
    ):
        _Driver(monitor)
    assert monitor.driver is first
    with pytest.raises(AttributeError):
        monitor.driver = None  # read-only: drive_from is the one way to set it


def test_monitor_is_not_serializable():
    # It holds a data batch: not registered, no config to rebuild it from.
    assert keras.saving.get_registered_object("tfmixprec>GradientRangeMonitor") is None
    assert not hasattr(GradientRangeMonitor, "get_config")
    assert not hasattr(GradientRangeMonitor, "from_config")


def test_float16_activation_gradients_are_measured_in_float32():
    """A float16 activation gradient is divided in float32 and kept there: 2^-29 counts as an
    underflow (below 2^-24), it is not flushed to an exact zero by unscaling in float16."""
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((4,))
    hidden = keras.layers.Identity(name="hidden")(inputs)  # float16 output
    kernel = keras.initializers.Constant(2.0**-30)
    outputs = keras.layers.Dense(
        1, use_bias=False, kernel_initializer=kernel, dtype="float32", name="out"
    )(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=2.0**20),
        loss="mse",
    )
    monitor = GradientRangeMonitor(
        (np.ones((1, 4), np.float32), np.ones((1, 1), np.float32)), layers=["hidden"]
    )
    monitor.set_model(model)
    monitor.measure()
    stats = monitor.activation_stats["hidden"]  # dL/dh = -2 * (1 - pred) * w = -2^-29
    assert (stats.count, stats.zero_fraction, stats.underflow_fraction) == (4, 0.0, 1.0)
    assert stats.histogram == {-29: 4}
    assert monitor.weight_stats.histogram == {1: 4}  # dL/dw = -2 * x = -2


def test_a_fit_shorter_than_update_freq_still_measures_once_at_its_end():
    model = _linear_model()
    monitor = GradientRangeMonitor((np.ones((1, 4)), np.ones((1, 1))), update_freq=10)
    calls = _counting(monitor)
    _fit_four_batches(model, [monitor])
    assert calls == [4] and monitor.weight_stats is not None
    monitor.update_freq = 2
    _fit_four_batches(model, [monitor])
    assert calls == [4, 2, 4]  # measured during the fit: nothing more at its end


def test_update_freq_counts_steps_with_several_steps_per_execution():
    """Keras calls a callback once per execution (with its last step's index): 16 steps in
    executions of 4 are 16 steps, and update_freq=4 measures at each 4th."""
    model = _linear_model()
    model.compile(optimizer=tfmixprec.LossScaleOptimizer("sgd"), loss="mse", steps_per_execution=4)
    monitor = GradientRangeMonitor((np.ones((1, 4)), np.ones((1, 1))), update_freq=4)
    calls = _counting(monitor)
    x = np.ones((16, 4), np.float32)
    model.fit(x, np.ones((16, 1), np.float32), batch_size=1, verbose=0, callbacks=[monitor])
    assert calls == [4, 8, 12, 16]


def test_a_bfloat16_model_is_recommended_no_loss_scale():
    """bfloat16 has float32's range: the monitor recommends 1.0 (no scaling) for a bfloat16
    model, while the same gradients, read against float16's range, would ask for 2^14."""
    with tfmixprec.policy_scope("mixed_bfloat16"):
        model = _linear_model()
    x = np.array([[1e-10, 2.0**-21, 1.0, 0.0]], np.float32)  # grads: -2x, as above
    monitor = GradientRangeMonitor((x, np.ones((1, 1), np.float32)))
    monitor.set_model(model)
    monitor.measure()
    assert monitor.weight_stats.recommend_loss_scale(percentile=0) == 2.0**14
    assert monitor.recommend_loss_scale(percentile=0) == 1.0
