"""float8 layers under loss scaling: the "gradients" of their scale and amax-history variables
(new values, which Keras assigns) are never divided by the loss scale, and a skipped step
leaves them bit-identical. In fit, make_train_step, custom loops (the optimizer applied
eagerly, one tf.function, two tf.functions) and under 2 replicas (fit and a loop).

Keras's float8 layers cannot be differentiated eagerly under TensorFlow (see
`_keras.float8.float8_replayed`), so the "eager" loop computes its gradients in a
`tf.function` and calls the optimizer eagerly.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec.precision.float8 import RECIPE
from tfmixprec.tools.testing import FaultInjector

C = keras.initializers.Constant
SCALE = 256.0  # a power of two: the output gradient times it is exact in float16
NAMES = [name for t in RECIPE.tensors for name in (t.scale, t.amax_history)]
ENTRIES = ["fit", "make_train_step", "eager_apply", "one_function", "two_functions"]
REPLICATED = ["two_replicas_fit", "two_replicas_loop"]


def _model(strategy=None):
    """`a` (kernel 1/32) -> `b` (float8, kernel 1/32) -> `out` (float32, kernel 1), 32 wide:
    with inputs 1 and labels 0, `b` quantizes inputs 1 and a kernel of 1/32 (exact in e4m3),
    the prediction is 32 and the mean squared error's gradient at `b`'s output 2 * 32 / 4 =
    16 per value (batches of 4 rows), times the loss scale. SGD at learning rate 0: only the
    float8 variables change, by the values Keras assigns them."""
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with tfmixprec.policy_scope("mixed_float16"), scope:
        inputs = keras.Input((32,))
        hidden = keras.layers.Dense(32, name="a", kernel_initializer=C(1 / 32))(inputs)
        hidden = keras.layers.Dense(32, name="b", kernel_initializer=C(1 / 32))(hidden)
        outputs = keras.layers.Dense(1, name="out", dtype="float32", kernel_initializer=C(1.0))(
            hidden
        )
        cls = keras.Model if strategy is not None else tfmixprec.MixedPrecisionModel
        model = cls(inputs, outputs)
        assert [c.layer for c in tfmixprec.float8_layers(model)] == ["b"]
        optimizer = tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=SCALE)
        model.compile(optimizer, "mse")
        optimizer.build(model.trainable_variables)  # in the scope, before any tf.function
    return model


def _data(steps):
    return np.ones((4 * steps, 32), "float32"), np.zeros((4 * steps, 1), "float32")


def _float8(model):
    layer = model.get_layer("b")
    return {name: getattr(layer, name).numpy().copy() for name in NAMES}


def _dataset(steps, faults):
    dataset = tf.data.Dataset.from_tensor_slices(_data(steps)).batch(4)
    return dataset if faults is None else faults.corrupt_dataset(dataset)


class _Record(keras.callbacks.Callback):
    """The loss scale each step used and the float8 variables after it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        self.scale = float(self.model.optimizer.loss_scale.numpy())

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((self.scale, _float8(self.model)))


def _fit(model, steps, faults):
    record = _Record()
    model.fit(_dataset(steps, faults), epochs=1, verbose=0, callbacks=[record])
    return record.seen


def _loop(model, steps, faults, run_step):
    """Runs `run_step(x, y, step)` once a step, reading the scale before and the float8
    variables after it (outside the step)."""
    x, y = _data(1)
    seen = []
    for step in range(steps):
        scale = float(model.optimizer.loss_scale.numpy())
        run_step(tf.constant(x), tf.constant(y), tf.constant(step, tf.int64))
        seen.append((scale, _float8(model)))
    return seen


def _scaled_grads(model, faults):
    """A tf.function: the gradients of the scaled loss (corrupted on a faulty step)."""
    opt, variables = model.optimizer, model.trainable_variables

    @tf.function
    def grads(x, y, step):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
            scaled = opt.scale_loss(loss)
        found = tape.gradient(scaled, variables)
        return found if faults is None else faults.corrupt_gradients(found)

    return grads


def _custom(entry, model, faults):
    opt, variables = model.optimizer, model.trainable_variables
    grads = _scaled_grads(model, faults)
    if entry == "make_train_step":
        step = tfmixprec.make_train_step(model, keras.losses.MeanSquaredError(), opt)
        return lambda x, y, i: step(x if faults is None else faults.corrupt_inputs(x, i), y)
    if entry == "eager_apply":
        return lambda x, y, i: opt.apply(grads(x, y, i), variables)
    if entry == "one_function":
        return tf.function(lambda x, y, i: opt.apply(grads.python_function(x, y, i), variables))
    unscale = tf.function(lambda x, y, i: opt.get_unscaled_gradients(grads(x, y, i), variables))
    apply = tf.function(lambda g: opt.apply_gradients(zip(g, variables)))
    return lambda x, y, i: apply(unscale(x, y, i))


def _replicated_loop(strategy, model, steps, faults):
    opt = model.optimizer
    seen = []

    def step(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(y - model(x, training=True)), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=4)
            scaled = opt.scale_loss(loss)
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

    run = tf.function(lambda batch: strategy.run(step, args=batch))
    for batch in strategy.experimental_distribute_dataset(_dataset(steps, faults)):
        scale = float(opt.loss_scale.numpy())
        run(batch)
        seen.append((scale, _float8(model)))
    return seen


def _train(entry, steps, faults=None, strategy=None):
    """A fresh model trained `steps` steps by `entry`; per step, the loss scale it used and
    `b`'s float8 variables after it."""
    model = _model(strategy if entry in REPLICATED else None)
    if entry in ("fit", "two_replicas_fit"):
        return model, _fit(model, steps, faults)
    if entry == "two_replicas_loop":
        return model, _replicated_loop(strategy, model, steps, faults)
    return model, _loop(model, steps, faults, _custom(entry, model, faults))


def _new_scale(amax, fmt_max):
    """Keras's delayed scale from an amax history whose largest value is `amax`, in float32."""
    return np.float32(1.0) / (np.float32(fmt_max) / np.float32(amax))


def _check_never_unscaled(seen):
    (_, first), (_, second) = seen
    # Step 0 records each tensor's amax; the scales follow them at step 1 (delayed scaling).
    assert first["inputs_amax_history"][0] == 1.0
    assert first["kernel_amax_history"][0] == np.float32(1 / 32)
    assert first["outputs_grad_amax_history"][0] == 16.0 * SCALE  # not 16: never unscaled
    assert [first[name] for name in ("inputs_scale", "kernel_scale", "outputs_grad_scale")] == [
        1.0
    ] * 3
    assert second["inputs_scale"] == _new_scale(1.0, 448.0)
    assert second["kernel_scale"] == _new_scale(1 / 32, 448.0)
    assert second["outputs_grad_scale"] == _new_scale(16.0 * SCALE, 57344.0)
    assert second["outputs_grad_amax_history"][[0, -1]].tolist() == [16.0 * SCALE] * 2


@pytest.mark.parametrize("entry", ENTRIES)
def test_float8_variables_are_never_unscaled(entry):
    model, seen = _train(entry, 2)
    _check_never_unscaled(seen)
    assert model.optimizer.read_state()["iterations"] == 2


@pytest.mark.parametrize("entry", REPLICATED)
def test_float8_variables_are_never_unscaled_under_two_replicas(entry, two_cpu_strategy):
    model, seen = _train(entry, 2, strategy=two_cpu_strategy)
    _check_never_unscaled(seen)
    for name in NAMES:  # the same on both replicas
        copies = [t.numpy() for t in getattr(model.get_layer("b"), name).value.values]
        assert copies[0].tobytes() == copies[1].tobytes()


def _check_skipped_step(model, seen, before):
    """Step 2 of 5 overflowed: skipped, the scale halved, float8 variables bit-identical."""
    assert [scale for scale, _ in seen] == [SCALE] * 3 + [SCALE / 2] * 2
    after = [values for _, values in seen]
    for name in NAMES:
        assert after[2][name].tobytes() == after[1][name].tobytes(), name
    for step in (0, 1, 3, 4):  # an applied step rolls every amax history
        earlier = before if step == 0 else after[step - 1]
        for name in NAMES[1::2]:
            assert after[step][name].tobytes() != earlier[name].tobytes(), (step, name)
    state = model.optimizer.read_state()
    assert (state["overflow_steps"], state["iterations"], state["last_overflow_step"]) == (1, 4, 2)


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_skipped_step_leaves_float8_variables_bit_identical(entry):
    before = _float8(_model())
    model, seen = _train(entry, 5, FaultInjector(5, steps=[2]))
    _check_skipped_step(model, seen, before)


@pytest.mark.parametrize("entry", REPLICATED)
def test_a_skipped_step_under_two_replicas(entry, two_cpu_strategy):
    before = _float8(_model())
    model, seen = _train(entry, 5, FaultInjector(5, steps=[2]), two_cpu_strategy)
    _check_skipped_step(model, seen, before)


def _window_model(optimizer):
    C = keras.initializers.Constant
    with tfmixprec.policy_scope("mixed_bfloat16"):
        inputs = keras.Input((32,))
        hidden = keras.layers.Dense(32, name="a", kernel_initializer=C(1 / 32))(inputs)
        hidden = keras.layers.Dense(32, name="b", kernel_initializer=C(1 / 32))(hidden)
        outputs = keras.layers.Dense(1, name="out", dtype="float32", kernel_initializer=C(0.5))(
            hidden
        )
        model = keras.Model(inputs, outputs)
        assert [c.layer for c in tfmixprec.float8_layers(model)] == ["b"]
        model.compile(optimizer, "mse")
    return model


def _window_histories(optimizer, strategy=None):
    """b's newest inputs and outputs_grad amax after one window of two micro-batches whose
    inputs reach `b` as 1 and as 64."""
    x = np.concatenate([np.ones((4, 32)), 64 * np.ones((4, 32))]).astype("float32")
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = _window_model(optimizer())
    model.fit(x, np.zeros((8, 1), "float32"), batch_size=4, verbose=0, shuffle=False)
    b = model.get_layer("b")
    return b.inputs_amax_history.numpy()[0], b.outputs_grad_amax_history.numpy()[0]


@pytest.fixture(scope="module")
def keras_way():
    """Keras's own gradient accumulation on one device, once for both cases below."""
    return _window_histories(lambda: keras.optimizers.SGD(0.0, gradient_accumulation_steps=2))


@pytest.mark.parametrize("replicas", [1, 2])
def test_an_accumulation_window_keeps_the_largest_amax_as_keras_does(
    replicas, two_cpu_strategy, keras_way
):
    """One window writes the larger micro-batch's amax into b's histories, as Keras's own
    gradient accumulation does (not the mean of the two); across 2 replicas too (Keras's own
    accumulation does not run under a MirroredStrategy: compared with it on one device)."""
    ours = _window_histories(
        lambda: tfmixprec.LossScaleOptimizer(
            keras.optimizers.SGD(0.0), dynamic=False, initial_scale=1.0, accumulation_steps=2
        ),
        two_cpu_strategy if replicas == 2 else None,
    )
    assert ours[0] == keras_way[0] == 64.0
    assert ours[1] == keras_way[1] > 0
