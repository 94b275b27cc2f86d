"""Tests of `tfmixprec.loss_scale`: the config, the transition, and the unscaling contract.

The contract table (README, "The unscaling contract"): every way a user loop hands gradients
to the optimizer gives the true update, eager, in one or two `tf.function`s, under XLA, across
threads and under 2 replicas; the one ambiguous misuse raises and changes nothing.
"""

import contextlib
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec.scaling.loss_scale import LossScale, LossScaleConfig

TRUE = np.array([1.0, 2.0], "float32")  # the true gradient of every step below
LR = 0.1
SCALE = 1024.0


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(initial_scale=1e39), r"initial_scale must be a number in float32's normal range"),
        (dict(initial_scale=0.0), "initial_scale=0.0"),
        (dict(initial_scale=float("nan")), "initial_scale=nan"),
        (dict(max_scale=1e300), r"max_scale.*Received: max_scale=1e\+300"),
        (dict(min_scale=1e-50), r"min_scale.*Received: min_scale=1e-50"),
        (dict(initial_scale=1e39, dynamic=False), "initial_scale=1e"),
        (dict(growth_interval=0), r"growth_interval must be an integer >= 1"),
        (dict(growth_interval=2.5), r"growth_interval=2.5"),
        (dict(hysteresis=True), r"hysteresis=True"),
        (dict(growth_factor=1.0), r"growth_factor must be a finite number > 1"),
        (dict(growth_factor=float("inf")), r"growth_factor=inf"),
        (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
        (dict(min_scale=4.0, max_scale=2.0, initial_scale=2.0), "min_scale must be <= max_scale"),
    ],
)
def test_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaleConfig(**kwargs)


def test_config_dynamic_must_be_bool():
    with pytest.raises(TypeError, match="dynamic must be True or False. Received: dynamic=1"):
        LossScaleConfig(dynamic=1)


@pytest.mark.parametrize("scale", [2.0**25, 0.5, 2.0**-100, 2.0**120])
def test_fixed_scale_ignores_bounds(scale):
    # Bounds only limit a dynamic scale: a fixed one outside [min_scale, max_scale] is fine.
    assert LossScaleConfig(initial_scale=scale, dynamic=False).initial_scale == scale
    opt = tfmixprec.LossScaleOptimizer("sgd", loss_scale=scale)
    assert float(opt.loss_scale.numpy()) == scale and opt.dynamic is False
    assert opt.dynamic_growth_steps is None  # as TF 2's fixed scale


def test_config_accepts_integral_floats_and_is_frozen():
    config = LossScaleConfig(growth_interval=2.0, hysteresis=3.0)
    assert (config.growth_interval, config.hysteresis) == (2, 3)
    assert isinstance(config.growth_interval, int)
    with pytest.raises(AttributeError):
        config.initial_scale = 4.0


def test_optimizer_accepts_integral_float_growth_steps():
    opt = tfmixprec.LossScaleOptimizer("sgd", dynamic_growth_steps=2.0)
    assert opt.growth_interval == 2 and opt.get_config()["dynamic_growth_steps"] == 2


# --------------------------------------------------------------------------- the unit
def _unit(**kwargs):
    def add_variable(name, dtype, value):
        return keras.Variable(value, dtype=dtype, name=name, trainable=False)

    return LossScale(LossScaleConfig(**kwargs), add_variable)


@pytest.mark.parametrize("compiled", [False, True])
def test_adjust_sequence_with_tensor_flag(compiled):
    unit = _unit(initial_scale=8.0, growth_interval=2, hysteresis=2, min_scale=1.0)

    def adjust(finite, iteration):
        unit.adjust(finite, iteration)

    adjust = tf.function(adjust) if compiled else adjust
    scales, iteration = [], 0
    for finite in [True, True, False, False, False, False, True]:
        adjust(tf.constant(finite), tf.constant(iteration, tf.int64))
        iteration += finite
        scales.append(float(unit.scale_variable.numpy()))
    assert scales == [8.0, 16.0, 16.0, 8.0, 4.0, 2.0, 2.0]
    snap = {k: float(v.numpy()) for k, v in unit.snapshot(tf.constant(iteration)).items()}
    assert snap == {
        "loss_scale": 2.0,
        "overflow": 0.0,
        "overflow_steps": 4.0,
        "skipped_fraction": pytest.approx(4.0 / 7.0, rel=1e-6),
        "step": 7.0,  # steps attempted (skipped ones counted): the next one's number
        "last_overflow_step": 5.0,  # steps 2 to 5 overflowed
    }
    assert int(unit.last_overflow_iteration.numpy()) == 2


def test_scale_and_unscale_dtypes():
    unit = _unit(initial_scale=4.0)
    assert unit.scale(tf.constant(2.0, tf.float16)).dtype == tf.float32
    assert float(unit.scale(tf.constant(2.0, tf.bfloat16))) == 8.0
    grad64 = tf.constant([4.0 * (1.0 + 2.0**-40)], tf.float64)
    (out,) = unit.unscale([grad64])
    # float64 gradients are unscaled in float64: the 2^-40 survives.
    assert out.dtype == tf.float64 and out.numpy()[0] == 1.0 + 2.0**-40
    sparse = tf.IndexedSlices(tf.constant([[8.0]], tf.float16), tf.constant([1]), [3, 1])
    none, kept, unscaled = unit.unscale([None, tf.constant([8.0]), sparse], keep=[False, True, 0])
    assert none is None and kept.numpy()[0] == 8.0
    assert isinstance(unscaled, tf.IndexedSlices) and unscaled.values.dtype == tf.float16
    assert float(unscaled.values[0, 0]) == 2.0


# --------------------------------------------------------------------------- contract
def _setup(strategy=None, n_vars=1, growth_interval=1):
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        opt = tfmixprec.LossScaleOptimizer(
            keras.optimizers.SGD(LR), initial_scale=SCALE, growth_interval=growth_interval
        )
        variables = [keras.Variable(np.zeros(2, "float32")) for _ in range(n_vars)]
        opt.build(variables)
    return opt, variables


def _reference(steps, n_replicas=1):
    """Plain SGD with the true gradient (summed over replicas, as Keras's TF optimizer does)."""
    var = keras.Variable(np.zeros(2, "float32"))
    sgd = keras.optimizers.SGD(LR)
    for _ in range(steps):
        sgd.apply([tf.constant(TRUE * n_replicas)], [var])
    return var.numpy()


def _scaled_grads(opt, variables):
    """Gradients of `opt.scale_loss(loss)`, where d loss / d v = TRUE for every variable."""
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(v * TRUE) for v in variables])
        scaled = opt.scale_loss(loss)
    return tape.gradient(scaled, variables)


def _unscaled_grads(opt, variables):
    """TF 2's way: `get_scaled_loss`, then `get_unscaled_gradients`."""
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(v * TRUE) for v in variables])
        scaled = opt.get_scaled_loss(loss)
    return opt.get_unscaled_gradients(tape.gradient(scaled, variables))


def _compute_unscaled(opt, variables):
    """tfmixprec's helper: the scale as the backward seed."""
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(v * TRUE) for v in variables])
    grads, _ = tfmixprec.compute_unscaled_gradients(tape, loss, variables, opt)
    return grads


def _in_thread(fn):
    def run(*args):
        out = {}

        def target():
            try:
                out["value"] = fn(*args)
            except Exception as err:  # re-raised in the calling thread
                out["error"] = err

        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    return run


MODES = {
    "eager": lambda fn: fn,
    "function": tf.function,
    "jit": lambda fn: tf.function(fn, jit_compile=True),
    "thread": _in_thread,
}


def _assert_true_update(variables, steps, n_replicas=1):
    for var in variables:
        np.testing.assert_array_equal(var.numpy(), _reference(steps, n_replicas))


@pytest.mark.parametrize("apply_mode", ["eager", "function", "jit", "thread"])
@pytest.mark.parametrize("compute_mode", ["eager", "function", "jit", "thread"])
@pytest.mark.parametrize("compute", [_unscaled_grads, _compute_unscaled, _scaled_grads])
def test_gradients_and_apply_in_any_two_places(compute, compute_mode, apply_mode):
    """Rows 1-4: unscaled (or scaled) in one place, applied in another; the scale doubles
    every step (growth_interval=1), so a constant baked into a trace would show."""
    opt, variables = _setup()
    compute_fn = MODES[compute_mode](lambda: compute(opt, variables))
    apply_fn = MODES[apply_mode](lambda grads: opt.apply_gradients(zip(grads, variables)))
    for _ in range(3):
        apply_fn(compute_fn())
    _assert_true_update(variables, 3)
    assert float(opt.loss_scale.numpy()) == SCALE * 8


@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_whole_step_in_one_place(mode):
    opt, variables = _setup()

    def step():
        opt.apply_gradients(zip(_unscaled_grads(opt, variables), variables))
        opt.apply_gradients(zip(_scaled_grads(opt, variables), variables))

    step = MODES[mode](step)
    for _ in range(2):
        step()
    _assert_true_update(variables, 4)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_one_unscale_two_applies_on_halves(mode):
    """Row 7: one `get_unscaled_gradients`, then two `apply_gradients` on the two halves."""
    opt, variables = _setup(n_vars=2)

    def step():
        grads = _unscaled_grads(opt, variables)
        opt.apply_gradients([(grads[0], variables[0])])
        opt.apply_gradients([(grads[1], variables[1])])

    step = MODES[mode](step)
    for _ in range(2):
        step()
    _assert_true_update(variables, 2)


def test_clipping_between_unscale_and_apply_is_not_a_misuse():
    opt, variables = _setup()
    reference = keras.Variable(np.zeros(2, "float32"))
    sgd = keras.optimizers.SGD(LR)

    @tf.function
    def step():
        grads = _unscaled_grads(opt, variables)
        clipped, _ = tf.clip_by_global_norm(grads, 1.0)
        opt.apply_gradients(zip(clipped, variables))

    for _ in range(2):
        step()
        clipped, _ = tf.clip_by_global_norm([tf.constant(TRUE)], 1.0)
        sgd.apply(clipped, [reference])
    np.testing.assert_array_equal(variables[0].numpy(), reference.numpy())


def test_accumulation_loop_unscales_per_micro_batch_applies_once():
    opt, variables = _setup()
    micro_batch = tf.function(lambda: _unscaled_grads(opt, variables))
    for _ in range(2):
        total = [tf.zeros(2)]
        for _ in range(4):
            total = [t + g for t, g in zip(total, micro_batch())]
        opt.apply_gradients(zip([t / 4.0 for t in total], variables))  # eagerly
    _assert_true_update(variables, 2)


def test_keras_style_after_tf2_style_without_scale_loss():
    """A step that scales by hand after a TF 2 step: the earlier `get_unscaled_gradients`
    ended with the apply that covered every variable, so these are unscaled here."""
    opt, variables = _setup()
    opt.apply_gradients(zip(_unscaled_grads(opt, variables), variables))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(variables[0] * TRUE) * opt.loss_scale
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    _assert_true_update(variables, 2)


def _misuse_step(opt, variables):
    """Row 6: Keras 3 style (scaled gradients to apply) plus one unscale only to log a norm."""
    grads = _scaled_grads(opt, variables)
    norm = tf.linalg.global_norm(opt.get_unscaled_gradients(grads))
    opt.apply_gradients(zip(grads, variables))
    return norm


def _snapshot(opt, variables):
    return [v.numpy().copy() for v in variables + opt.variables]


@pytest.mark.parametrize("mode", ["eager", "function", "thread"])
def test_unscale_to_log_then_apply_scaled_raises(mode):
    opt, variables = _setup()
    opt.apply_gradients(zip(_scaled_grads(opt, variables), variables))  # one good step first
    before = _snapshot(opt, variables)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"received the scaled gradients"):
        MODES[mode](lambda: _misuse_step(opt, variables))()
    for a, b in zip(before, _snapshot(opt, variables)):
        np.testing.assert_array_equal(a, b)  # nothing applied, scale and counters unchanged


def test_unscale_to_log_then_apply_scaled_under_xla_applies_true_update():
    # XLA drops run-time assertions; the gradients are then divided: the true update.
    opt, variables = _setup()
    step = tf.function(lambda: _misuse_step(opt, variables), jit_compile=True)
    norm = step()
    np.testing.assert_allclose(float(norm), np.linalg.norm(TRUE), rtol=1e-6)
    _assert_true_update(variables, 1)


def test_float8_gradients_are_not_unscaled_by_get_unscaled_gradients():
    opt = tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(LR), initial_scale=SCALE)
    float8_scale, plain = keras.Variable(np.ones(2, "float32")), keras.Variable(np.zeros(2))
    float8_scale.overwrite_with_gradient = True
    grads = [tf.constant([3.0, 4.0]), tf.constant([SCALE, SCALE])]
    opt.build([float8_scale, plain])
    for variables in ([float8_scale, plain], None):  # named, then the optimizer's own
        kept, unscaled = opt.get_unscaled_gradients(grads, variables)
        np.testing.assert_array_equal(kept.numpy(), [3.0, 4.0])
        np.testing.assert_array_equal(unscaled.numpy(), [1.0, 1.0])
        opt.apply([kept, unscaled], [float8_scale, plain])
        np.testing.assert_array_equal(float8_scale.numpy(), [3.0, 4.0])  # overwritten
    with pytest.raises(ValueError, match=r"received 1 gradients but the optimizer trains 2"):
        opt.get_unscaled_gradients(grads[:1])


def test_float8_blind_unscale_before_build_raises():
    # Before the optimizer is built it cannot know which gradients belong to float8 variables.
    opt = tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(LR), initial_scale=SCALE)
    float8_scale, plain = keras.Variable(np.ones(2, "float32")), keras.Variable(np.zeros(2))
    float8_scale.overwrite_with_gradient = True
    grads = opt.get_unscaled_gradients([tf.constant([3.0, 4.0]), tf.constant([SCALE, SCALE])])
    with pytest.raises(tf.errors.InvalidArgumentError, match="before the optimizer was built"):
        opt.apply(grads, [float8_scale, plain])
    np.testing.assert_array_equal(float8_scale.numpy(), [1.0, 1.0])


# --------------------------------------------------------------------------- 2 replicas
def _mirrored_patterns(strategy, opt, variables):
    compute = tf.function(lambda: _unscaled_grads(opt, variables))
    apply = tf.function(lambda grads: opt.apply_gradients(zip(grads, variables)))
    return {
        "keras_style": lambda: strategy.run(
            tf.function(lambda: opt.apply_gradients(zip(_scaled_grads(opt, variables), variables)))
        ),
        "tf2_one_run": tf.function(
            lambda: strategy.run(
                lambda: opt.apply_gradients(zip(_unscaled_grads(opt, variables), variables))
            )
        ),
        "tf2_two_runs": lambda: strategy.run(apply, args=(strategy.run(compute),)),
        "helper_two_runs": lambda: strategy.run(
            apply, args=(strategy.run(tf.function(lambda: _compute_unscaled(opt, variables))),)
        ),
    }


@pytest.mark.parametrize(
    "pattern", ["keras_style", "tf2_one_run", "tf2_two_runs", "helper_two_runs"]
)
def test_two_replicas(two_cpu_strategy, pattern):
    """Row 5 and its neighbours under a real 2-replica MirroredStrategy."""
    opt, variables = _setup(two_cpu_strategy)
    run = _mirrored_patterns(two_cpu_strategy, opt, variables)[pattern]
    for _ in range(3):
        run()
    _assert_true_update(variables, 3, n_replicas=2)
    assert float(opt.loss_scale.numpy()) == SCALE * 8


def test_two_replicas_misuse_raises(two_cpu_strategy):
    opt, variables = _setup(two_cpu_strategy)
    before = _snapshot(opt, variables)
    step = tf.function(lambda: _misuse_step(opt, variables))
    with pytest.raises(tf.errors.InvalidArgumentError, match="received the scaled gradients"):
        two_cpu_strategy.run(step)
    for a, b in zip(before, _snapshot(opt, variables)):
        np.testing.assert_array_equal(a, b)


def test_failed_misuse_in_a_function_keeps_the_record():
    # The graph raised before `apply` consumed anything: retrying with the unscaled gradients
    # gives the true update (the record was not cleared by the failed call).
    opt, variables = _setup()
    grads = {}

    @tf.function
    def misuse():
        scaled = _scaled_grads(opt, variables)
        grads["unscaled"] = opt.get_unscaled_gradients(scaled)
        opt.apply_gradients(zip(scaled, variables))
        return grads["unscaled"]

    with pytest.raises(tf.errors.InvalidArgumentError, match="received the scaled gradients"):
        misuse()
    with tf.GradientTape() as tape:
        scaled = opt.scale_loss(tf.reduce_sum(variables[0] * TRUE))
    unscaled = opt.get_unscaled_gradients(tape.gradient(scaled, variables))
    opt.apply_gradients(zip(unscaled, variables))
    _assert_true_update(variables, 1)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_unscaling_twice_raises(mode):
    opt, variables = _setup()

    def twice():
        grads = opt.get_unscaled_gradients(_scaled_grads(opt, variables))
        return opt.get_unscaled_gradients(grads)

    with pytest.raises(tf.errors.InvalidArgumentError, match="already unscaled"):
        MODES[mode](twice)()


def test_one_optimizer_two_models_mixed_styles():
    """G through `compute_unscaled_gradients` (its variables named), D Keras-style with the
    scaled gradients, from one tape: each gets its true update. (The scale must not grow
    between the two applies, which are two optimizer steps: D's loss was scaled before.)"""
    opt, (g_var, d_var) = _setup(n_vars=2, growth_interval=100)

    @tf.function
    def step():
        with tf.GradientTape(persistent=True) as tape:
            g_loss = tf.reduce_sum(g_var * TRUE)
            d_scaled = opt.scale_loss(tf.reduce_sum(d_var * TRUE))
        g_grads, _ = tfmixprec.compute_unscaled_gradients(tape, g_loss, [g_var], opt)
        opt.apply(g_grads, [g_var])
        opt.apply(tape.gradient(d_scaled, [d_var]), [d_var])

    for _ in range(2):
        step()
    _assert_true_update([g_var, d_var], 2)


def test_accumulation_refuses_an_apply_on_part_of_the_variables():
    opt = tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(LR), accumulation_steps=2)
    a, b = keras.Variable([0.0]), keras.Variable([0.0])
    opt.build([a, b])
    with pytest.raises(ValueError, match=r"must cover all 2 variables.*for 1 of them"):
        opt.apply([tf.constant([1.0])], [a])
    assert int(opt._accumulator.micro_step.numpy()) == 0


def test_accumulation_sums_float64_in_float64():
    opt = tfmixprec.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=1.0, dynamic=False, accumulation_steps=2
    )
    var = keras.Variable(np.zeros(1), dtype="float64")
    tiny = 1.0 + 2.0**-40  # lost in float32
    for _ in range(2):
        opt.apply([tf.constant([tiny], tf.float64)], [var])
    assert var.numpy()[0] == -tiny


def test_optimizer_outside_the_strategy_scope_refuses_tf2_unscaling(two_cpu_strategy):
    opt = tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(LR), initial_scale=SCALE)
    with two_cpu_strategy.scope():
        var = keras.Variable(np.zeros(2, "float32"))
    opt.build([var])
    compute = tf.function(lambda: _unscaled_grads(opt, [var]))
    with pytest.raises(ValueError, match=r"needs an optimizer created inside strategy.scope"):
        two_cpu_strategy.run(compute)


def test_keras_checkpoint_restores_into_tfmixprec(tmp_path):
    # A tf.train.Checkpoint of Keras's own LossScaleOptimizer restores its step counter and
    # scale into tfmixprec's (same order, same names); tfmixprec's extra state starts fresh.
    var = keras.Variable(np.zeros(2, "float32"))
    keras_opt = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(LR), initial_scale=64.0, dynamic_growth_steps=3
    )
    keras_opt.build([var])
    keras_opt.step_counter.assign(2)
    keras_opt.dynamic_scale.assign(256.0)
    path = tf.train.Checkpoint(optimizer=keras_opt).save(str(tmp_path / "ckpt"))
    opt = tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(LR), initial_scale=64.0)
    opt.build([var])
    tf.train.Checkpoint(optimizer=opt).restore(path).expect_partial()
    assert (float(opt.loss_scale.numpy()), int(opt.good_steps.numpy())) == (256.0, 2)
    assert int(opt.overflow_steps.numpy()) == 0


# --------------------------------------------------------------- the traced shortcut
# A graph that clears the record (`scale_loss`) and applies, with nothing in between that could
# record, divides with no branch on the record (tests/fit/test_host_waits.py). These are the orders
# in which a trace cannot know that nothing recorded: each must unscale exactly once.


def test_a_reused_nested_function_that_records_is_seen():
    """The step is traced again (another batch size); the nested function that unscales is
    not: its `record` runs but is not traced in the new trace."""
    opt, variables = _setup(growth_interval=1000)
    unscale = tf.function(lambda grads: opt.get_unscaled_gradients(grads))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(tf.reduce_sum(variables[0] * TRUE * tf.reduce_mean(x)))
        opt.apply(unscale(tape.gradient(scaled, variables)), variables)

    step(tf.ones([4, 2]))
    step(tf.ones([3, 2]))  # a retrace of `step`, reusing `unscale`
    _assert_true_update(variables, 2)


def test_a_reused_function_that_applies_is_not_bound_to_its_first_trace():
    opt, variables = _setup(growth_interval=1000)
    apply = tf.function(lambda grads: opt.apply(grads, variables))
    tf.function(lambda: apply(_scaled_grads(opt, variables)))()  # traced after a scale_loss
    tf.function(lambda: apply(_unscaled_grads(opt, variables)))()  # reused after an unscale
    apply(_unscaled_grads(opt, variables))  # and eagerly
    _assert_true_update(variables, 3)


def test_a_loop_that_applies_before_it_unscales():
    """A pipelined loop: the body applies the previous iteration's gradients, then computes
    and unscales the next; the first ones, from before the loop, are scaled."""
    opt, variables = _setup(growth_interval=1000)

    @tf.function
    def train(n):
        grads = _scaled_grads(opt, variables)
        for _ in tf.range(n):
            opt.apply(grads, variables)
            grads = opt.get_unscaled_gradients(_scaled_grads(opt, variables))

    train(tf.constant(3))
    _assert_true_update(variables, 3)


def test_a_record_in_another_replica_call_with_other_threads_alive(two_cpu_strategy):
    """Scale, unscale and apply in three `strategy.run` calls (three sets of replica threads,
    whose ids the system may reuse), another thread alive meanwhile."""
    opt, variables = _setup(two_cpu_strategy, growth_interval=1000)

    @tf.function
    def step():
        grads = two_cpu_strategy.run(lambda: _scaled_grads(opt, variables))
        stop = threading.Event()
        other = threading.Thread(target=stop.wait)
        other.start()
        try:
            grads = two_cpu_strategy.run(opt.get_unscaled_gradients, args=(grads,))
        finally:
            stop.set()
            other.join()
        two_cpu_strategy.run(lambda g: opt.apply(g, variables), args=(grads,))

    step()
    _assert_true_update(variables, 1, n_replicas=2)
