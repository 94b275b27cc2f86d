"""Every feature under XLA (`jit_compile=True`), each against the same run without XLA. XLA's
CPU backend compiles the graphs a GPU gets. Keras's default `"auto"` compiles with XLA on a GPU
and without on a CPU: the rest of the suite compiles with it (test_state_guard.py's skipped
steps, for one). The batch keepers (`diagnose=`, `PrecisionRepair`) have their XLA and "auto"
cases beside the rest of their tests (test_diagnosis.py, test_repair.py). `jit_compile=True`
together with `MirroredStrategy` over logical CPUs fails inside TensorFlow itself, so there is
no 2-replica XLA case here.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import tfmixprec

BATCH = 4
C = keras.initializers.Constant


def _model(cls=keras.Model, dropout=True):
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(8, name="hidden")(inputs)
        hidden = keras.layers.BatchNormalization(name="bn")(hidden)
        if dropout:
            hidden = keras.layers.Dropout(0.5, name="drop")(hidden)
        outputs = keras.layers.Dense(1, dtype="float32", name="out")(hidden)
        return cls(inputs, outputs)


def _data(bad=(1,), batches=4):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * BATCH, 3)).astype("float32")
    for batch in bad:
        x[batch * BATCH, 0] = 1e6  # finite, but past float16: the forward overflows
    return x, np.ones((batches * BATCH, 1), "float32")


class States(keras.callbacks.Callback):
    """Every variable of the model before and after each batch."""

    def __init__(self):
        super().__init__()
        self.before, self.after = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.before.append([v.numpy().tobytes() for v in self.model.variables])

    def on_train_batch_end(self, batch, logs=None):
        self.after.append([v.numpy().tobytes() for v in self.model.variables])


@pytest.mark.parametrize("jit_compile", [True])
@pytest.mark.parametrize("kind", ["MixedPrecisionModel", "adopted keras.Model"])
def test_a_skipped_step_changes_no_variable(jit_compile, kind):
    """The state guard: batch normalization's statistics and the dropout seed put back."""
    if kind == "MixedPrecisionModel":
        model, callbacks = _model(tfmixprec.MixedPrecisionModel), []
        optimizer = tfmixprec.LossScaleOptimizer("sgd", initial_scale=1.0)
    else:
        model, callbacks = _model(), [tfmixprec.LossScaleMonitor()]
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), 1.0)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    states = States()
    model.fit(*_data(), batch_size=BATCH, shuffle=False, verbose=0, callbacks=[*callbacks, states])
    assert model.optimizer.read_state()["overflow_steps"] == 1
    assert states.after[1] == states.before[1]  # every variable bit-identical
    assert states.after[2] != states.before[2]
    assert model.jit_compile is (jit_compile is True)  # "auto": no XLA on a CPU


@pytest.mark.parametrize("jit_compile", [True])
def test_gradient_accumulation(jit_compile):
    """One applied step a window of two micro-batches; the window holding the overflow is
    skipped and changes no weight; the weights end as without XLA, to float16's rounding."""
    weights = {}
    for jit in (False, jit_compile):
        model = _model(tfmixprec.MixedPrecisionModel, dropout=False)
        optimizer = tfmixprec.LossScaleOptimizer(
            keras.optimizers.SGD(0.01), initial_scale=1.0, accumulation_steps=2
        )
        model.compile(optimizer=optimizer, loss="mse", jit_compile=jit)
        states = States()
        # The overflow in a window's last micro-batch: the state guard puts its batch-norm
        # statistics back (an earlier micro-batch's would stay: see `guard_state`).
        model.fit(*_data(bad=(3,), batches=8), batch_size=BATCH, shuffle=False, verbose=0,
                  callbacks=[states])  # fmt: skip
        state = model.optimizer.read_state()
        assert (state["iterations"], state["overflow_steps"]) == (3, 1)
        trainable = [i for i, v in enumerate(model.variables) if v.trainable]
        before = [states.before[2][i] for i in trainable]
        assert [states.after[3][i] for i in trainable] == before  # the window of batches 2, 3
        assert all(np.isfinite(v.numpy()).all() for v in model.variables)
        weights[jit] = [v.numpy() for v in model.trainable_variables]
    # float16 rounds each of 3 applied steps to 2^-10, relative to the model's weights (a
    # bias in front of the batch normalization has a gradient of 0 up to that rounding).
    tolerance = 3 * 2.0**-10
    scale = max(float(np.abs(w).max()) for w in weights[False])
    for a, b in zip(weights[False], weights[jit_compile]):
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance * scale)


def _float8_model(jit_compile):
    """`a` -> `b` (float8) -> `out`, constant kernels exact in e4m3: the same values with XLA
    or without (see test_float8_training.py)."""
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((32,))
        hidden = keras.layers.Dense(32, name="a", kernel_initializer=C(1 / 32))(inputs)
        hidden = keras.layers.Dense(32, name="b", kernel_initializer=C(1 / 32))(hidden)
        out = keras.layers.Dense(1, name="out", dtype="float32", kernel_initializer=C(1.0))
        model = tfmixprec.MixedPrecisionModel(inputs, out(hidden))
        assert [c.layer for c in tfmixprec.float8_layers(model)] == ["b"]
        model.compile(
            tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=256.0),
            "mse",
            jit_compile=jit_compile,
        )
    return model


@pytest.mark.parametrize("jit_compile", [True])
def test_float8_statistics(jit_compile):
    found = {}
    for jit in (False, jit_compile):
        model = _float8_model(jit)
        monitor = tfmixprec.Float8Monitor(update_freq=1)
        x = np.ones((12, 32), "float32")
        x[::4] *= 1000.0  # inputs past what the delayed scale expects: saturated values
        model.fit(x, np.zeros((12, 1), "float32"), batch_size=4, verbose=0, callbacks=[monitor])
        (stats,) = tfmixprec.float8_stats(model)
        tensors = stats.tensors()
        found[jit] = {
            name: (t.values, t.saturated, t.zero, t.flushed, t.scale, t.amax)
            for name, t in tensors.items()
        }
        assert found[jit]["inputs"][0] == 3 * 4 * 32  # every input value of the 3 steps
        assert found[jit]["inputs"][1] > 0  # the x1000 rows saturated
        assert all(t.history_moved for t in tensors.values())
    assert found[False] == found[jit_compile]


def _scalars(log_dir, tag):
    acc = event_accumulator.EventAccumulator(
        str(log_dir / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


@pytest.mark.parametrize("jit_compile", [True])
def test_callbacks_tensorboard_and_the_overflow_report(tmp_path, jit_compile):
    """A Keras model compiled the Keras way, Keras's optimizer adopted by the callbacks: the
    logs, the guard's count, the TensorBoard scalars and the attribution as without XLA."""
    seen = {}
    for jit in (False, jit_compile):
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(4, name="first"), keras.layers.Dense(2, name="second")]
        model = keras.Sequential([keras.Input((3,)), *layers])
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))
        model.compile(optimizer=optimizer, loss="mse", jit_compile=jit)
        x = np.random.default_rng(0).normal(size=(8 * BATCH, 3)).astype("float32")
        x[2 * BATCH, 1] = x[5 * BATCH, 1] = np.inf
        log_dir = tmp_path / str(jit)
        callbacks = [
            tfmixprec.LossScaleMonitor(),
            tfmixprec.OverflowGuard(),
            tfmixprec.TensorBoard(str(log_dir), update_freq=1),
        ]
        history = model.fit(x, np.zeros((8 * BATCH, 2), "float32"), batch_size=BATCH,
                            shuffle=False, verbose=0, callbacks=callbacks)  # fmt: skip
        report = tfmixprec.overflow_report(model)
        seen[jit] = (
            history.history["overflow"],
            history.history["loss_scale"],
            _scalars(log_dir, "mixed_precision/loss_scale"),
            _scalars(log_dir, "mixed_precision/overflow"),
            [(row.layer, row.overflow_steps, row.last_step) for row in report.layers],
        )
        assert callbacks[1].stopped_step is None
    assert seen[False] == seen[jit_compile]
    assert seen[False][3] == [(2, 1.0), (5, 1.0)]  # at the overflow steps, 0-based
    assert seen[False][4] == [("first", 2, 5), ("second", 2, 5)]


def test_calibrate_then_fit():
    """`calibrate` replays outside the step: the same report for a model compiled with XLA,
    whose `fit` then trains with no overflow step."""
    reports = {}
    for jit in (False, True):
        keras.utils.set_random_seed(0)
        with tfmixprec.policy_scope("mixed_float16"):
            inputs = keras.Input((8,))
            wide = keras.layers.Dense(64, name="wide", kernel_initializer=C(20000.0))(inputs)
            hidden = keras.layers.Dense(16, name="down")(wide)
            hidden = keras.layers.LayerNormalization(name="norm")(hidden)
            model = keras.Model(inputs, keras.layers.Dense(1, name="out", dtype="float32")(hidden))
            model.compile(optimizer="adam", loss="mse", jit_compile=jit)
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(128, 8)).astype("float32"), rng.normal(size=(128, 1))
        report = tfmixprec.calibrate(model, (x, y.astype("float32")), steps=2)
        reports[jit] = str(report)
        report.apply(model)
        model.fit(x, y, batch_size=32, epochs=1, verbose=0,
                  callbacks=[tfmixprec.LossScaleMonitor()])  # fmt: skip
        assert model.optimizer.read_state()["overflow_steps"] == 0
        assert model.jit_compile is jit
    assert reports[False] == reports[True]
    assert "wide: its outputs reach" in reports[True]
