"""Tests of LossScaleMonitor and OverflowGuard on scripted overflows."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec import LossScaleMonitor, LossScaleOptimizer, OverflowGuard

BATCH = 4


def _model(kind="keras", steps_per_execution=1, **opt_kwargs):
    """A tiny float32 model with a dynamic tfmixprec optimizer (Keras's or our train_step)."""
    keras.utils.set_random_seed(0)
    cls = keras.Model if kind == "keras" else tfmixprec.MixedPrecisionModel
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(2, name="out")(keras.layers.Dense(4, name="hidden")(inputs))
    model = cls(inputs, outputs)
    opt_kwargs.setdefault("initial_scale", 2.0**15)
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.01), **opt_kwargs),
        loss="mse",
        steps_per_execution=steps_per_execution,
    )
    return model


def _data(bad_batches=(), batches=8, value=np.inf):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * BATCH, 3)).astype("float32")
    y = rng.normal(size=(batches * BATCH, 2)).astype("float32")
    for b in bad_batches:
        x[b * BATCH, 0] = value
    return x, y


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batch_logs, self.epoch_logs = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batch_logs.append({k: (v, type(v)) for k, v in logs.items()})

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))


@pytest.mark.parametrize("kind", ["keras", "tfmixprec"])
def test_loss_scale_monitor_logs(kind):
    model = _model(kind)
    x, y = _data(bad_batches=(2, 5))
    recorder = Recorder()
    monitor = LossScaleMonitor()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[monitor, recorder]
    )
    scales = [float(logs["loss_scale"][0]) for logs in recorder.batch_logs]
    assert scales == [2.0**15] * 2 + [2.0**14] * 3 + [2.0**13] * 3
    overflow_steps = [float(logs["overflow_steps"][0]) for logs in recorder.batch_logs]
    assert overflow_steps == [0, 0, 1, 1, 1, 2, 2, 2]
    if kind == "keras":  # computed by the monitor: device tensors, not host reads
        assert all(issubclass(logs["overflow_steps"][1], tf.Tensor) for logs in recorder.batch_logs)
    else:  # tfmixprec's train_step returns them; the monitor adds nothing per batch
        assert all("skipped_fraction" in logs for logs in recorder.batch_logs)
    assert history.history["overflow_steps"] == [2.0]
    assert history.history["skipped_fraction"] == [0.25]
    assert history.history["loss_scale"] == [2.0**13]


def test_loss_scale_monitor_verbose_reports(capsys):
    model = _model()
    x, y = _data(bad_batches=(1, 2, 6))
    monitor = LossScaleMonitor(verbose=1, update_freq=4)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [
        "2 overflows in steps 0-3, the last at step 2 (0-based, skipped steps counted), loss "
        "scale 32768 -> 8192; gradients not finite in: hidden, out",
        "overflow at step 6 (0-based, skipped steps counted), loss scale 8192 -> 4096; "
        "gradients not finite in: hidden, out",
    ]
    assert monitor.events == lines


def test_float32_model_with_a_plain_optimizer_needs_no_loss_scaling(capsys):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)], name="plain")
    model.compile(optimizer="sgd", loss="mse")
    x, y = _data()
    for callback in (LossScaleMonitor(), OverflowGuard()):
        history = model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[callback])
        assert sorted(history.history) == ["loss"]  # no loss-scale values
    assert type(model.optimizer) is keras.optimizers.SGD  # left alone
    assert capsys.readouterr().out.splitlines() == [  # once per model
        "tfmixprec: no loss scaling needed for model 'plain': it computes in float32; the "
        "tfmixprec callbacks add no loss-scale values."
    ]


def test_guard_ignores_isolated_overflows():
    model = _model()
    guard = OverflowGuard(patience=3, max_consecutive=2)
    x, y = _data(bad_batches=(1, 4, 7))
    history = model.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[guard]
    )
    assert len(history.history["loss"]) == 2
    assert guard.stopped_step is None and guard.stop_message is None
    assert int(model.optimizer.overflow_steps) == 6


@pytest.mark.usefixtures("fit_left_early")  # the guard leaves the epoch: Keras's cycle
def test_guard_stops_on_persistent_nan_data(capsys):
    model = _model()
    guard = OverflowGuard(max_consecutive=3)
    x, y = _data(bad_batches=range(8), value=np.nan)
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[guard])
    assert guard.stopped_step == 3
    assert int(model.optimizer.overflow_steps) == 3  # it stopped right there
    assert guard.stop_message.startswith(
        "OverflowGuard stopped training at step 3: 3 consecutive overflow steps (max_consecutive=3)"
    )
    assert "NaN/Inf in the inputs or labels" in guard.stop_message
    assert guard.stop_message in capsys.readouterr().out


@pytest.mark.usefixtures("fit_left_early")  # the guard leaves the epoch: Keras's cycle
def test_guard_patience_at_min_scale():
    model = _model(initial_scale=4.0, min_scale=1.0, on_min_scale="ignore")
    guard = OverflowGuard(patience=3, max_consecutive=100, verbose=0)
    x, y = _data(bad_batches=range(8))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[guard])
    # steps 0, 1 overflow at scales 4, 2; steps 2, 3, 4 at min_scale 1: the third stops it
    assert guard.stopped_step == 5
    assert guard.stop_message.startswith(
        "OverflowGuard stopped training at step 5: 3 overflow steps at min_scale=1, where the "
        "loss scale cannot back off any further (patience=3). This is not a loss scale"
    )
    assert model.optimizer.read_state()["min_scale_overflows"] == 3


@pytest.mark.usefixtures("fit_left_early")  # the guard leaves the epoch: Keras's cycle
def test_guard_restores_the_weights_of_the_last_clean_step():
    """One skipped batch (1) keeps the epoch's running-mean loss infinite for the rest of the
    epoch; the guard still restores the weights after the last applied step (13), not those
    from before the skip."""
    model = _model()
    x, y = _data(bad_batches=[1, *range(14, 20)], batches=20, value=np.nan)
    guard = OverflowGuard(max_consecutive=3, restore_weights=True, verbose=0)
    seen = {}

    class Snapshot(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen[batch] = self.model.get_weights()

    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[Snapshot(), guard])
    assert guard.stopped_step == 17  # steps attempted: 0-16, the skipped ones counted
    for a, b in zip(seen[13], model.get_weights()):
        assert a.tobytes() == b.tobytes()
    assert any((a != b).any() for a, b in zip(seen[0], model.get_weights()))


@pytest.mark.usefixtures("fit_left_early")  # the guard leaves the epoch: Keras's cycle
def test_guard_raise_and_restore():
    model = _model()
    x, y = _data(bad_batches=range(2, 8))

    class Corrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:  # weights corrupted by something outside the optimizer
                self.model.set_weights([w * 0 + 123 for w in self.model.get_weights()])

    guard = OverflowGuard(max_consecutive=4, restore_weights=True, raise_error=True, verbose=0)
    seen = {}

    class Snapshot(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                seen["weights"] = self.model.get_weights()

    with pytest.raises(FloatingPointError, match=r"stopped training at step 6: 4 consecutive"):
        model.fit(
            x,
            y,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
            callbacks=[Snapshot(), Corrupt(), guard],
        )
    for a, b in zip(seen["weights"], model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert "The weights after the last clean step were restored." in guard.stop_message


@pytest.mark.usefixtures("fit_left_early")  # the guard leaves the epoch: Keras's cycle
@pytest.mark.parametrize("update_freq, stopped_step", [(1, 2), (4, 4), (3, 3)])
def test_guard_checks_every_update_freq_batches(update_freq, stopped_step):
    model = _model()
    guard = OverflowGuard(max_consecutive=1, update_freq=update_freq, verbose=0)
    # Step 1 overflows; a check after it sees the run even when the run is over by then.
    x, y = _data(bad_batches=(1,))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[guard])
    assert guard.stopped_step == stopped_step
    assert int(model.optimizer.overflow_steps) == 1


@pytest.fixture(scope="module")
def three_monitors():
    """One fit (steps 2 and 5 overflow) watched by a LossScaleMonitor of each update_freq
    below: each keeps its own events, and the fit's History is the same for all three."""
    monitors = {freq: LossScaleMonitor(update_freq=freq) for freq in ("batch", "epoch", 4)}
    x, y = _data(bad_batches=(2, 5))
    history = _model().fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=list(monitors.values())
    )
    return history, monitors


@pytest.mark.parametrize(
    "update_freq, reports",
    [
        ("batch", ["overflow at step 2", "overflow at step 5"]),  # as update_freq=1
        ("epoch", ["2 overflows in steps 0-7, the last at step 5"]),  # once, at epoch end
        (4, ["overflow at step 2", "overflow at step 5"]),
    ],
)
def test_monitor_update_freq_as_keras_tensorboard_takes_it(update_freq, reports, three_monitors):
    history, monitors = three_monitors
    monitor = monitors[update_freq]
    assert [line.split(" (0-based")[0] for line in monitor.events] == reports
    assert history.history["overflow"] == [2.0]  # the epoch's overflow steps, whichever
    config = monitor.get_config()
    assert config["update_freq"] == update_freq
    assert LossScaleMonitor.from_config(config).get_config() == config


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (LossScaleMonitor, dict(verbose=2), r"verbose must be 0 or 1.*verbose=2"),
        (
            LossScaleMonitor,
            dict(update_freq=0),
            r'^update_freq must be "epoch", "batch" or an integer >= 1. Received: update_freq=0$',
        ),
        (
            LossScaleMonitor,
            dict(update_freq="steps"),
            r"^update_freq must be .* Received: update_freq='steps'$",
        ),
        (OverflowGuard, dict(patience=0), r"patience must be an integer >= 1.*patience=0"),
        (OverflowGuard, dict(max_consecutive=-1), r"max_consecutive=-1"),
        (
            OverflowGuard,
            dict(update_freq=1.5),
            r"^update_freq must be an integer >= 1. Received: update_freq=1.5$",
        ),
    ],
)
def test_callback_bad_arguments(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("name", ["restore_weights", "raise_error"])
def test_a_bool_argument_that_is_not_a_bool_is_a_type_error(name):
    # As for every bool argument of tfmixprec (LossScaleOptimizer's dynamic too).
    with pytest.raises(TypeError, match=rf"^{name} must be True or False. Received: {name}=1$"):
        OverflowGuard(**{name: 1})


@pytest.mark.parametrize(
    "callback",
    [
        LossScaleMonitor(verbose=1, update_freq=7),
        OverflowGuard(patience=5, max_consecutive=9, update_freq=3),
    ],
)
def test_callback_config_round_trip(callback):
    config = callback.get_config()
    assert config["update_freq"] == callback.update_freq != 1
    restored = type(callback).from_config(config)
    assert restored.get_config() == config
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(callback))
    assert type(again) is type(callback) and again.get_config() == config


def test_callbacks_under_mirrored_strategy(two_cpu_strategy, tmp_path, capsys):
    with two_cpu_strategy.scope():
        model = _model("tfmixprec")
    x, y = _data(bad_batches=(1,))
    monitor = LossScaleMonitor(verbose=1, update_freq=2)
    guard = OverflowGuard(max_consecutive=3, verbose=0)
    board = tfmixprec.TensorBoard(str(tmp_path), update_freq=2)
    history = model.fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor, guard, board]
    )
    assert history.history["overflow_steps"] == [1.0]
    assert capsys.readouterr().out.splitlines() == [
        "overflow at step 1 (0-based, skipped steps counted), loss scale 32768 -> 16384; "
        "gradients not finite in: hidden, out"
    ]
    assert guard.stopped_step is None
    assert model.optimizer.read_state() == {
        "loss_scale": 16384.0,
        "good_steps": 6,
        "hysteresis_tracker": 0,
        "overflow_steps": 1,
        "consecutive_overflows": 0,
        "last_overflow_iteration": 1,
        "iterations": 7,
        "min_scale_overflows": 0,
        "longest_overflow_run": 1,
        "step": 8,  # steps attempted: 7 applied + 1 skipped
        "last_overflow_step": 1,
    }


@pytest.mark.parametrize("kind", ["keras", "tfmixprec"])
def test_monitor_epoch_logs_count_the_epochs_overflow_steps(kind):
    model = _model(kind)
    x, y = _data(bad_batches=(0,), batches=4)  # shuffle=False: batch 0 of every epoch
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[LossScaleMonitor()],
    )
    assert history.history["overflow"] == [1.0, 1.0, 1.0]
    assert history.history["overflow_steps"] == [1.0, 2.0, 3.0]


def test_guard_does_not_stop_a_healthy_run_at_min_scale():
    # The run: two isolated overflows take the scale from 4 to min_scale 1, then
    # training runs clean. Sitting at min_scale is not a failure.
    model = _model(initial_scale=4.0, min_scale=1.0)
    guard = OverflowGuard()
    x, y = _data(bad_batches=(3, 10), batches=120)
    history = model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[guard]
    )
    assert guard.stopped_step is None and guard.stop_message is None
    assert len(history.history["loss"]) == 1
    state = model.optimizer.read_state()
    assert (state["loss_scale"], state["overflow_steps"], state["iterations"]) == (1.0, 2, 118)
    assert state["min_scale_overflows"] == 0


def test_guard_min_scale_count_starts_again_when_the_scale_grows():
    model = _model(initial_scale=2.0, min_scale=1.0, growth_interval=2, on_min_scale="ignore")
    guard = OverflowGuard(patience=2, max_consecutive=100, verbose=0)
    # steps 0, 1 overflow (scale 2 -> 1, then one at min); 2, 3 clean: 1 -> 2; 4 overflows
    # (2 -> 1); 5 at min again: one since the growth, not two.
    x, y = _data(bad_batches=(0, 1, 4, 5), batches=6)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[guard])
    assert guard.stopped_step is None
    assert model.optimizer.read_state()["min_scale_overflows"] == 1


@pytest.mark.usefixtures("fit_left_early")  # the guard leaves the epoch: Keras's cycle
@pytest.mark.parametrize("kind", ["keras", "tfmixprec"])
def test_guard_sees_a_run_inside_executions(kind):
    # 5 overflows in a row (steps 2-6) with 4 steps per execution: the guard sees the ends
    # of executions only (steps 3 and 7), where the run is 2 long and then over.
    model = _model(kind, steps_per_execution=4)
    guard = OverflowGuard(max_consecutive=3, verbose=0)
    x, y = _data(bad_batches=range(2, 7))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[guard])
    assert guard.stopped_step == 8
    assert guard.stop_message.startswith(
        "OverflowGuard stopped training at step 8: 5 consecutive overflow steps "
        "(max_consecutive=3). This is not a loss scale finding its level"
    )


def test_guard_run_count_starts_at_each_fit():
    model = _model(initial_scale=2.0**20)
    x, y = _data(bad_batches=(0, 1, 2))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # no guard
    guard = OverflowGuard(max_consecutive=3, verbose=0)
    x, y = _data(bad_batches=(0, 1))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[guard])
    assert guard.stopped_step is None  # the earlier run of 3 was before this guard
    assert model.optimizer.read_state()["longest_overflow_run"] == 2


@pytest.mark.parametrize("kind", ["keras", "tfmixprec"])
def test_monitor_numbers_steps_with_steps_per_execution(kind, capsys):
    model = _model(kind, steps_per_execution=4)
    monitor = LossScaleMonitor(verbose=1, update_freq=1)
    x, y = _data(bad_batches=(6,), batches=12)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
    x, y = _data(bad_batches=(1, 2), batches=4)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
    assert capsys.readouterr().out.splitlines() == [
        "overflow at step 6 (0-based, skipped steps counted), loss scale 32768 -> 16384; "
        "gradients not finite in: hidden, out",
        "2 overflows in steps 12-15, the last at step 14 (0-based, skipped steps counted), "
        "loss scale 16384 -> 4096; gradients not finite in: hidden, out",
    ]


def test_monitor_update_freq_counts_steps_not_executions():
    model = _model(steps_per_execution=4)
    monitor = LossScaleMonitor(update_freq=6)
    x, y = _data(bad_batches=(0, 5, 9), batches=12)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
    # Reports due after steps 6 and 12 come at the ends of executions (steps 8 and 12).
    assert monitor.events == [
        "2 overflows in steps 0-7, the last at step 5 (0-based, skipped steps counted), loss "
        "scale 32768 -> 8192; gradients not finite in: hidden, out",
        "overflow at step 9 (0-based, skipped steps counted), loss scale 8192 -> 4096; "
        "gradients not finite in: hidden, out",
    ]


def test_a_report_of_one_overflow_names_the_scale_it_used():
    """The scale grows twice between two reads (4 -> 8 -> 16), then one step overflows at 16
    and backs off to 8: the line says 16 -> 8, not the 4 of the last read."""
    model = _model("keras", initial_scale=4.0, growth_interval=2)
    x, y = _data(bad_batches=(4,), batches=6)
    monitor = LossScaleMonitor(update_freq=100)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    assert monitor.events == [
        "overflow at step 4 (0-based, skipped steps counted), loss scale 16 -> 8; "
        "gradients not finite in: hidden, out"
    ]
