"""The one replay engine: `diagnose=` and `PrecisionRepair` judge a batch alike, and a replay
changes no variable of the model."""

import keras
import numpy as np
import pytest

import tfmixprec
from tfmixprec._common.layers import layer_names
from tfmixprec.replay.calibration import Replayer, float32_set
from tfmixprec.replay.engine import TRAINING, bad_data, computes_in, replay

C = keras.initializers.Constant
MSE = keras.losses.MeanSquaredError()


def _dropout_and_batch_norm_model():
    """`big` (x 10000) overflows float16 in training mode only: there batch normalization
    scales `stem`'s outputs by the batch's own statistics (about 1), and dropout doubles what
    it keeps; in inference mode the moving variance (1e6, as after training on large values)
    brings them down to about 0.003, and `big`'s outputs stay finite."""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, name="stem", kernel_initializer=C(1.0))(inputs)
        norm = keras.layers.BatchNormalization(name="norm", moving_variance_initializer=C(1e6))
        hidden = keras.layers.Dropout(0.5, name="drop")(norm(hidden))
        hidden = keras.layers.Dense(16, name="big", kernel_initializer=C(1e4))(hidden)
        outputs = keras.layers.Dense(1, name="out", dtype="float32", kernel_initializer=C(1e-6))(
            hidden
        )
        model = keras.Model(inputs, outputs)
        model.compile(tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(1e-6)), "mse")
    return model


def _data(n=32):
    x = np.random.default_rng(0).normal(size=(n, 8)).astype("float32")
    return x, np.zeros((n, 1), "float32")


def _verdicts(model, batch, training=TRAINING):
    """`explain_overflow`'s (cause, layer) and `PrecisionRepair`'s judgment (`float32_set`:
    cause, layers) of one batch, each replayed in `training` mode."""
    diagnosis = tfmixprec.explain_overflow(model, batch, scale=1.0)
    replayer = Replayer(model, [(*batch, None)], MSE, training)
    found = float32_set(replayer)
    names = layer_names(model)
    return (diagnosis.cause, diagnosis.layer), (
        found.cause,
        [names[id(x)] for x, _ in found.layers],
    )


def test_diagnosis_and_repair_give_one_verdict_on_a_batch():
    model = _dropout_and_batch_norm_model()
    diagnosed, repaired = _verdicts(model, _data())
    assert diagnosed == ("forward-overflow", "big")
    assert repaired == ("forward-overflow", ["big"])


def test_the_mode_decides_the_verdict():
    """The test above can fail: in inference mode nothing overflows on the same batch (what
    `explain_overflow` said before the replays shared one mode, while `PrecisionRepair`
    replayed in training mode and moved `big` to float32)."""
    model = _dropout_and_batch_norm_model()
    replayer = Replayer(model, [(*_data(), None)], MSE, False)
    assert float32_set(replayer).cause == "none"
    assert TRAINING is True


def test_diagnose_and_precision_repair_in_one_fit_name_the_same_layers():
    """In `fit`: the monitor's `diagnose=` and `PrecisionRepair` replay the batch of the same
    overflow step (the fifth, where the repair judges) and name the same layer."""
    model = _dropout_and_batch_norm_model()
    monitor = tfmixprec.LossScaleMonitor(diagnose=5)
    repair = tfmixprec.PrecisionRepair(verbose=0)
    x, y = _data(256)
    model.optimizer.build(model.trainable_variables)  # before fit: the step traced once
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[monitor, repair])
    [judgment] = repair.judgments
    diagnosed = dict((step, (d.cause, (d.layer,))) for step, d in monitor.diagnoses)
    assert (judgment.step, judgment.cause, judgment.layers) == (4, "forward-overflow", ("big",))
    assert diagnosed[judgment.step] == (judgment.cause, judgment.layers)
    assert set(diagnosed) == {0, 1, 2, 3, 4}


def _variables(model):
    return [(v.path, v.numpy().tobytes()) for v in model.variables]


def test_a_replay_changes_no_variable():
    model = _dropout_and_batch_norm_model()
    x, y = _data()
    paths = [v.path for v in model.non_trainable_variables]
    assert any("moving_mean" in p for p in paths) and any("moving_variance" in p for p in paths)
    assert any("seed_generator" in p for p in paths)
    before = _variables(model)
    done = replay(model, (x, y, None), MSE, 2.0**15)
    assert _variables(model) == before  # trainable and not, bit for bit
    assert not np.isfinite(done.loss)  # it did run in training mode: `big` overflowed
    tfmixprec.explain_overflow(model, (x, y))
    float32_set(Replayer(model, [(x, y, None)], MSE))
    assert _variables(model) == before
    model(x, training=True)  # a call in training mode changes them (what is put back)
    after = dict(_variables(model))
    changed = [path for path, value in before if after[path] != value]
    assert any("moving_mean" in p for p in changed) and any("seed_generator" in p for p in changed)


def test_two_replays_of_a_batch_are_the_same():
    """The seeds are put back: dropout keeps the same values in the second replay."""
    model = _dropout_and_batch_norm_model()
    model.get_layer("big").kernel.assign(np.full((16, 16), 0.1, "float32"))
    x, y = _data()
    first, second = (replay(model, (x, y, None), MSE, 1.0) for _ in range(2))
    assert np.asarray(first.y_pred).tobytes() == np.asarray(second.y_pred).tobytes()


def test_training_must_be_a_bool():
    model = _dropout_and_batch_norm_model()
    with pytest.raises(TypeError, match="training must be True or False. Received: training=1"):
        replay(model, (*_data(), None), MSE, 1.0, training=1)
    with pytest.raises(TypeError, match="training must be True or False"):
        Replayer(model, [(*_data(), None)], MSE, training="yes")


def test_one_bad_data_message():
    model = _dropout_and_batch_norm_model()
    x, y = _data()
    x[3, 2] = np.inf
    message = bad_data((x, y, None))
    assert message == (
        "the batch's inputs hold 1 NaN/Inf values: no float32 layer and no loss scale can fix "
        "this. Clean or filter the data (dataset.filter on tf.math.is_finite)."
    )
    assert tfmixprec.explain_overflow(model, (x, y)).message == message
    assert float32_set(Replayer(model, [(x, y, None)], MSE)).problem == message


def test_computes_in():
    model = _dropout_and_batch_norm_model()
    assert computes_in(model, "float16") and computes_in(model.get_layer("out"), "float32")
    assert not computes_in(model.get_layer("out"), "float16")
    assert not computes_in(model, "bfloat16")


def test_layer_names_full_and_short():
    """One naming: the full form nests and numbers repeats; the short form is the name where
    it is unique."""
    inner_in = keras.Input((8,))
    inner = keras.Model(inner_in, keras.layers.Dense(8, name="dense")(inner_in), name="block")
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, name="dense")(inner(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(hidden), name="net")
    full, short = layer_names(model), layer_names(model, short=True)
    named = {layer.name: layer for layer in model.layers}
    assert full[id(inner.layers[-1])] == "block/dense" and full[id(named["dense"])] == "dense"
    assert short[id(named["head"])] == "head"
    # Repeated names: Keras's path where it is unique (the float8 reports' form), else the full.
    paths = {inner.layers[-1].path, named["dense"].path}
    expected = paths if len(paths) == 2 else {"block/dense", "dense"}
    assert {short[id(inner.layers[-1])], short[id(named["dense"])]} == expected
    assert len(set(full.values())) == len(full) and len(set(short.values())) == len(short)
    with pytest.raises(TypeError, match="short must be True or False"):
        layer_names(model, short="yes")


class _Noise(keras.layers.Layer):
    """Adds unseeded noise in training: `keras.random.normal` draws from Keras's global seed
    generator, which a replay must leave as it found it."""

    def call(self, x, training=False):
        if not training:
            return x
        return x + keras.ops.cast(0.1 * keras.random.normal(keras.ops.shape(x)), x.dtype)


class _Counted(keras.layers.Layer):
    """Passes its input on and counts it in a metric it owns (`keras.metrics.Mean`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = keras.metrics.Mean(name="seen")

    def call(self, x):
        self.seen.update_state(keras.ops.ones_like(x[:, :1]) * 0.5)
        return x


def _noisy_model(model_class, jit_compile=False, noise=True):
    """`big` overflows float16 on the batches holding 1e6; `noise` draws from the global seed
    generator in every step and every replay; `counted` counts in its own metric."""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, name="big")(inputs)
        hidden = _Noise(name="noise")(hidden) if noise else hidden
        hidden = _Counted(name="counted")(hidden)
        outputs = keras.layers.Dense(1, name="out", dtype="float32")(hidden)
        model = model_class(inputs, outputs)
        optimizer = tfmixprec.LossScaleOptimizer("adam", initial_scale=8.0)
        model.compile(optimizer, "mse", metrics=["mae"], jit_compile=jit_compile)
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    x[9, 0] = x[17, 0] = x[25, 1] = 1e6  # batches 1, 2 and 3 overflow in float16
    return model, x, np.ones((32, 1), "float32")


def _every_variable(model):
    """The value of each variable of the model, its metrics' and its optimizer's (in their
    order: the names of a second model's differ), and the global seed generator's next draws."""
    variables = model.variables + model.metrics_variables + list(model.optimizer.variables)
    seed = keras.random.randint((4,), 0, 2**30)  # draws from the global generator
    return [v.numpy().tobytes() for v in variables] + [seed.numpy().tobytes()]


@pytest.mark.parametrize("model_class", [keras.Model, tfmixprec.MixedPrecisionModel])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_diagnose_leaves_the_fit_bit_identical(model_class, jit_compile):
    """A fit with `diagnose=3` replays three overflow steps; the weights it ends with are
    bit-identical to the same fit's without it (a replay drew from Keras's global seed
    generator, which `noise` draws its next steps' noise from: 0.003 apart)."""
    ends = []
    for diagnose in (0, 3):
        model, x, y = _noisy_model(model_class, jit_compile)
        monitor = tfmixprec.LossScaleMonitor(diagnose=diagnose)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
        ends.append(_every_variable(model))
    assert [step for step, _ in monitor.diagnoses] == [1, 2, 3]
    assert ends[0] == ends[1]


@pytest.mark.parametrize("model_class", [keras.Model, tfmixprec.MixedPrecisionModel])
def test_explain_and_calibrate_change_no_metric_seed_or_optimizer(model_class):
    """The layer's metric, the compiled metrics, the optimizer's state and the global seed
    generator are as they were after `explain_overflow` and `calibrate` (the layer's metric
    went from (4, 8) to (12, 24), then on)."""
    model, x, y = _noisy_model(model_class)
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)  # one step, finite
    seen = model.get_layer("counted").seen
    assert [float(v.numpy()) for v in seen.variables] == [4.0, 8.0]
    keras.utils.set_random_seed(1)  # a fresh global generator: the same draws for both reads
    before = _every_variable(model)
    keras.utils.set_random_seed(1)
    assert tfmixprec.explain_overflow(model, (x[8:16], y[8:16])).cause == "forward-overflow"
    tfmixprec.calibrate(model, (x, y), steps=2, batch_size=16)
    assert [float(v.numpy()) for v in seen.variables] == [4.0, 8.0]
    assert _every_variable(model) == before


def test_a_replay_under_two_replicas_puts_back_each_replicas_metric(two_cpu_strategy):
    """Under a strategy each replica's own copy of a metric (`ON_READ`: read as one value it
    is their sum, through a collective) is put back as it was."""
    with two_cpu_strategy.scope():
        # Without `noise`: Keras keeps its global seed generator per thread, and a replica's
        # thread cannot make one inside the step.
        model, x, y = _noisy_model(tfmixprec.MixedPrecisionModel, noise=False)
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)  # 4 rows a replica, finite
    seen = model.get_layer("counted").seen

    def local():
        parts = [two_cpu_strategy.experimental_local_results(v.value) for v in seen.variables]
        return [[float(part.numpy()) for part in replicas] for replicas in parts]

    assert local() == [[2.0, 2.0], [4.0, 4.0]]
    assert tfmixprec.explain_overflow(model, (x[8:16], y[8:16])).cause == "forward-overflow"
    assert local() == [[2.0, 2.0], [4.0, 4.0]]
