"""Tests of `tfmixprec.LossScaleOptimizer`: the scale state machine and its contract."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmixprec import LossScaleOptimizer

OK, BAD = False, True  # one step's gradients: finite, or with an Inf


def _step(opt, var, overflow):
    """One eager step whose scaled gradient is finite or Inf."""
    grad = np.full(var.shape, float(opt.loss_scale.numpy()), "float32")
    if overflow:
        grad[0] = np.inf
    opt.apply([tf.constant(grad)], [var])


def _run(pattern, **kwargs):
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), **kwargs)
    var = keras.Variable(np.ones(3, "float32"))
    scales = []
    for overflow in pattern:
        _step(opt, var, overflow)
        scales.append(float(opt.loss_scale.numpy()))
    return opt, scales


@pytest.mark.parametrize(
    "kwargs, pattern, expected",
    [
        # growth after `growth_interval` clean steps
        (dict(initial_scale=8, growth_interval=2), [OK] * 5, [8, 16, 16, 32, 32]),
        (dict(initial_scale=8, growth_interval=1, growth_factor=3), [OK] * 3, [24, 72, 216]),
        # backoff on every overflow (hysteresis 1), the clean counter restarts
        (dict(initial_scale=8, growth_interval=2), [BAD, BAD, OK, OK], [4, 2, 2, 4]),
        (dict(initial_scale=8, growth_interval=2), [OK, BAD, OK, OK], [8, 4, 4, 8]),
        (dict(initial_scale=64, backoff_factor=0.25), [BAD, BAD], [16, 4]),
        # hysteresis: 2 overflows (consecutive or not) before backing off ...
        (dict(initial_scale=8, hysteresis=2), [BAD, BAD, BAD, OK], [8, 4, 2, 2]),
        (dict(initial_scale=8, hysteresis=2), [BAD, OK, BAD], [8, 8, 4]),
        # ... and the tracker is reset when the scale grows (Megatron-LM)
        (
            dict(initial_scale=8, growth_interval=2, hysteresis=2),
            [BAD, OK, OK, BAD, BAD],
            [8, 8, 16, 16, 8],
        ),
        # clamping
        (dict(initial_scale=4, min_scale=2), [BAD, BAD, BAD], [2, 2, 2]),
        (dict(initial_scale=1, min_scale=0.25), [BAD] * 4, [0.5, 0.25, 0.25, 0.25]),
        (dict(initial_scale=8, max_scale=16, growth_interval=1), [OK] * 3, [16, 16, 16]),
        (dict(initial_scale=12, max_scale=16, growth_interval=1), [OK] * 2, [16, 16]),
        # fixed scale: never changes
        (dict(initial_scale=128, dynamic=False, growth_interval=1), [BAD, OK, OK, BAD], [128] * 4),
        (dict(loss_scale=8), [BAD, OK, BAD], [8, 8, 8]),
    ],
)
def test_scale_sequence(kwargs, pattern, expected):
    kwargs.setdefault("on_min_scale", "ignore")
    _, scales = _run(pattern, **kwargs)
    assert scales == expected


def test_counters_follow_pattern():
    opt, _ = _run([OK, BAD, BAD, OK, BAD], initial_scale=8, growth_interval=100)
    assert int(opt.overflow_steps.numpy()) == 3
    assert int(opt.consecutive_overflows.numpy()) == 1
    assert int(opt.iterations.numpy()) == 2  # only applied steps advance iterations
    assert int(opt.last_overflow_iteration.numpy()) == 2
    assert float(opt.snapshot()["overflow"]) == 1.0  # derived: consecutive_overflows > 0
    assert int(opt.good_steps.numpy()) == 0
    _step(opt, opt._trainable_variables[0], OK)
    assert int(opt.consecutive_overflows.numpy()) == 0
    assert float(opt.snapshot()["overflow"]) == 0.0
    assert int(opt.good_steps.numpy()) == 1


def test_state_exists_before_build():
    # The state is created with the optimizer, so a step traced before the first `apply`
    # (e.g. `get_unscaled_gradients` in a tf.function) reads the variable, not a constant.
    opt = LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=256, hysteresis=3)
    assert not opt.built
    assert float(opt.loss_scale) == 256.0
    assert int(opt.overflow_steps) == 0
    assert int(opt.last_overflow_iteration) == -1
    assert int(opt.hysteresis_tracker) == 3
    assert isinstance(opt.loss_scale, keras.Variable)


def test_state_properties_are_variables_not_numpy():
    opt, _ = _run([OK], initial_scale=8)
    for name in [
        "loss_scale",
        "overflow_steps",
        "consecutive_overflows",
        "last_overflow_iteration",
        "hysteresis_tracker",
        "good_steps",
    ]:
        value = getattr(opt, name)
        assert isinstance(value, keras.Variable), name
        with pytest.raises(AttributeError):
            setattr(opt, name, 1)


def test_is_a_keras_loss_scale_optimizer():
    opt = LossScaleOptimizer(keras.optimizers.Adam())
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
    assert isinstance(opt, keras.optimizers.Optimizer)


def test_defaults():
    opt = LossScaleOptimizer(keras.optimizers.SGD())
    assert opt.initial_scale == 2.0**15
    assert opt.growth_interval == 2000
    assert opt.dynamic_growth_steps == 2000
    assert (opt.growth_factor, opt.backoff_factor) == (2.0, 0.5)
    assert (opt.min_scale, opt.max_scale) == (1.0, 2.0**24)
    assert opt.hysteresis == 1 and opt.dynamic is True and opt.on_min_scale == "warn"


def test_keras_and_tf2_argument_names():
    opt = LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=4, dynamic_growth_steps=7)
    assert opt.growth_interval == 7
    opt = LossScaleOptimizer(keras.optimizers.SGD(), loss_scale="dynamic")
    assert opt.dynamic is True and opt.initial_scale == 2.0**15
    opt = LossScaleOptimizer(keras.optimizers.SGD(), loss_scale=128)
    assert opt.dynamic is False and opt.initial_scale == 128.0
    opt = LossScaleOptimizer("adam")
    assert isinstance(opt.inner_optimizer, keras.optimizers.Adam)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (
            dict(initial_scale=0.0),
            ValueError,
            r"initial_scale must be .*Received: initial_scale=0.0",
        ),
        (dict(initial_scale=-1.0), ValueError, r"initial_scale=-1.0"),
        (dict(initial_scale=float("inf")), ValueError, r"initial_scale=inf"),
        (dict(initial_scale=float("nan")), ValueError, r"initial_scale=nan"),
        (dict(initial_scale="big"), ValueError, r"initial_scale='big'"),
        (dict(growth_factor=1.0), ValueError, r"growth_factor must be .* > 1.*growth_factor=1.0"),
        (dict(growth_factor=0.5), ValueError, r"growth_factor=0.5"),
        (dict(backoff_factor=1.0), ValueError, r"backoff_factor must be in \(0, 1\).*=1.0"),
        (dict(backoff_factor=0.0), ValueError, r"backoff_factor=0.0"),
        (dict(backoff_factor=-0.5), ValueError, r"backoff_factor=-0.5"),
        (dict(growth_interval=0), ValueError, r"growth_interval must be an integer >= 1.*=0"),
        (dict(growth_interval=2.5), ValueError, r"growth_interval=2.5"),
        (dict(dynamic_growth_steps=0), ValueError, r"growth_interval=0"),
        (dict(growth_interval=3, dynamic_growth_steps=4), ValueError, r"disagree"),
        (dict(hysteresis=0), ValueError, r"hysteresis must be an integer >= 1.*hysteresis=0"),
        (dict(min_scale=0.0), ValueError, r"min_scale must be .*min_scale=0.0"),
        (
            dict(min_scale=4.0, max_scale=2.0, initial_scale=3.0),
            ValueError,
            r"min_scale must be <= max_scale.*min_scale=4.0, max_scale=2.0",
        ),
        (
            dict(initial_scale=0.5),
            ValueError,
            r"initial_scale must be within \[min_scale, max_scale\].*initial_scale=0.5",
        ),
        (dict(initial_scale=2.0**30), ValueError, r"initial_scale=1073741824.0"),
        (
            dict(on_min_scale="explode"),
            ValueError,
            r"on_min_scale must be one of \['warn', 'raise', 'ignore'\].*'explode'",
        ),
        (dict(loss_scale="static"), ValueError, r'loss_scale must be "dynamic" or a number'),
        (dict(loss_scale=8, initial_scale=8), ValueError, r"either the TensorFlow 2 argument"),
        (dict(dynamic="yes"), TypeError, r"dynamic must be True or False.*'yes'"),
        (dict(clipnorm=1.0), ValueError, r"does not support `clipnorm`.*inner_optimizer"),
    ],
)
def test_bad_knobs(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        LossScaleOptimizer(keras.optimizers.SGD(), **kwargs)


def test_bad_inner_optimizers():
    with pytest.raises(TypeError, match=r"Keras 3 optimizer.*Received: inner_optimizer=42"):
        LossScaleOptimizer(42)
    with pytest.raises(TypeError, match=r"tf-keras / Keras 2 / TF1 optimizer.*GradientDescent"):
        LossScaleOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with pytest.raises(ValueError, match=r"'not_an_optimizer'"):
        LossScaleOptimizer("not_an_optimizer")
    for wrapped in [
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
        LossScaleOptimizer(keras.optimizers.SGD()),
    ]:
        with pytest.raises(TypeError, match="already a LossScaleOptimizer"):
            LossScaleOptimizer(wrapped)


def test_bad_input_changes_nothing():
    inner = keras.optimizers.SGD(loss_scale_factor=4.0)
    with pytest.raises(ValueError):
        LossScaleOptimizer(inner, growth_factor=0.5)
    assert inner.loss_scale_factor == 4.0  # not disabled by a half-done construction


# ------------------------------------------------------------------ skipped steps
def _adam_state(opt, model):
    return [v.numpy().copy() for v in model.weights] + [
        v.numpy().copy() for v in opt.inner_optimizer.variables
    ]


def _assert_bit_identical(before, after):
    assert len(before) == len(after)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
        assert a.tobytes() == b.tobytes()


def _tiny_model(width=8):
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(2)]
    )
    return model


def _data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_skipped_step_is_bit_identical(mode):
    keras.utils.set_random_seed(1)
    model = _tiny_model()
    opt = LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=2.0**10)
    model.compile(
        optimizer=opt,
        loss="mse",
        run_eagerly=mode == "eager",
        jit_compile=mode == "jit",
    )
    opt.build(model.trainable_variables)  # before fit: the step traced once
    x, y = _data()
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)  # slots are non-zero now
    before = _adam_state(opt, model)
    x_bad = x.copy()
    x_bad[3, 1] = np.inf
    model.fit(x_bad, y, batch_size=32, epochs=1, verbose=0)
    _assert_bit_identical(before, _adam_state(opt, model))
    assert int(opt.iterations.numpy()) == 2
    assert float(opt.loss_scale.numpy()) == 2.0**9
    assert int(opt.overflow_steps.numpy()) == 1
    assert int(opt.last_overflow_iteration.numpy()) == 2
    # The next clean batch is applied.
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert int(opt.iterations.numpy()) == 3
    assert float(opt.snapshot()["overflow"]) == 0.0
    assert not np.array_equal(before[0], model.weights[0].numpy())


def test_fit_matches_unscaled_reference():
    """Loss scaling by a power of two changes nothing in float32: same weights as plain SGD."""
    x, y = _data()
    results = []
    for wrap in (False, True):
        keras.utils.set_random_seed(3)
        model = _tiny_model()
        inner = keras.optimizers.SGD(0.05, momentum=0.9)
        opt = LossScaleOptimizer(inner, initial_scale=2.0**12, growth_interval=3) if wrap else inner
        model.compile(optimizer=opt, loss="mse", auto_scale_loss=False)
        opt.build(model.trainable_variables)  # before fit: the step traced once
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        results.append([w.numpy() for w in model.weights])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_compile_mixed_float16_keeps_our_optimizer():
    keras.config.set_dtype_policy("mixed_float16")
    model = _tiny_model()
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=64)
    model.compile(optimizer=opt, loss="mse")
    assert model.optimizer is opt
    x, y = _data(8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.weights[0].dtype == "float32"
    assert int(opt.iterations.numpy()) == 1


# --------------------------------------------------------------- custom loops
def _grads_loop(convention, steps=3, scale=2.0**8, seed=5):
    """Trains a tiny model with one of the loop conventions; returns the final weights."""
    keras.utils.set_random_seed(seed)
    model = _tiny_model()
    model.build((None, 4))
    if convention == "reference":
        opt = keras.optimizers.SGD(0.1)
    else:
        opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=scale)
    x, y = _data(16)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            if convention == "tf_guide":
                scaled = opt.get_scaled_loss(loss)
            elif convention == "keras":
                scaled = opt.scale_loss(loss)
            else:
                scaled = loss
        grads = tape.gradient(scaled, model.trainable_variables)
        if convention == "tf_guide":
            grads = opt.get_unscaled_gradients(grads)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for _ in range(steps):
        step(x, y)
    return [w.numpy() for w in model.weights]


@pytest.mark.parametrize("convention", ["tf_guide", "keras"])
def test_custom_loop_conventions_match_reference(convention):
    reference = _grads_loop("reference")
    for a, b in zip(reference, _grads_loop(convention)):
        np.testing.assert_array_equal(a, b)  # no double (or missing) unscale


def test_unscaled_flag_is_consumed_by_one_apply():
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=4)
    var = keras.Variable(np.zeros(2, "float32"))
    grads = opt.get_unscaled_gradients([tf.constant([4.0, 8.0])])
    np.testing.assert_array_equal(grads[0].numpy(), [1.0, 2.0])
    opt.apply_gradients(zip(grads, [var]))
    np.testing.assert_array_equal(var.numpy(), [-1.0, -2.0])
    opt.apply_gradients([(tf.constant([4.0, 8.0]), var)])  # scaled: unscaled inside
    np.testing.assert_array_equal(var.numpy(), [-2.0, -4.0])


def test_get_unscaled_gradients_none_and_indexed_slices():
    opt = LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=4)
    sparse = tf.IndexedSlices(tf.constant([[4.0, 8.0]]), tf.constant([1]), tf.constant([3, 2]))
    dense16 = tf.constant([2.0, 6.0], tf.float16)
    out = opt.get_unscaled_gradients([None, sparse, dense16])
    assert out[0] is None
    assert isinstance(out[1], tf.IndexedSlices)
    np.testing.assert_array_equal(out[1].values.numpy(), [[1.0, 2.0]])
    np.testing.assert_array_equal(out[1].indices.numpy(), [1])
    assert out[2].dtype == tf.float16
    np.testing.assert_array_equal(out[2].numpy(), [0.5, 1.5])
    assert float(opt.get_scaled_loss(tf.constant(3.0)).numpy()) == 12.0
    assert float(opt.get_scaled_loss(lambda: tf.constant(3.0))().numpy()) == 12.0
    scaled16 = opt.get_scaled_loss(tf.constant(2.0, tf.float16))
    assert scaled16.dtype == tf.float32  # scaling in float16 could overflow


def test_embedding_indexed_slices_overflow_is_skipped():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(10, 4),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )
    opt = LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=8)
    x = np.array([[1, 2, 3]], "int32")

    def run(y_value):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y_value) ** 2)
            scaled = opt.get_scaled_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        assert isinstance(grads[0], tf.IndexedSlices)
        opt.apply_gradients(zip(opt.get_unscaled_gradients(grads), model.trainable_variables))

    run(1.0)
    before = _adam_state(opt, model)
    run(np.inf)
    _assert_bit_identical(before, _adam_state(opt, model))
    assert float(opt.loss_scale.numpy()) == 4.0


# ----------------------------------------------------------------- on_min_scale
def _overflow_at_min(on_min_scale, steps=3):
    opt = LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=2, min_scale=1, on_min_scale=on_min_scale
    )
    var = keras.Variable(np.ones(2, "float32"))
    _step(opt, var, OK)
    for _ in range(steps):
        _step(opt, var, BAD)
    return opt


def test_on_min_scale_warns_once():
    with pytest.warns(RuntimeWarning, match=r"not finite at step 2 .*min_scale=1.0") as record:
        _overflow_at_min("warn", steps=4)
    assert len([w for w in record if "min_scale" in str(w.message)]) == 1


def test_on_min_scale_raise_names_step():
    with pytest.raises(FloatingPointError, match=r"not finite at step 2 .*min_scale=1.0"):
        _overflow_at_min("raise")


def test_on_min_scale_ignore():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = _overflow_at_min("ignore")
    assert int(opt.overflow_steps.numpy()) == 3


def test_on_min_scale_reported_at_end_of_fit():
    model = _tiny_model()
    opt = LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=1, min_scale=1, on_min_scale="raise"
    )
    model.compile(optimizer=opt, loss="mse")
    x, y = _data(16)
    x[0, 0] = np.nan
    with pytest.raises(FloatingPointError, match="step 0"):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert int(opt.overflow_steps.numpy()) == 2


# --------------------------------------------------------------- serialization
FULL = dict(
    initial_scale=512.0,
    growth_interval=17,
    growth_factor=4.0,
    backoff_factor=0.25,
    min_scale=0.125,
    max_scale=2.0**20,
    hysteresis=3,
    dynamic=True,
    on_min_scale="raise",
)


def test_config_round_trip():
    opt = LossScaleOptimizer(keras.optimizers.Adam(0.003, beta_1=0.8), name="lso", **FULL)
    config = opt.get_config()
    restored = LossScaleOptimizer.from_config(config)
    assert restored.get_config() == config
    for key, value in FULL.items():
        assert config["dynamic_growth_steps" if key == "growth_interval" else key] == value
    assert restored.inner_optimizer.beta_1 == 0.8
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again) is LossScaleOptimizer and again.get_config() == config


def test_from_keras_lso_config():
    keras_config = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=64, dynamic_growth_steps=10
    ).get_config()
    opt = LossScaleOptimizer.from_config(keras_config)
    assert (opt.initial_scale, opt.growth_interval) == (64, 10)


def _trained_with_state(tmp_x=None):
    keras.utils.set_random_seed(2)
    model = _tiny_model()
    opt = LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        initial_scale=64,
        growth_interval=2,
        hysteresis=2,
        on_min_scale="ignore",
    )
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)  # before fit: the step traced once
    x, y = _data(8)
    x_bad = x.copy()
    x_bad[0, 0] = np.inf
    for xs in (x, x, x_bad, x):
        model.fit(xs, y, batch_size=8, epochs=1, verbose=0)
    return model, opt


@pytest.fixture(scope="module")
def trained_with_state():
    """`_trained_with_state()`, once: the two round trips below read it, neither changes it."""
    return _trained_with_state()


STATE = [
    "loss_scale",
    "good_steps",
    "overflow_steps",
    "consecutive_overflows",
    "last_overflow_iteration",
]


def _state(opt):
    values = {name: float(getattr(opt, name).numpy()) for name in STATE}
    values["hysteresis_tracker"] = int(opt.hysteresis_tracker.numpy())
    values["iterations"] = int(opt.iterations.numpy())
    return values


def test_keras_file_round_trip(tmp_path, trained_with_state):
    model, opt = trained_with_state
    expected = _state(opt)
    assert expected == {
        "loss_scale": 128.0,
        "good_steps": 1.0,
        "overflow_steps": 1.0,
        "consecutive_overflows": 0.0,
        "last_overflow_iteration": 2.0,
        "hysteresis_tracker": 1,
        "iterations": 3,
    }
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is LossScaleOptimizer
    assert loaded.optimizer.get_config() == opt.get_config()
    assert _state(loaded.optimizer) == expected
    _assert_bit_identical(
        [v.numpy() for v in opt.variables], [v.numpy() for v in loaded.optimizer.variables]
    )


def test_tf_checkpoint_round_trip(tmp_path, trained_with_state):
    model, opt = trained_with_state
    expected = _state(opt)
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    fresh = _tiny_model()
    fresh_opt = LossScaleOptimizer(
        keras.optimizers.Adam(0.01), initial_scale=64, growth_interval=2, hysteresis=2
    )
    fresh_opt.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh, optimizer=fresh_opt).restore(path).assert_consumed()
    assert _state(fresh_opt) == expected
    _assert_bit_identical([w.numpy() for w in model.weights], [w.numpy() for w in fresh.weights])


# ----------------------------------------------------------------- distribution
def test_mirrored_one_replica_overflow_skips_both(two_cpu_strategy):
    strategy = two_cpu_strategy
    with strategy.scope():
        keras.utils.set_random_seed(4)
        model = _tiny_model()
        opt = LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=8)
        model.compile(optimizer=opt, loss="mse")
    x, y = _data(16)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    before = _adam_state(opt, model)
    x_bad = x.copy()
    x_bad[12, 0] = np.inf  # second half of the global batch: replica 1 only
    model.fit(x_bad, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    _assert_bit_identical(before, _adam_state(opt, model))
    for var in model.weights + [opt.dynamic_scale, opt.overflow_steps]:
        copies = [t.numpy() for t in var.value.values]
        assert len(copies) == 2
        _assert_bit_identical(copies[:1], copies[1:])
    assert float(opt.loss_scale.numpy()) == 4.0
    assert int(opt.overflow_steps.numpy()) == 1
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert int(opt.iterations.numpy()) == 2


@pytest.mark.parametrize(
    "values, finite",
    [
        ([1.0, -2.0, 0.0], True),
        ([np.nan, 1.0], False),
        ([np.inf, 1.0], False),
        ([-np.inf, 1.0], False),
        ([np.inf, -np.inf], False),  # Inf - Inf is NaN: still caught
        ([3e38, 3e38], False),  # documented: a sum past float32's range reads as overflow
    ],
)
def test_finite_check(values, finite):
    opt = LossScaleOptimizer(keras.optimizers.SGD())
    grads = [None, tf.constant(values, tf.float32), tf.constant([1.0], tf.bfloat16)]
    assert bool(opt.check_finite(grads)) is finite


# ----------------------------------------------------------------- from Keras's optimizer
def test_from_keras_unbuilt_takes_the_settings_and_the_inner_optimizer():
    inner = keras.optimizers.Adam(0.01)
    keras_lso = keras.optimizers.LossScaleOptimizer(
        inner, initial_scale=64, dynamic_growth_steps=9, name="lso"
    )
    opt = LossScaleOptimizer.from_keras(keras_lso, hysteresis=2)
    assert opt.inner_optimizer is inner and opt.name == "lso" and not opt.built
    assert (opt.initial_scale, opt.growth_interval, opt.hysteresis) == (64.0, 9, 2)
    assert (opt.min_scale, opt.max_scale, opt.dynamic) == (1.0, 2.0**24, True)


def test_from_keras_built_carries_the_state_over():
    model = _tiny_model()
    keras_lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=2)
    variables = model.trainable_variables
    grads = [tf.ones_like(v) for v in variables]
    keras_lso.apply(grads, variables)
    for _ in range(2):
        keras_lso.apply([g * np.inf for g in grads], variables)  # 2 -> 1 -> 0.5
    slots = [id(v) for v in keras_lso.inner_optimizer.variables]
    opt = LossScaleOptimizer.from_keras(keras_lso)
    assert opt.built and [id(v) for v in opt.inner_optimizer.variables] == slots
    assert opt.min_scale == 0.5  # widened to hold Keras's unbounded scale
    state = opt.read_state()
    assert (state["loss_scale"], state["good_steps"], state["iterations"]) == (0.5, 0, 1)
    before = [v.numpy() for v in variables]
    opt.apply(grads, variables)  # the same slots go on: Adam's second step
    assert int(opt.iterations.numpy()) == 2
    assert not np.array_equal(before[0], variables[0].numpy())


def test_from_keras_rejects_other_optimizers():
    with pytest.raises(TypeError, match=r"converts Keras's own.*keras.src.optimizers.sgd.SGD"):
        LossScaleOptimizer.from_keras(keras.optimizers.SGD())
    with pytest.raises(TypeError, match=r"of type tfmixprec.scaling.optimizer.LossScaleOptimizer"):
        LossScaleOptimizer.from_keras(LossScaleOptimizer("sgd"))


# ----------------------------------------------------------------- the guard's counters
def _at_min_scale_three_times():
    model = _tiny_model()
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0, on_min_scale="ignore")
    variables = model.trainable_variables
    bad = [tf.fill(v.shape, np.inf) for v in variables]
    for _ in range(4):  # scale 2 -> 1, then three overflows at min_scale 1
        opt.apply(bad, variables)
    return model, opt


def test_guard_counters_count_exactly():
    _, opt = _at_min_scale_three_times()
    state = opt.read_state()
    assert (state["min_scale_overflows"], state["longest_overflow_run"]) == (3, 4)
    opt.reset_longest_overflow_run()
    assert opt.read_state()["longest_overflow_run"] == 0


def test_a_file_from_0_2_0_loads():
    # 0.2.0 saved the optimizer without min_scale_overflows and longest_overflow_run.
    _, opt = _at_min_scale_three_times()
    added = {id(opt.min_scale_overflows), id(opt.longest_overflow_run)}
    old_store = {}
    for i, variable in enumerate(v for v in opt.variables if id(v) not in added):
        old_store[str(i)] = variable.numpy()
    fresh_model, fresh = _at_min_scale_three_times()
    fresh.min_scale_overflows.assign(7)
    fresh.load_own_variables(old_store)
    expected = {**opt.read_state(), "min_scale_overflows": 7, "longest_overflow_run": 4}
    assert fresh.read_state() == expected  # what the file has came back; the rest as it was
    assert fresh.last_overflow_scale.numpy() == 1.0


def test_guard_counters_round_trip_through_a_checkpoint(tmp_path):
    model, opt = _at_min_scale_three_times()
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    fresh = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0)
    fresh.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=fresh).restore(path).assert_consumed()
    assert fresh.read_state() == opt.read_state()
    assert fresh.read_state()["min_scale_overflows"] == 3
