"""A hostile review of `scale_used()` in the batch keeper's record and of the state
guard's unread values: each kept batch's `scale` is the scale its step overflowed at and its
`step` that step, for a plain keras.Model, an adopted one and MixedPrecisionModel, with and
without XLA; a skipped step puts every guarded variable back bit for bit, whatever the step
writes and how."""

import functools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from overflow_models import model as overflow_model

import tfmixprec
from tfmixprec.fit.adoption import adopt_at_train_begin
from tfmixprec.fit.overflow_batches import OverflowBatches, set_keeper

BAD = (1, 3, 4, 6)  # the batches that overflow (of 8, 8 rows each)


def _data():
    x = 0.1 * np.random.default_rng(1).normal(size=(64, 8)).astype("float32")
    for batch in BAD:
        x[8 * batch, 0] = 10.0  # 10000 x 10 passes 65504 in `big`
    return x, np.zeros((64, 1), "float32")


class Truth(keras.callbacks.Callback):
    """The scale before each batch and the overflow count after it."""

    def __init__(self):
        super().__init__()
        self.scales, self.overflows = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.scales.append(float(self.model.optimizer.loss_scale.numpy()))

    def on_train_batch_end(self, batch, logs=None):
        self.overflows.append(int(self.model.optimizer.overflow_steps.numpy()))


def _model(kind):
    if kind == "adopted":
        inner = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(1e-6), initial_scale=64.0, dynamic_growth_steps=1
        )
    else:
        inner = tfmixprec.LossScaleOptimizer(
            keras.optimizers.SGD(1e-6), initial_scale=64.0, dynamic_growth_steps=1
        )
    cls = tfmixprec.MixedPrecisionModel if kind == "MixedPrecisionModel" else None
    model = overflow_model("norm", optimizer=inner, cls=cls)
    if kind == "adopted":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            adopt_at_train_begin(model, "review")
    return model


def _keep(model, kind, limit):
    if kind == "MixedPrecisionModel":
        return model.keep_overflow_batches(limit)
    return set_keeper(model, OverflowBatches(limit, "user"))


@pytest.mark.parametrize(
    "kind, xla",
    [
        ("keras.Model", "none"),
        ("adopted", "none"),
        ("MixedPrecisionModel", "none"),
        ("MixedPrecisionModel", "compile(jit_compile=True)"),
    ],
)
def test_kept_batches_have_the_scale_that_overflowed(kind, xla):
    model = _model(kind)
    keeper = _keep(model, kind, 3)
    if xla == "model.jit_compile":
        model.jit_compile = True
    elif xla == "compile(jit_compile=True)":
        model.compile(model.optimizer, "mse", jit_compile=True)
        keeper = _keep(model, kind, 3)
    truth = Truth()
    x, y = _data()
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[truth])
    skipped = [b for b in range(8) if truth.overflows[b] > (truth.overflows[b - 1] if b else 0)]
    assert skipped == list(BAD)
    got = [(k.step, k.scale) for k in keeper.kept]
    assert got == [(b, truth.scales[b]) for b in BAD[:3]]
    (newest,) = keeper.latest
    assert (newest.step, newest.scale) == (BAD[-1], truth.scales[BAD[-1]])
    np.testing.assert_array_equal(newest.batch[0], x[8 * BAD[-1] : 8 * BAD[-1] + 8])


@pytest.mark.parametrize("kind", ["MixedPrecisionModel"])
@pytest.mark.parametrize("jit_compile", [False])
def test_diagnose_replays_at_the_scale_that_overflowed(kind, jit_compile):
    """`LossScaleMonitor(diagnose=3)`: the steps and the scales its replays used."""
    model = _model(kind)
    model.jit_compile = jit_compile
    monitor, truth = tfmixprec.LossScaleMonitor(diagnose=3), Truth()
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[monitor, truth])
    got = [(step, d.loss_scale) for step, d in monitor.diagnoses]
    assert got == [(b, truth.scales[b]) for b in BAD[:3]]


# ------------------------------------------------------------ the state guard
class Writes(keras.layers.Layer):
    """A layer whose call (training) writes its non-trainable variable `how`."""

    def __init__(self, how, **kwargs):
        super().__init__(**kwargs)
        self.how = how

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], 1), initializer="ones", name="kernel")
        self.stat = self.add_weight(shape=(), initializer="zeros", trainable=False, name="stat")

    def call(self, x, training=False):
        if training:
            mean = tf.cast(tf.reduce_mean(x), "float32")
            stat = self.stat
            if self.how == "assign twice":
                stat.assign(mean)
                stat.assign(stat * 0.5 + 1.0)
            elif self.how == "assign then assign_add":
                stat.assign(mean)
                stat.assign_add(1.0)
            elif self.how == "assign_add then assign":
                stat.assign_add(mean)
                stat.assign(stat * 3.0)
            elif self.how == "assign in a cond":
                tf.cond(
                    mean > 0.0,
                    lambda: stat.assign(mean).op,
                    lambda: stat.assign(-mean).op,
                )
            elif self.how == "assign then a nested function's assign_add":
                stat.assign(mean)
                tf.function(lambda: [stat.assign_add(2.0), None][1])()
            elif self.how == "assign after a read":
                before = tf.cast(tf.identity(stat.value), "float32")
                stat.assign(mean)
                stat.assign(before + mean)
        return tf.matmul(x, tf.cast(self.kernel, x.dtype))


HOWS = [
    "assign twice",
    "assign then assign_add",
    "assign_add then assign",
    "assign in a cond",
    "assign after a read",
    "assign then a nested function's assign_add",
]
# Those the suite runs (its time; a review ran every one, with and without XLA): the last
# write an assignment, an update, and a nested function's.
KEPT_HOWS = ["assign twice", "assign then assign_add", "assign then a nested function's assign_add"]


def _guard_model(how, cls=keras.Model, optimizer=None):
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(4, name="big", kernel_initializer="ones")(inputs)
        hidden = keras.layers.BatchNormalization(name="bn")(hidden)
        hidden = Writes(how, name="writes")(hidden)
        outputs = keras.layers.Activation("linear", dtype="float32")(hidden)
        model = cls(inputs, outputs)
    model.compile(
        optimizer or tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=1.0),
        "mse",
        metrics=["mae"],
    )
    return model


def _guard_data():
    x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
    x[8:16] *= 1e5  # batch 1: past float16 in `big` (finite in float32)
    return x, np.ones((32, 1), "float32")


def _variables(model):
    return [*model.variables, *model.metrics_variables]


def _state(model):
    return [v.numpy().tobytes() for v in _variables(model)]


class States(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.before, self.after = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.before.append(_state(self.model))

    def on_train_batch_end(self, batch, logs=None):
        self.after.append(_state(self.model))


@functools.cache
def _reference(how, jit_compile):
    """The same model and batches without batch 1, stepped by Keras's own LossScaleOptimizer
    at the same scale (1): its variables' paths and bytes, once for the keras and mpm cases."""
    keras_own = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), 1.0)
    reference = _guard_model(how, keras.Model, keras_own)
    reference.jit_compile = jit_compile
    x, y = _guard_data()
    keep = np.r_[0:8, 16:32]
    reference.fit(x[keep], y[keep], batch_size=8, shuffle=False, verbose=0)
    names = [v.path for v in _variables(reference)]
    return names, dict(zip(names, _state(reference)))


@pytest.mark.parametrize("jit_compile", [False])
@pytest.mark.parametrize("cls", [keras.Model, tfmixprec.MixedPrecisionModel], ids=["keras", "mpm"])
@pytest.mark.parametrize("how", KEPT_HOWS)
def test_a_skipped_step_puts_every_variable_back(how, cls, jit_compile):
    """Batch 1 overflows: every model variable after it is as before it, bit for bit; the
    other steps write as Keras does (checked against the same model and batches without
    batch 1, stepped by Keras's own LossScaleOptimizer at the same scale, 1)."""
    model = _guard_model(how, cls)
    model.jit_compile = jit_compile
    states = States()
    x, y = _guard_data()
    guard = [] if cls is tfmixprec.MixedPrecisionModel else [tfmixprec.OverflowGuard()]
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[*guard, states])
    assert int(model.optimizer.overflow_steps.numpy()) == 1
    assert states.after[1] == states.before[1]
    names, theirs = _reference(how, jit_compile)
    ours = dict(zip([v.path for v in _variables(model)], _state(model)))
    for name in names:
        if "optimizer" in name or "iteration" in name:
            continue
        assert ours[name] == theirs[name], name
    assert len(names) >= 10  # the weights, BatchNormalization's and `stat`, the metrics


@pytest.mark.parametrize("jit_compile", [False])
@pytest.mark.parametrize("how", KEPT_HOWS)
def test_a_custom_train_step_under_guard_state(how, jit_compile):
    model = _guard_model(how)
    opt = model.optimizer
    x, y = _guard_data()

    @tf.function(jit_compile=jit_compile)
    def step(xb, yb):
        with tfmixprec.guard_state(model, opt):
            with tf.GradientTape() as tape:
                pred = model(xb, training=True)
                loss = opt.scale_loss(keras.losses.mean_squared_error(yb, pred))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)

    for batch in range(4):
        before = _state(model)
        step(x[8 * batch : 8 * batch + 8], y[8 * batch : 8 * batch + 8])
        if batch == 1:
            assert _state(model) == before
    assert int(opt.overflow_steps.numpy()) == 1
