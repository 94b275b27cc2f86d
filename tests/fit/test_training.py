"""Tests of the mixed-precision train_step, gradient accumulation and custom-loop helpers."""

import csv
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec import LossScaleOptimizer, MixedPrecisionModel


def _data(n=32, features=4, outputs=2, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.normal(size=(n, outputs)).astype("float32")
    return x, y


def _functional(cls=MixedPrecisionModel, width=8, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(width, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(2, dtype="float32", name="out")(hidden)
    return cls(inputs, outputs)


def _weights(model):
    return [w.numpy().copy() for w in model.weights]


def _same_bits(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert u.tobytes() == v.tobytes()


def _reference_loop(policy, x, y, batch, epochs, optimizer):
    """A plain GradientTape loop with no loss scaling, under `policy`."""
    tfmixprec.set_policy(policy)
    model = _functional(cls=keras.Model)
    loss_fn = keras.losses.MeanSquaredError()
    optimizer.build(model.trainable_variables)  # made here, the step is traced once

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    for _ in range(epochs):
        for start in range(0, len(x), batch):
            step(x[start : start + batch], y[start : start + batch])
    return _weights(model)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_fit_matches_reference_loop(policy):
    x, y = _data()
    reference = _reference_loop(policy, x, y, 8, 2, keras.optimizers.Adam(0.01))
    tfmixprec.set_policy(policy)
    model = _functional()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    assert isinstance(model.optimizer, LossScaleOptimizer)
    assert model.optimizer.dynamic is False and float(model.optimizer.loss_scale) == 1.0
    for a, b in zip(reference, _weights(model)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_mixed_bfloat16_close_to_float32_reference():
    x, y = _data()
    reference = _reference_loop("float32", x, y, 8, 2, keras.optimizers.SGD(0.05))
    tfmixprec.set_policy("mixed_bfloat16")
    model = _functional()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    for a, b in zip(reference, _weights(model)):
        np.testing.assert_allclose(a, b, atol=2e-2)  # bfloat16 keeps 8 mantissa bits


def test_inf_batch_is_skipped_and_next_applied():
    tfmixprec.set_policy("mixed_float16")
    model = _functional()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    x, y = _data(8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    before = _weights(model) + [v.numpy().copy() for v in model.optimizer.inner_optimizer.variables]
    x_bad = x.copy()
    x_bad[2, 3] = np.inf
    history = model.fit(x_bad, y, batch_size=8, epochs=1, verbose=0)
    after = _weights(model) + [v.numpy().copy() for v in model.optimizer.inner_optimizer.variables]
    _same_bits(before, after)
    assert history.history["overflow"] == [1.0]
    assert history.history["loss_scale"] == [2.0**14]
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert history.history["overflow"] == [0.0]
    assert not np.array_equal(before[0], model.weights[0].numpy())
    assert int(model.optimizer.iterations.numpy()) == 2


def test_logs_in_history_and_csv_logger(tmp_path):
    model = _functional()
    model.compile(optimizer="sgd", loss="mse", loss_scaling="dynamic")
    x, y = _data(16)
    path = tmp_path / "log.csv"
    history = model.fit(
        x, y, batch_size=8, epochs=2, verbose=0, callbacks=[keras.callbacks.CSVLogger(str(path))]
    )
    assert history.history["loss_scale"] == [32768.0, 32768.0]
    assert history.history["overflow"] == [0.0, 0.0]
    rows = list(csv.DictReader(path.open()))
    assert [float(r["loss_scale"]) for r in rows] == [32768.0, 32768.0]
    assert [float(r["overflow"]) for r in rows] == [0.0, 0.0]


def test_clipping_happens_after_unscaling():
    x, y = _data(16)
    reference = _reference_loop("float32", x, y, 16, 3, keras.optimizers.SGD(0.5, clipnorm=1.0))
    tfmixprec.set_policy("float32")
    model = _functional()
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.5, clipnorm=1.0), initial_scale=2.0**15)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    for a, b in zip(reference, _weights(model)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # The gradient norm really exceeded 1, so the clip mattered.
    unclipped = _reference_loop("float32", x, y, 16, 3, keras.optimizers.SGD(0.5))
    assert not np.allclose(unclipped[0], reference[0], atol=1e-4)


@pytest.mark.parametrize(
    "compile_kwargs",
    [
        dict(jit_compile=True),
        dict(steps_per_execution=2),
        dict(jit_compile=False, run_eagerly=True),
    ],
)
def test_multi_output_sample_weights_validation(compile_kwargs):
    tfmixprec.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    reg = keras.layers.Dense(1, dtype="float32", name="reg")(hidden)
    cls = keras.layers.Dense(3, activation="softmax", dtype="float32", name="cls")(hidden)
    model = MixedPrecisionModel(inputs, {"reg": reg, "cls": cls})
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss={"reg": "mse", "cls": "sparse_categorical_crossentropy"},
        loss_weights={"reg": 1.0, "cls": 0.5},
        metrics={"cls": ["accuracy"]},
        **compile_kwargs,
    )
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = {"reg": rng.normal(size=(16, 1)).astype("float32"), "cls": rng.integers(0, 3, size=(16,))}
    sample_weight = {"reg": np.linspace(0.5, 1.5, 16), "cls": np.ones(16)}
    before = _weights(model)
    validation = (x[:8].copy(), {"reg": y["reg"][:8], "cls": y["cls"][:8]})
    x[5, 0] = np.nan  # the first batch overflows
    history = model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=8,
        epochs=1,
        verbose=0,
        shuffle=False,
        validation_data=validation,
    )
    logs = history.history
    assert logs["overflow"] == [1.0]  # the epoch's overflow steps (its first batch)
    assert int(model.optimizer.overflow_steps.numpy()) == 1
    assert int(model.optimizer.iterations.numpy()) == 1
    assert logs["loss_scale"] == [2.0**14]
    assert {"loss", "cls_accuracy", "val_loss", "val_cls_accuracy"} <= set(logs)
    assert np.isfinite(logs["val_loss"][0])
    assert not np.array_equal(before[0], model.weights[0].numpy())
    assert all(np.isfinite(w).all() for w in _weights(model))


def test_compile_wrapping_rules():
    tfmixprec.set_policy("mixed_float16")
    model = _functional()
    model.compile(optimizer="adam", loss="mse")
    assert type(model.optimizer) is LossScaleOptimizer and model.optimizer.dynamic
    assert isinstance(model.optimizer.inner_optimizer, keras.optimizers.Adam)
    keras_lso = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=64, dynamic_growth_steps=9
    )
    model.compile(optimizer=keras_lso, loss="mse")
    assert type(model.optimizer) is LossScaleOptimizer
    assert model.optimizer.inner_optimizer is keras_lso.inner_optimizer
    assert (model.optimizer.initial_scale, model.optimizer.growth_interval) == (64, 9)
    ours = LossScaleOptimizer(keras.optimizers.SGD())
    model.compile(optimizer=ours, loss="mse")
    assert model.optimizer is ours
    model.compile(optimizer="sgd", loss="mse", loss_scaling="none")
    assert model.optimizer.dynamic is False and model.optimizer.initial_scale == 1.0


def _one_step_scale(step_or_model, x, y):
    if isinstance(step_or_model, keras.Model):
        step_or_model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
        return float(step_or_model.optimizer.loss_scale)
    return float(step_or_model(x, y)["loss_scale"])


@pytest.mark.parametrize(
    "policy, scale, dynamic",
    [("mixed_float16", 32768.0, True), ("mixed_bfloat16", 1.0, False), ("float32", 1.0, False)],
)
def test_one_default_loss_scale_per_policy(policy, scale, dynamic):
    """compile and make_train_step pick the same scale (loss_scale.default_config) and the
    logs report it; a bfloat16 model is never given a pointless dynamic scale."""
    x, y = _data(n=8)
    with tfmixprec.policy_scope(policy):
        model = _functional()
        model.compile(optimizer="sgd", loss="mse")
        other = _functional()
        step = tfmixprec.make_train_step(other, keras.losses.MeanSquaredError(), "sgd")
    for opt in (model.optimizer, step.optimizer):
        assert (opt.initial_scale, opt.dynamic) == (scale, dynamic)
    assert _one_step_scale(model, x, y) == _one_step_scale(step, x, y) == scale


def test_a_dynamic_scale_given_for_a_bfloat16_model_is_kept_with_a_warning():
    with tfmixprec.policy_scope("mixed_bfloat16"):
        model = _functional()
    given = LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.warns(UserWarning) as caught:
        model.compile(optimizer=given, loss="mse")
    assert [str(w.message) for w in caught] == [
        "The model computes in bfloat16, whose range is float32's: it needs no loss scaling, "
        "yet its tfmixprec.LossScaleOptimizer has a dynamic scale from 32768. Pass the plain "
        "optimizer (e.g. compile(optimizer='adam')): tfmixprec then uses a fixed scale of 1, "
        'which still skips Inf/NaN steps. See the tfmixprec guide "Fit and callbacks" '
        "(docs/guides/fit-and-callbacks.md in the tfmixprec repository)."
    ]
    assert caught[0].filename == __file__  # points at the user's compile call
    assert model.optimizer is given and given.dynamic
    float32_model = _functional()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float32 models test scaling: no warning
        float32_model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD()), loss="mse")
        tfmixprec.make_train_step(
            float32_model, keras.losses.MeanSquaredError(), LossScaleOptimizer("sgd")
        )


def test_compile_bad_input():
    model = _functional()
    with pytest.raises(ValueError, match=r"loss_scaling must be one of.*'always'"):
        model.compile(optimizer="sgd", loss="mse", loss_scaling="always")
    with pytest.raises(ValueError, match=r"accumulation_steps must be an integer >= 1.*=0"):
        model.compile(optimizer="sgd", loss="mse", accumulation_steps=0)
    used = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    used.build(model.trainable_variables)
    with pytest.raises(ValueError, match="already been used"):
        model.compile(optimizer=used, loss="mse")
    assert getattr(model, "optimizer", None) is None  # nothing half-changed


class SubclassedNet(MixedPrecisionModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(2, dtype="float32")

    def call(self, x):
        return self.out(self.hidden(x))


class MixinNet(tfmixprec.MixedPrecisionMixin, keras.Sequential):
    pass


@pytest.mark.parametrize("kind", ["subclassed", "mixin"])
def test_subclassed_and_mixin(kind):
    tfmixprec.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    if kind == "subclassed":
        model = SubclassedNet()
    else:
        model = MixinNet(
            [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2, dtype="float32")]
        )
    model.compile(optimizer="sgd", loss="mse")
    x, y = _data(8)
    x[0, 0] = np.inf
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert history.history["overflow"] == [1.0]
    assert isinstance(model.optimizer, LossScaleOptimizer)


def test_keras_file_round_trip(tmp_path):
    tfmixprec.set_policy("mixed_float16")
    model = _functional()
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=64), loss="mse"
    )
    x, y = _data(8)
    bad = x.copy()
    bad[0, 0] = np.inf
    model.fit(bad, y, batch_size=8, verbose=0)
    model.fit(x, y, batch_size=8, verbose=0)
    path = tmp_path / "mp.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is tfmixprec.MixedPrecisionFunctional
    assert isinstance(loaded, MixedPrecisionModel)
    assert float(loaded.optimizer.loss_scale.numpy()) == 32.0
    assert int(loaded.optimizer.overflow_steps.numpy()) == 1
    _same_bits(_weights(model), _weights(loaded))
    history = loaded.fit(x, y, batch_size=8, verbose=0)
    assert history.history["loss_scale"] == [32.0]


# ----------------------------------------------------------------- accumulation
def test_accumulation_equals_one_big_batch():
    x, y = _data(16)
    tfmixprec.set_policy("float32")
    big = _functional()
    big.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    big.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    small = _functional()
    small.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulation_steps=4)
    small.fit(x, y, batch_size=4, epochs=3, verbose=0, shuffle=False)
    for a, b in zip(_weights(big), _weights(small)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(small.optimizer.iterations.numpy()) == 3  # one step per window


def test_accumulation_overflow_discards_window_and_backs_off_once():
    tfmixprec.set_policy("float32")
    model = _functional()
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8),
        loss="mse",
        accumulation_steps=4,
    )
    x, y = _data(16)
    before = _weights(model)
    x_bad = x.copy()
    x_bad[5, 1] = np.inf  # micro-batch 2 of 4
    history = model.fit(x_bad, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    _same_bits(before, _weights(model))
    assert float(model.optimizer.loss_scale.numpy()) == 4.0  # once, not per micro-batch
    assert int(model.optimizer.overflow_steps.numpy()) == 1
    assert int(model.optimizer.iterations.numpy()) == 0
    assert history.history["overflow"] == [1.0]  # reported at the window's last batch
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)  # clean window applies
    assert int(model.optimizer.iterations.numpy()) == 1
    assert not np.array_equal(before[0], model.weights[0].numpy())


def test_accumulation_logs_an_overflow_only_at_the_window_that_skipped():
    """A clean micro-batch after an overflow window is no overflow step (it was logged 1.0):
    only the micro-batch that ends a window can be skipped."""
    tfmixprec.set_policy("float32")
    model = _functional()
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8),
        loss="mse",
        accumulation_steps=2,
    )
    x, y = _data(16)
    x[1, 0] = np.inf  # micro-batch 0 of window 0
    flags = []

    class Flags(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            flags.append(float(logs["overflow"]))

    model.fit(x, y, batch_size=2, verbose=0, shuffle=False, callbacks=[Flags()])
    assert flags == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_a_fit_that_ends_inside_a_window_says_so():
    tfmixprec.set_policy("float32")
    model = _functional()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", accumulation_steps=4)
    x, y = _data(8)
    with pytest.warns(RuntimeWarning, match=r"2 of 4 micro-batches are summed.*discard_partial"):
        model.fit(x[:6], y[:6], batch_size=1, verbose=0)  # one window and 2 micro-batches
    assert model.optimizer.discard_partial_window() == 2
    assert model.optimizer.discard_partial_window() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a whole number of windows: nothing to say
        model.fit(x[:8], y[:8], batch_size=2, epochs=1, verbose=0)


def test_accumulation_with_learning_rate_schedule():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([1], [0.1, 0.0])
    model = _functional()
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse", accumulation_steps=2)
    x, y = _data(8)
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, shuffle=False)  # 2 windows
    after_two = _weights(model)
    # The schedule saw 2 steps (not 4 micro-batches): lr is now 0 and nothing moves.
    assert int(model.optimizer.iterations.numpy()) == 2
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, shuffle=False)
    _same_bits(after_two, _weights(model))


# ------------------------------------------------------------------- distribution
def test_mirrored_strategy_one_replica_overflow(two_cpu_strategy):
    tfmixprec.set_policy("float32")
    with two_cpu_strategy.scope():
        model = _functional()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", loss_scaling="dynamic")
    x, y = _data(16)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    before = _weights(model)
    x_bad = x.copy()
    x_bad[15, 0] = np.inf  # replica 1's shard only
    history = model.fit(x_bad, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert history.history["overflow"] == [1.0]
    _same_bits(before, _weights(model))
    for var in model.weights:
        copies = [t.numpy() for t in var.value.values]
        _same_bits(copies[:1], copies[1:])
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert history.history["overflow"] == [0.0]
    assert int(model.optimizer.iterations.numpy()) == 2


def _sgd_accumulating(steps):
    return LossScaleOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.5), initial_scale=64, accumulation_steps=steps
    )


def _replica_copies_identical(model):
    for var in model.weights + model.optimizer.variables:
        copies = [t.numpy() for t in getattr(var.value, "values", [var.value])]
        _same_bits(copies[:1], copies[1:])


def _custom_loop(strategy, model, x, y, micro_batch, eager):
    """A user's own loop: `strategy.run` of a GradientTape step, the loss averaged over the
    global micro-batch (`tf.nn.compute_average_loss`), eager or in a `tf.function`. The
    optimizer is built first, in the scope: Keras 3 optimizers (plain SGD too) cannot create
    their variables inside a `tf.function` under MirroredStrategy."""
    opt = model.optimizer
    with strategy.scope():
        opt.build(model.trainable_variables)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(yb - model(xb, training=True)), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=micro_batch)
            scaled = opt.scale_loss(loss)
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

    def run(batch):
        strategy.run(step, args=batch)

    run = run if eager else tf.function(run)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(micro_batch)
    for batch in strategy.experimental_distribute_dataset(dataset):
        run(batch)


@pytest.fixture(scope="module")
def one_big_batch():
    """The weights and optimizer state after 2 steps of 16 on one device (no accumulation):
    what each pattern below must reach with micro-batches of 4 on 2 replicas."""
    x, y = _data(32)
    with tfmixprec.policy_scope("float32"):
        big = _functional()
        big.compile(optimizer=_sgd_accumulating(1), loss="mse")
    big.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)  # 2 steps of 16
    return _weights(big), big.optimizer.read_state()


@pytest.mark.parametrize("pattern", ["fit", "tf.function loop", "eager loop"])
def test_accumulation_under_two_replicas_equals_one_big_batch(
    two_cpu_strategy, pattern, one_big_batch
):
    x, y = _data(32)
    big_weights, big_state = one_big_batch
    tfmixprec.set_policy("float32")
    with two_cpu_strategy.scope():
        small = _functional()
        small.compile(optimizer=_sgd_accumulating(4), loss="mse")
    if pattern == "fit":  # micro-batches of 4: 2 samples on each replica
        small.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
    else:
        _custom_loop(two_cpu_strategy, small, x, y, 4, eager=pattern == "eager loop")
    for a, b in zip(big_weights, _weights(small), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert small.optimizer.read_state() == big_state  # 2 applied steps
    assert int(small.optimizer._accumulator.micro_step.numpy()) == 0
    _replica_copies_identical(small)


def test_accumulation_under_two_replicas_sums_stay_on_each_replica(two_cpu_strategy, tmp_path):
    """Mid-window nothing crosses replicas: each replica's copy of a sum is its own gradients'
    sum (so the gradients are all-reduced once per window, at its end)."""
    x, y = _data(16)
    tfmixprec.set_policy("float32")
    with two_cpu_strategy.scope():
        model = _functional()
        model.compile(optimizer=_sgd_accumulating(4), loss="mse")
    model.fit(x[:8], y[:8], batch_size=4, epochs=1, verbose=0, shuffle=False)  # half a window
    kernel = model.get_layer("hidden").kernel
    expected = []
    for replica in range(2):  # micro-batch k gives samples 4k+2r, 4k+2r+1 to replica r
        rows = [4 * k + 2 * replica + i for k in range(2) for i in range(2)]
        total = 0.0
        for k in range(2):
            with tf.GradientTape() as tape:
                pred = model(x[rows[2 * k : 2 * k + 2]])
                loss = keras.losses.MeanSquaredError()(y[rows[2 * k : 2 * k + 2]], pred) / 2
            total += tape.gradient(loss, kernel.value).numpy()
        expected.append(total)
    index = model.optimizer.variable_index(kernel)
    copies = [t.numpy() for t in model.optimizer._accumulator.sums[index].value.values]
    assert not np.allclose(copies[0], copies[1])
    for copy, total in zip(copies, expected):
        np.testing.assert_allclose(copy, total, rtol=1e-5, atol=1e-7)
    assert model.optimizer.read_state()["iterations"] == 0
    # A backup in mid-window holds replica 0's sums and restores them on every replica (README).
    model.save_weights(tmp_path / "mid.weights.h5")
    with two_cpu_strategy.scope():
        restored = _functional()
        restored.compile(optimizer=_sgd_accumulating(4), loss="mse")
        restored.optimizer.build(restored.trainable_variables)
    restored.load_weights(tmp_path / "mid.weights.h5")
    sums = restored.optimizer._accumulator.sums[index].value.values
    _same_bits([copies[0], copies[0]], [t.numpy() for t in sums])


def test_accumulation_under_two_replicas_overflow_on_one_replica_skips_the_window(
    two_cpu_strategy,
):
    x, y = _data(32)
    x[7, 0] = np.inf  # micro-batch 1 of window 0, in replica 1's half (samples 6-7)
    tfmixprec.set_policy("float32")
    with two_cpu_strategy.scope():
        model = _functional()
        model.compile(optimizer=_sgd_accumulating(4), loss="mse")
    before = _weights(model)
    history = model.fit(x[:16], y[:16], batch_size=4, epochs=1, verbose=0, shuffle=False)
    _same_bits(before, _weights(model))  # the whole window is skipped, on both replicas
    state = model.optimizer.read_state()
    assert (state["loss_scale"], state["overflow_steps"], state["iterations"]) == (32.0, 1, 0)
    assert history.history["overflow"] == [1.0]
    _replica_copies_identical(model)
    assert sorted(model.optimizer.overflow_report(model).last_overflow_layers) == ["hidden", "out"]
    model.fit(x[16:], y[16:], batch_size=4, epochs=1, verbose=0, shuffle=False)  # clean
    assert model.optimizer.read_state()["iterations"] == 1
    assert not np.array_equal(before[0], model.weights[0].numpy())
    _replica_copies_identical(model)


@pytest.mark.slow
def test_accumulation_across_two_workers_equals_one_big_batch(tmp_path):
    """2 worker processes (MultiWorkerMirroredStrategy on 127.0.0.1), micro-batches of 4 (2
    samples a worker), windows of 4: equal to one process with batches of 16, on clean data
    and with sample 7 (worker 1's half of micro-batch 1) Inf: both workers skip window 0,
    bit-identically."""
    import json
    import sys
    from pathlib import Path

    worker = Path(__file__).resolve().parents[1] / "workers" / "accumulation_worker.py"
    command = [sys.executable, str(worker), "--out", str(tmp_path), "--inf-sample", "-1", "7"]
    for result in tfmixprec.testing.run_workers(command, 2, timeout=240):
        assert result.returncode == 0, result.stderr[-3000:]
    sys.path.insert(0, str(worker.parent))
    try:
        import accumulation_worker
    finally:
        sys.path.remove(str(worker.parent))
    for inf_sample, overflows in [(-1, [0.0]), (7, [1.0])]:
        x, y = accumulation_worker.data(inf_sample)
        big = accumulation_worker.build(accumulation_steps=1)
        history = big.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        assert history.history["overflow"] == overflows
        states = [json.loads((tmp_path / f"{inf_sample}-{i}.json").read_text()) for i in (0, 1)]
        weights = [np.load(tmp_path / f"{inf_sample}-{i}.npz") for i in (0, 1)]
        assert states[0] == states[1]
        assert states[0]["state"] == big.optimizer.read_state()
        assert states[0]["history"]["overflow"] == history.history["overflow"]
        _same_bits(*[[w[name] for name in w.files] for w in weights])
        for mine, theirs in zip(_weights(big), [weights[0][name] for name in weights[0].files]):
            np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ custom loops
def _tiny_loss_model():
    """A float16 model whose gradients (loss * 1e-9) are below 2^-24: they flush to zero."""
    tfmixprec.set_policy("mixed_float16")
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)])
    x, y = _data(8)
    return model, x, y


def _tiny_loss(y_true, y_pred):
    return 1e-9 * tf.reduce_mean(tf.square(y_true - tf.cast(y_pred, tf.float32)))


def test_make_train_step_trains_where_plain_float16_does_not():
    model, x, y = _tiny_loss_model()
    before = _weights(model)
    plain = keras.optimizers.SGD(1e6)
    plain.build(model.trainable_variables)  # made here, the step is traced once

    @tf.function
    def plain_step():
        with tf.GradientTape() as tape:
            loss = _tiny_loss(y, model(x, training=True))
        plain.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    for _ in range(3):
        plain_step()
    _same_bits(before, _weights(model))  # every gradient flushed to zero in float16

    step = tfmixprec.make_train_step(model, _tiny_loss, keras.optimizers.SGD(1e6))
    assert step.optimizer.dynamic is True
    for _ in range(3):
        logs = step(x, y)
    assert set(logs) == {"loss", "loss_scale", "overflow", "overflow_steps", "skipped_fraction"}
    assert float(logs["overflow"]) == 0.0 and float(logs["loss_scale"]) == 2.0**15
    assert not np.array_equal(before[0], model.weights[0].numpy())
    assert all(np.isfinite(w).all() for w in _weights(model))


def test_compute_unscaled_gradients_and_tf2_api_in_custom_loop():
    for style in ("helper", "tf2"):
        model, x, y = _tiny_loss_model()
        before = _weights(model)
        opt = LossScaleOptimizer(keras.optimizers.SGD(1e6))

        @tf.function
        def train(xb, yb, style=style, model=model, opt=opt):
            with tf.GradientTape() as tape:
                loss = _tiny_loss(yb, model(xb, training=True))
                scaled = opt.get_scaled_loss(loss)
            if style == "helper":
                grads, finite = tfmixprec.compute_unscaled_gradients(
                    tape, loss, model.trainable_variables, opt
                )
            else:
                grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
                finite = tf.constant(True)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return finite

        assert bool(train(x, y))
        train(x, y)
        assert int(opt.iterations.numpy()) == 2
        assert not np.array_equal(before[0], model.weights[0].numpy()), style
        x_bad = x.copy()
        x_bad[0, 0] = np.inf
        middle = _weights(model)
        finite = train(x_bad, y)
        _same_bits(middle, _weights(model))
        assert int(opt.overflow_steps.numpy()) == 1
        if style == "helper":
            assert not bool(finite)


def test_make_train_step_takes_keras_identifiers_as_compile_does():
    """`make_train_step(model, "mse", "sgd")` trains bit for bit as the loss and optimizer
    objects Keras's compile would make of those names."""
    x, y = _data(8)
    results = []
    for loss, optimizer in [
        ("mse", "sgd"),
        (keras.losses.MeanSquaredError(), keras.optimizers.SGD()),
    ]:
        model = _functional(keras.Model)
        step = tfmixprec.make_train_step(model, loss, optimizer)
        assert isinstance(step.optimizer.inner_optimizer, keras.optimizers.SGD)
        losses = [float(step(x, y)["loss"]) for _ in range(3)]
        results.append((losses, _weights(model)))
    assert results[0][0] == results[1][0]
    _same_bits(results[0][1], results[1][1])


def test_compile_names_the_optimizer_argument_it_was_given():
    model = _functional()
    with pytest.raises(TypeError, match=r"^optimizer must be a Keras 3 optimizer .*optimizer=123 "):
        model.compile(optimizer=123, loss="mse")
    with pytest.raises(ValueError, match=r"^optimizer must be .*Received: optimizer='adamm'$"):
        model.compile(optimizer="adamm", loss="mse")
    assert getattr(model, "optimizer", None) is None  # nothing half-changed


def test_custom_loop_helpers_bad_input():
    model, x, y = _tiny_loss_model()
    with pytest.raises(TypeError, match=r"model must be a keras.Model.*str"):
        tfmixprec.make_train_step("model", _tiny_loss, "sgd")
    with pytest.raises(ValueError, match=r"loss_fn must be a callable or the name of a Keras loss"):
        tfmixprec.make_train_step(model, "mse!", "sgd")
    with pytest.raises(
        ValueError, match=r"optimizer must be a Keras 3 optimizer or the name.*'sgd!'"
    ):
        tfmixprec.make_train_step(model, "mse", "sgd!")
    with pytest.raises(TypeError, match=r"loss_fn must be a callable .*Received: loss_fn=3$"):
        tfmixprec.make_train_step(model, 3, "sgd")
    with tf.GradientTape() as tape:
        loss = _tiny_loss(y, model(x))
    with pytest.raises(TypeError, match=r"tfmixprec.LossScaleOptimizer.*type SGD"):
        tfmixprec.compute_unscaled_gradients(
            tape, loss, model.trainable_variables, keras.optimizers.SGD()
        )


def test_functional_and_subclassed_uses_do_not_interfere():
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2)(inputs)
    functional = MixedPrecisionModel(inputs, outputs)
    assert isinstance(functional, tfmixprec.MixedPrecisionFunctional)
    assert MixedPrecisionModel.__bases__ == (tfmixprec.MixedPrecisionMixin, keras.Model)
    assert SubclassedNet()(np.ones((1, 4), "float32")).shape == (1, 2)

    class Misused(MixedPrecisionModel):
        pass

    with pytest.raises(
        TypeError, match=r"Misused is a subclass of MixedPrecisionModel.*Functional"
    ):
        Misused(inputs, outputs)
    assert MixedPrecisionModel.__bases__ == (tfmixprec.MixedPrecisionMixin, keras.Model)

    class Named(tfmixprec.MixedPrecisionFunctional):
        def describe(self):
            return f"{self.name} has {len(self.layers)} layers"

    named = Named(inputs, outputs, name="n")
    assert named.describe() == "n has 2 layers"


# ------------------------------------------------------------------ float8 layers
def _float8_model(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = cls(inputs, keras.layers.Dense(4)(hidden))
    model.quantize("float8")  # scale/amax variables whose "gradients" are new values
    return model


def _float8_step(entry, model, x, y):
    opt = tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=1024.0)
    if entry == "fit":
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    elif entry == "make_train_step":
        tfmixprec.make_train_step(model, keras.losses.MeanSquaredError(), opt)(x, y)
    else:

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
            variables = model.trainable_variables
            grads, _ = tfmixprec.compute_unscaled_gradients(tape, loss, variables, opt)
            opt.apply(grads, variables)

        step(x, y)


@pytest.mark.parametrize("entry", ["fit", "make_train_step", "compute_unscaled_gradients"])
def test_float8_layers_train_as_under_plain_keras(entry):
    # At lr 0 only the float8 scale/amax variables change; Keras overwrites them with their
    # "gradients", which must not be divided by the loss scale.
    rng = np.random.RandomState(0)
    x, y = rng.randn(16, 8).astype("float32"), rng.randn(16, 4).astype("float32")
    cls = tfmixprec.MixedPrecisionModel if entry == "fit" else keras.Model
    model = _float8_model(cls)
    before = model.predict(x, verbose=0)
    _float8_step(entry, model, x, y)
    np.testing.assert_array_equal(model.predict(x, verbose=0), before)


@pytest.mark.parametrize("order", ["grad_last", "grad_first"])
def test_accumulation_keeps_gradients_missing_from_the_last_micro_batch(order):
    # A variable with a gradient in only one micro-batch of the window gets the window's mean
    # whatever the order; a last micro-batch with no gradients at all still ends the window.
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=4.0, accumulation_steps=2)
    a, b = keras.Variable([0.0]), keras.Variable([0.0])
    opt.build([a, b])
    both = [tf.constant([4.0]), tf.constant([8.0])]  # scaled gradients: true [1], [2]
    only_a = [tf.constant([4.0]), None]
    first, last = (only_a, both) if order == "grad_last" else (both, only_a)
    opt.apply(first, [a, b])
    opt.apply(last, [a, b])
    assert (float(a.numpy()[0]), float(b.numpy()[0])) == (-1.0, -1.0)  # b: (2 + 0) / 2
    opt.apply([tf.constant([4.0]), tf.constant([8.0])], [a, b])
    opt.apply([None, None], [a, b])  # nothing this micro-batch: the window still ends
    assert (float(a.numpy()[0]), float(b.numpy()[0])) == (-1.5, -2.0)
    assert int(opt.iterations.numpy()) == 2


def test_epoch_logs_count_the_epochs_overflow_steps(tmp_path):
    # Row 0 is Inf: with shuffle=False the first batch of every epoch overflows, once.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = MixedPrecisionModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=LossScaleOptimizer("sgd", initial_scale=8.0), loss="mse")
    x = np.ones((32, 4), "float32")
    x[0, 0] = np.inf
    log_path = tmp_path / "log.csv"
    history = model.fit(
        x,
        np.ones((32, 1), "float32"),
        batch_size=8,
        epochs=3,
        verbose=0,
        shuffle=False,
        callbacks=[keras.callbacks.CSVLogger(str(log_path))],
    )
    assert history.history["overflow"] == [1.0, 1.0, 1.0]  # not the last batch's 0.0
    assert history.history["overflow_steps"] == [1.0, 2.0, 3.0]
    with open(log_path) as f:
        assert [row["overflow"] for row in csv.DictReader(f)] == ["1.0"] * 3


def _bar_lines(model, x, y, verbose, capsys, callbacks=None):
    capsys.readouterr()
    history = model.fit(
        x, y, batch_size=8, epochs=2, verbose=verbose, shuffle=False, callbacks=callbacks
    )
    text = capsys.readouterr().out
    text = re.sub(r"\x08|\x1b\[[0-9;]*m", "", text)  # the bar's erasing and colours
    return history, [line for line in re.split(r"[\r\n]", text) if "loss" in line]


def test_progress_bar_shows_the_loss_scale_and_overflows_only(capsys):
    """The bar: loss, metrics, loss_scale, and overflow (the epoch's count so far) once there
    is one; the totals stay in History, and no 0.0000e+00."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = MixedPrecisionModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(
        optimizer=LossScaleOptimizer("sgd", initial_scale=8.0, min_scale=0.125), loss="mse"
    )
    x, y = np.ones((32, 4), "float32"), np.ones((32, 1), "float32")
    x[8, 0] = np.inf  # the second batch of every epoch overflows
    history, lines = _bar_lines(model, x, y, 2, capsys)  # verbose=2: one line per epoch
    assert len(lines) == 2
    for line, scale in zip(lines, ("4.0000", "2.0000")):
        assert re.search(rf" - loss: \S+ - loss_scale: {scale} - overflow: 1\.0000$", line), line
    assert history.history["overflow_steps"] == [1.0, 2.0]  # in History, not on the bar
    assert history.history["skipped_fraction"] == [0.25, 0.25]
    _, lines = _bar_lines(model, x, y, 1, capsys)  # verbose=1: the bar updates each batch
    assert lines[0].startswith("1/4") and "overflow" not in lines[0]  # no overflow yet
    assert lines[-1].endswith("loss_scale: 0.5000 - overflow: 1.0000")  # the epoch's count
    assert not any(key in "".join(lines) for key in ("overflow_steps", "skipped", "e+00"))
    clean = np.ones((32, 4), "float32")
    _, lines = _bar_lines(model, clean, y, 2, capsys)
    assert lines and not any("overflow" in line for line in lines)
    mine = keras.callbacks.ProgbarLogger()  # a progress bar of your own is used as it is
    _, lines = _bar_lines(model, x, y, 2, capsys, callbacks=[mine])
    assert "overflow_steps: " in lines[0]


def test_a_float16_model_loaded_under_mixed_bfloat16_keeps_its_advice(tmp_path):
    """Issue 47 item 10: judged by its layers' compute dtypes, not the global policy (the
    model's own policy and its InputLayer follow it when loaded): no "computes in bfloat16,
    needs no loss scaling" advice for a model whose layers compute in float16."""
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(2, dtype="float32")(keras.layers.Dense(4)(inputs))
        model = tfmixprec.MixedPrecisionModel(inputs, outputs)
        model.compile(optimizer="adam", loss="mse")
        model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
    model.save(tmp_path / "f16.keras")
    with tfmixprec.policy_scope("mixed_bfloat16"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = keras.models.load_model(tmp_path / "f16.keras")
    assert [w for w in seen if "computes in bfloat16" in str(w.message)] == []
    assert loaded.layers[1].compute_dtype == "float16" and loaded.optimizer.dynamic
