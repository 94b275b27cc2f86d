"""The tfmixprec callbacks on a plain keras.Model compiled the Keras way (compile("sgd")):
Keras's own LossScaleOptimizer adopted under mixed_float16, nothing to do otherwise."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec import LossScaleMonitor, LossScaleOptimizer, OverflowGuard

BATCH = 4


def _model(policy, name="net", dense_dtype=None):
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, name="hidden", dtype=dense_dtype)(inputs)
    outputs = keras.layers.Dense(2, name="out", dtype="float32")(hidden)
    return keras.Model(inputs, outputs, name=name)


def _data(bad_batches=(), batches=8):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * BATCH, 3)).astype("float32")
    y = rng.normal(size=(batches * BATCH, 2)).astype("float32")
    for b in bad_batches:
        x[b * BATCH, 0] = np.inf
    return x, y


class Weights(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.after = []

    def on_train_batch_end(self, batch, logs=None):
        self.after.append(self.model.get_weights())


def _four(tmp_path, x, y):
    return [
        LossScaleMonitor(),
        OverflowGuard(),
        tfmixprec.TensorBoard(str(tmp_path), update_freq=2),
        tfmixprec.GradientRangeMonitor((x[:BATCH], y[:BATCH]), update_freq=4),
    ]


def test_mixed_float16_adopts_keras_optimizer_and_its_step_uses_it(tmp_path, capsys):
    model = _model("mixed_float16")
    model.compile(optimizer="sgd", loss="mse")
    keras_lso = model.optimizer
    assert type(keras_lso) is keras.optimizers.LossScaleOptimizer
    x, y = _data(bad_batches=(5,))
    weights = Weights()
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[*_four(tmp_path, x, y), weights],
    )
    assert type(model.optimizer) is LossScaleOptimizer
    assert model.optimizer.inner_optimizer is keras_lso.inner_optimizer
    said = capsys.readouterr().out.splitlines()
    # The CPU routes' line where this machine routes float16 layers (test_cpu_route_adoption).
    assert [line for line in said if " routed " not in line] == [  # once, not per callback
        "tfmixprec: LossScaleMonitor replaced the keras.optimizers.LossScaleOptimizer of model "
        "'net' with a tfmixprec.LossScaleOptimizer (the same SGD, loss scale 32768, "
        "dynamic_growth_steps=2000) to read and guard the loss scale; a file this model "
        "saves from now on needs `import tfmixprec` to load."
    ]
    # The traced step is tfmixprec's: the Inf batch is counted and skipped bit-exactly.
    state = model.optimizer.read_state()
    assert (state["overflow_steps"], state["iterations"], state["loss_scale"]) == (1, 7, 16384.0)
    assert history.history["overflow_steps"] == [1.0]
    for before, after in zip(weights.after[4], weights.after[5]):
        np.testing.assert_array_equal(before, after)
    assert not np.array_equal(weights.after[5][0], weights.after[6][0])


@pytest.mark.parametrize(
    "policy, dtype_line",
    [
        (
            "mixed_bfloat16",
            "bfloat16, which has float32's range (no gradient flushes to zero as in float16)",
        ),
        ("float32", "float32"),
    ],
)
def test_no_loss_scaling_needed(policy, dtype_line, tmp_path, capsys):
    model = _model(policy)
    model.compile(optimizer="sgd", loss="mse")
    x, y = _data()
    callbacks = _four(tmp_path, x, y)
    history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
    assert type(model.optimizer) is keras.optimizers.SGD  # not wrapped
    assert sorted(history.history) == ["loss"]  # no loss-scale values
    assert callbacks[1].stopped_step is None
    assert callbacks[3].weight_stats is not None  # measured, at scale 1
    assert capsys.readouterr().out.splitlines() == [
        f"tfmixprec: no loss scaling needed for model 'net': it computes in {dtype_line}; "
        "the tfmixprec callbacks add no loss-scale values."
    ]


@pytest.mark.usefixtures("fit_left_early")  # a fit left early: Keras's cycle
def test_guard_without_loss_scaling_stops_on_a_non_finite_loss():
    model = _model("mixed_bfloat16")
    model.compile(optimizer="sgd", loss="mse")
    guard = OverflowGuard(verbose=0)
    x, y = _data(bad_batches=(2,))
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[guard])
    assert guard.stopped_step == 3  # applied steps: nothing skips the bad one
    assert guard.stop_message.startswith(
        "OverflowGuard stopped training at step 3: the loss is nan (without loss scaling "
        "nothing skips it). Likely causes are NaN/Inf in the inputs or labels"
    )


def test_float16_without_loss_scaling_says_how_to_fix_it():
    model = _model("float32", dense_dtype="mixed_float16")  # Keras does not wrap it
    model.compile(optimizer="sgd", loss="mse")
    x, y = _data()
    with pytest.warns(RuntimeWarning) as record:
        history = model.fit(
            x, y, batch_size=BATCH, verbose=0, callbacks=[LossScaleMonitor(), OverflowGuard()]
        )
    messages = [str(w.message) for w in record if "float16" in str(w.message)]
    assert messages == [
        "Model 'net' computes in float16 but its optimizer (SGD) does not scale the loss, so "
        "gradients below 2**-24 flush to zero and their weights stop learning "
        "(LossScaleMonitor runs without loss-scale values). Compile with "
        "optimizer=tfmixprec.LossScaleOptimizer(your_optimizer), or set the mixed_float16 "
        "policy before building the model so that compile() wraps it. "
        'See the tfmixprec guide "Fit and callbacks" (docs/guides/fit-and-callbacks.md in the '
        "tfmixprec repository)."
    ]
    assert sorted(history.history) == ["loss"]


def test_a_used_keras_optimizer_is_adopted_with_its_state(capsys):
    model = _model("mixed_float16")
    model.compile(optimizer="adam", loss="mse")
    x, y = _data(bad_batches=(1,))
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)  # Keras's own step
    old = model.optimizer
    before = {
        "scale": float(old.dynamic_scale.numpy()),
        "counter": int(old.step_counter.numpy()),
        "iterations": int(old.iterations.numpy()),
    }
    assert before == {"scale": 16384.0, "counter": 6, "iterations": 7}
    slots = [id(v) for v in old.inner_optimizer.variables]
    seen = {}

    class Check(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            opt = self.model.optimizer
            seen["state"] = opt.read_state()
            seen["slots"] = [id(v) for v in opt.inner_optimizer.variables]

    model.fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[OverflowGuard(), Check()]
    )
    assert seen["slots"] == slots  # the same Adam moments, not copies
    state = seen["state"]
    assert (state["loss_scale"], state["good_steps"], state["iterations"]) == (16384.0, 6, 7)
    assert state["overflow_steps"] == 0  # Keras's optimizer does not count them
    assert model.optimizer.read_state()["overflow_steps"] == 1  # this fit's Inf batch
    assert "; its state carried over) to read" in capsys.readouterr().out


def test_adopted_model_round_trips_through_a_keras_file(tmp_path):
    model = _model("mixed_float16")
    model.compile(optimizer="adam", loss="mse")
    x, y = _data(bad_batches=(2,))
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[LossScaleMonitor()])
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is LossScaleOptimizer
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert loaded.optimizer.read_state() == model.optimizer.read_state()
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_adoption_under_a_mirrored_strategy(two_cpu_strategy, capsys):
    with two_cpu_strategy.scope():
        model = _model("float32")
        model.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)), loss="mse"
        )
    x, y = _data(bad_batches=(1,))
    monitor = LossScaleMonitor()
    history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    opt = model.optimizer
    assert type(opt) is LossScaleOptimizer
    for variable in (opt.loss_scale, opt.overflow_steps, opt.longest_overflow_run):
        assert isinstance(variable.value, tf.distribute.DistributedValues)
        assert len(variable.value.values) == 2  # one copy a replica
    assert history.history["overflow_steps"] == [1.0]
    assert opt.read_state()["iterations"] == 7
    # Keras built its optimizer before on_train_begin (fit's symbolic build under a strategy).
    assert "its state carried over" in capsys.readouterr().out


@pytest.mark.usefixtures("fit_left_early")  # a fit left early: Keras's cycle
@pytest.mark.parametrize("order", ["backup first", "backup last"])
def test_backup_and_restore_in_any_order_resumes_the_loss_scale_exactly(tmp_path, order):
    """A plain model compiled the Keras way: the tfmixprec callback adopts Keras's optimizer
    when Keras sets its model, before any callback's on_train_begin, so BackupAndRestore
    restores into tfmixprec's optimizer wherever it is listed (listed first, it met Keras's
    2-variable optimizer and the scale and counters started over)."""
    x, y = _data(bad_batches=(1,), batches=8)  # step 1 overflows: scale 32768 -> 16384

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                raise RuntimeError("interrupted")

    def callbacks(*extra):
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=4)
        monitor = LossScaleMonitor()
        return [backup, monitor, *extra] if order == "backup first" else [monitor, backup, *extra]

    def fresh():
        model = _model("mixed_float16")
        model.compile(optimizer="sgd", loss="mse")
        return model

    seen = {}

    class AtBackup(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:  # the backup's step (save_freq=4)
                seen["state"] = self.model.optimizer.read_state()
                seen["weights"] = self.model.get_weights()

    with pytest.raises(RuntimeError, match="interrupted"):
        fresh().fit(
            x,
            y,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
            callbacks=callbacks(AtBackup(), Stop()),
        )
    resumed = {}

    class AtResume(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            resumed["state"] = self.model.optimizer.read_state()
            resumed["weights"] = self.model.get_weights()

    fresh().fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks(AtResume()))
    assert seen["state"]["loss_scale"] == 16384.0 and seen["state"]["overflow_steps"] == 1
    assert resumed["state"] == seen["state"]
    assert all((a == b).all() for a, b in zip(resumed["weights"], seen["weights"]))
