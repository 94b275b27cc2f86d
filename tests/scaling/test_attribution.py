"""Overflow attribution: which variables' (layers') gradients were not finite, kept in the step."""

import os
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec import LossScaleOptimizer

INF = np.float32(np.inf)


class GradBomb(keras.layers.Layer):
    """Identity forward; backward, the gradient becomes Inf/NaN when any trigger value > 100.

    So only the layers before it get non-finite gradients, on the batches chosen by the data.
    """

    def call(self, inputs):
        h, trigger = inputs

        @tf.custom_gradient
        def bomb(t):
            def grad(dy):
                boom = tf.reduce_any(trigger > 100.0)
                return tf.where(boom, dy * INF, dy)

            return tf.identity(t), grad

        return bomb(h)


def _bomb_model(cls=tfmixprec.MixedPrecisionModel):
    inputs = keras.Input((4,))
    a = keras.layers.Dense(8, name="a")(inputs)
    b = GradBomb(name="bomb")([a, inputs])
    outputs = keras.layers.Dense(2, name="b")(b)
    return cls(inputs, outputs)


def _data(n, triggers=()):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32")
    for row in triggers:
        x[row, 0] = 1000.0
    return x, y


def _counts(opt):
    _, counts, last = opt.overflow_sources()
    return counts, last


def _dense_grads(variables, bad):
    return [tf.ones_like(v) * (INF if i in bad else 1.0) for i, v in enumerate(variables)]


def _sgd_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, name="a"), keras.layers.Dense(2, name="b")],
        name="net",
    )
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    return model, opt


@pytest.mark.parametrize("mode", ["eager", "function", "two_functions"])
def test_counts_are_exact_for_injected_inf(mode):
    model, opt = _sgd_model()
    variables = model.trainable_variables  # a/kernel, a/bias, b/kernel, b/bias

    def step(bad):
        grads = _dense_grads(variables, bad)
        if mode == "two_functions":  # TF 2 style: unscale in one function, apply in another
            unscaled = tf.function(opt.get_unscaled_gradients)(grads)
            tf.function(lambda g: opt.apply_gradients(zip(g, variables)))(unscaled)
        elif mode == "function":
            tf.function(lambda g: opt.apply(g, variables))(grads)
        else:
            opt.apply(grads, variables)

    for bad in ([2], [], [0, 2], [3], []):
        step(bad)
    counts, last = _counts(opt)
    assert counts == [1, 0, 2, 1]
    assert last == [2, -1, 2, 3]  # 0-based steps, skipped ones counted
    report = tfmixprec.overflow_report(model)
    assert report.overflow_steps == 3 and report.last_overflow_step == 3
    assert [(r.layer, r.overflow_steps, r.last_step) for r in report.layers] == [
        ("b", 2, 3),
        ("a", 1, 2),
    ]
    assert report.last_overflow_layers == ["b"]
    assert report.layers[0].variables == ("net/b/kernel", "net/b/bias")
    assert opt.overflow_report().layers[0].layer == "net/b"  # by variable path
    assert "| b | 2 | 3 |" in report.to_markdown()
    assert report.to_dict()["last_overflow_layers"] == ["b"]
    assert str(report).startswith("3 overflow steps; at the last (step 3) gradients were not")


def test_a_subset_apply_is_attributed_to_its_variables():
    model, opt = _sgd_model()
    variables = model.trainable_variables
    half = variables[2:]  # apply to layer b only: its own positions are 0 and 1
    opt.apply([tf.ones_like(half[0]), tf.ones_like(half[1]) * INF], half)
    assert _counts(opt)[0] == [0, 0, 0, 1]


def test_indexed_slices_are_attributed():
    keras.utils.set_random_seed(0)
    embedding = keras.layers.Embedding(10, 4, name="emb")
    dense = keras.layers.Dense(2, name="out")
    model = keras.Sequential([keras.Input((3,), dtype="int32"), embedding, dense])
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    values = tf.constant([[1.0, 1.0, 1.0, 1.0], [INF, 1.0, 1.0, 1.0]])
    sparse = tf.IndexedSlices(values, tf.constant([1, 5]), tf.constant([10, 4]))
    grads = [sparse] + [tf.ones_like(v) for v in model.trainable_variables[1:]]
    opt.apply(grads, model.trainable_variables)
    assert _counts(opt)[0] == [1, 0, 0]
    assert tfmixprec.overflow_report(model).last_overflow_layers == ["emb"]


def test_fit_attributes_to_the_layers_before_the_bad_gradient():
    keras.utils.set_random_seed(0)
    model = _bomb_model()
    model.compile(optimizer=LossScaleOptimizer("sgd", initial_scale=4.0), loss="mse")
    x, y = _data(32, triggers=[9, 27])  # batches 1 and 3 of 8 rows
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    report = tfmixprec.overflow_report(model)
    assert [(r.layer, r.overflow_steps, r.last_step) for r in report.layers] == [("a", 2, 3)]
    assert report.overflow_steps == 2


def test_two_replicas_one_replica_one_layer(two_cpu_strategy):
    with two_cpu_strategy.scope():
        keras.utils.set_random_seed(0)
        model = _bomb_model()
        opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=4.0)
        model.compile(optimizer=opt, loss="mse")
    x, y = _data(32, triggers=[12])  # batch 0 (16 rows), second half: replica 1 only
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert _counts(opt) == ([1, 1, 0, 0], [0, 0, -1, -1])
    for var in [opt._loss_scale.nonfinite_steps, opt._loss_scale.last_nonfinite_step]:
        copies = [t.numpy() for t in var.value.values]
        np.testing.assert_array_equal(copies[0], copies[1])
    assert tfmixprec.overflow_report(model).last_overflow_layers == ["a"]


def test_accumulation_attributes_a_spoiled_window_once():
    model, _ = _sgd_model()
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0, accumulation_steps=2)
    variables = model.trainable_variables
    opt.build(variables)
    for bad in ([1], [1, 3], [], []):  # window 1: micro-batches 1 and 2 spoiled; window 2 clean
        opt.apply(_dense_grads(variables, bad), variables)
    assert int(opt.overflow_steps.numpy()) == 1
    assert _counts(opt) == ([0, 1, 0, 1], [-1, 0, -1, 0])


def test_attribution_is_saved_and_loaded(tmp_path):
    keras.utils.set_random_seed(0)
    model = _bomb_model()
    model.compile(optimizer=LossScaleOptimizer("sgd", initial_scale=4.0), loss="mse")
    x, y = _data(16, triggers=[3])
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path, custom_objects={"GradBomb": GradBomb})
    assert _counts(loaded.optimizer) == _counts(model.optimizer) == ([1, 1, 0, 0], [0, 0, -1, -1])
    checkpoint = tf.train.Checkpoint(optimizer=model.optimizer)
    saved = checkpoint.save(os.path.join(tmp_path, "ckpt"))
    model.optimizer._loss_scale.nonfinite_steps.assign([0, 0, 0, 0])
    checkpoint.restore(saved)
    assert _counts(model.optimizer)[0] == [1, 1, 0, 0]


def test_no_overflow_report_and_bad_input():
    model, opt = _sgd_model()
    assert str(tfmixprec.overflow_report(model)) == "No overflow steps so far."
    assert LossScaleOptimizer("sgd").overflow_report().layers == ()  # not built yet
    plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    plain.compile(optimizer="adam", loss="mse")
    with pytest.raises(TypeError, match="optimizer is Adam"):
        tfmixprec.overflow_report(plain)


def test_a_file_from_before_the_attribution_loads():
    # tfmixprec 0.1 saved the optimizer by position without last_overflow_scale, the two
    # vectors and OverflowGuard's two counters (files really written by 0.1: test_state_file).
    model, opt = _sgd_model()
    opt.apply(_dense_grads(model.trainable_variables, [1]), model.trainable_variables)
    added = {id(v) for v in opt._loss_scale.attribution_variables()}
    added |= {id(opt.min_scale_overflows), id(opt.longest_overflow_run)}
    assert len(added) == 5
    old_store = {}
    for i, variable in enumerate(v for v in opt.variables if id(v) not in added):
        old_store[str(i)] = variable.numpy()
    fresh_model, fresh = _sgd_model()
    fresh.load_own_variables(old_store)
    # The scale and counters 0.1 had came back; OverflowGuard's two start fresh.
    expected = {**opt.read_state(), "min_scale_overflows": 0, "longest_overflow_run": 0}
    assert fresh.read_state() == expected
    assert _counts(fresh) == ([0, 0, 0, 0], [-1, -1, -1, -1])  # attribution starts empty


def test_epoch_count_with_positional_callbacks_and_a_callback_list():
    model = _bomb_model()
    model.compile(optimizer=LossScaleOptimizer("sgd", initial_scale=4.0), loss="mse")
    x, y = _data(32, triggers=[1, 9])  # batches 0 and 1 of 8 rows
    history = model.fit(x, y, 8, 1, 0, [keras.callbacks.History()], shuffle=False)
    assert history.history["overflow"] == [2.0]
    callbacks = keras.callbacks.CallbackList([keras.callbacks.History()], model=model)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks, shuffle=False)
    assert int(model.optimizer.overflow_steps.numpy()) == 4  # used as it is, no crash


def test_report_errors_name_the_optimizer():
    uncompiled = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(TypeError, match="whose optimizer is None \\(not compiled\\)"):
        tfmixprec.overflow_report(uncompiled)
    keras_lso = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    keras_lso.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(TypeError, match="Keras's own keras.optimizers.LossScaleOptimizer"):
        tfmixprec.overflow_report(keras_lso)


def test_counts_are_exact_across_threads():
    model, opt = _sgd_model()
    variables = model.trainable_variables
    step = tf.function(lambda g: opt.apply(g, variables))
    for bad in ([0], [3]):  # each step from its own thread, as replicas and callbacks run
        worker = threading.Thread(target=step, args=(_dense_grads(variables, bad),))
        worker.start()
        worker.join()
    assert _counts(opt) == ([1, 0, 0, 1], [0, -1, -1, 1])
