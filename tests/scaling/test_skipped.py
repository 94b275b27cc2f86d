"""`LossScaleOptimizer.skipped()`: whether the step that just ran was skipped, the same value
eagerly, in the `tf.function` that ran `apply` (the check's own flag, no read of the state),
in another `tf.function` (a read), across threads, under 2 replicas and with XLA; and the
state a step's branch reads (`loss_scale.reads`)."""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmixprec import LossScaleOptimizer
from tfmixprec.scaling.loss_scale import LossScaleConfig, initial_state, next_state, reads

PATTERN = [False, True, True, False]  # the steps' gradients: finite, or with an Inf


def _optimizer(count=1):
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=8.0)
    variables = [keras.Variable(np.ones(3, "float32")) for _ in range(count)]
    opt.build(variables)
    return (opt, *variables)


def _bad(bad):
    """A gradient with an Inf where the bool tensor `bad` is set, else ones."""
    return tf.where(bad, tf.constant([np.inf, 1.0, 1.0]), tf.ones(3))


def _grad(opt, overflow):
    scale = tf.cast(opt.loss_scale, tf.float32)
    return tf.where(tf.constant(overflow), tf.constant([np.inf, 1.0, 1.0]), scale * tf.ones(3))


def test_eagerly_it_reads_the_state():
    opt, var = _optimizer()
    seen = []
    for overflow in PATTERN:
        opt.apply([_grad(opt, overflow)], [var])
        seen.append(bool(opt.skipped()))
    assert seen == PATTERN


@pytest.mark.parametrize("jit_compile", [False, True])
def test_in_the_function_that_applied_it_is_the_checks_flag(jit_compile):
    opt, var = _optimizer()

    @tf.function(jit_compile=jit_compile)
    def step(overflow):
        opt.apply([_bad(overflow)], [var])
        first = opt.skipped()
        return first, opt.skipped() is first  # asked again (the guard, then the keeper)

    seen = [step(tf.constant(overflow)) for overflow in PATTERN]
    assert [bool(flag) for flag, _ in seen] == PATTERN
    assert all(again for _, again in seen)  # one negation of the flag, made once
    # the state is read inside the branches (to count), not for the flag
    graph = step.get_concrete_function(tf.TensorSpec([], tf.bool)).graph
    assert _reads(graph, opt.consecutive_overflows) == 0
    assert [op.type for op in graph.get_operations()].count("LogicalNot") == 1


def _reads(graph, variable):
    """The ReadVariableOps of `variable` in `graph` itself (not in its branches)."""
    inner = [t for outer, t in graph.captures if outer is variable.value.handle]
    return sum(
        op.type == "ReadVariableOp" and any(op.inputs[0] is t for t in inner)
        for op in graph.get_operations()
    )


def test_in_another_function_it_reads_the_state():
    opt, var = _optimizer()
    apply = tf.function(lambda g: opt.apply([g], [var]))
    skipped = tf.function(opt.skipped)
    seen = []
    for overflow in PATTERN:
        apply(_grad(opt, overflow))
        seen.append(bool(skipped()))
    assert seen == PATTERN
    assert _reads(skipped.get_concrete_function().graph, opt.consecutive_overflows) == 1


def test_threads_tracing_at_once_each_get_their_own_flag():
    """Two threads trace a function each at the same time, one step overflowing and one not:
    each flag is its own step's (a flag is kept per graph and thread)."""
    shared, var_a, var_b = _optimizer(2)
    barrier, seen = threading.Barrier(2), {}

    def run(index, overflow):
        var = [var_a, var_b][index]

        @tf.function
        def step():
            barrier.wait(timeout=30)  # both traces in flight at once
            grad = tf.constant([np.inf, 1.0, 1.0]) if overflow else tf.ones(3)
            shared.apply([grad], [var])
            return shared.skipped()

        seen[index] = bool(step())

    threads = [threading.Thread(target=run, args=(i, i == 1)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert seen == {0: False, 1: True}


def test_under_two_replicas(two_cpu_strategy):
    with two_cpu_strategy.scope():
        opt, var = _optimizer()

    @tf.function
    def step(overflow):
        def replica():
            index = tf.distribute.get_replica_context().replica_id_in_sync_group
            bad = tf.logical_and(overflow, tf.equal(index, 1))  # one replica's Inf skips both
            opt.apply([_bad(bad)], [var])
            return tf.cast(opt.skipped(), tf.int32)

        return two_cpu_strategy.run(replica)

    for overflow in PATTERN:
        flags = two_cpu_strategy.experimental_local_results(step(tf.constant(overflow)))
        assert [int(f) for f in flags] == [int(overflow)] * 2


def test_a_branch_reads_only_the_state_it_uses():
    """With a hysteresis of 1 every overflow backs off: the tracker is not read (it becomes
    0); with a larger hysteresis it is."""
    assert "hysteresis_tracker" not in reads(LossScaleConfig(), False)
    assert "hysteresis_tracker" in reads(LossScaleConfig(hysteresis=2), False)
    assert "hysteresis_tracker" in reads(LossScaleConfig(), True)  # a growth resets it
    state = initial_state(LossScaleConfig(initial_scale=8.0), 3)
    state = state._replace(hysteresis_tracker=tf.constant(1, tf.int64))
    after = next_state(LossScaleConfig(initial_scale=8.0), state, False, tf.constant(4, tf.int64))
    assert (float(after.scale), int(after.hysteresis_tracker)) == (4.0, 0)


@pytest.mark.parametrize("dtype", [tf.bool, tf.int64, tf.int32])
def test_the_flags_of_an_overflow_may_be_bools_or_counts(dtype):
    config = LossScaleConfig(initial_scale=8.0)
    state = initial_state(config, 3)._replace(overflow_steps=tf.constant(2, tf.int64))
    flags = tf.cast(tf.constant([False, True, True]), dtype)
    after = next_state(config, state, False, tf.constant(6, tf.int64), flags)
    assert after.nonfinite_steps.numpy().tolist() == [0, 1, 1]
    assert after.last_nonfinite_step.numpy().tolist() == [-1, 8, 8]


def _state_says(opt):
    return int(opt.consecutive_overflows.numpy()) > 0


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("first, second", [(False, True), (True, False)])
def test_skipped_after_a_second_apply_in_a_users_cond(jit_compile, first, second):
    """A step applies once, then once more inside a user's `tf.cond` (e.g. an extra update
    every n steps): the step that just ran is the cond's, not the first apply's."""
    opt, var = _optimizer()

    @tf.function(jit_compile=jit_compile)
    def step(first_bad, second_bad):
        opt.apply([_bad(first_bad)], [var])

        def again():
            opt.apply([_bad(second_bad)], [var])
            return tf.constant(0)

        tf.cond(tf.constant(True), again, lambda: tf.constant(0))
        return opt.skipped()

    skipped = bool(step(tf.constant(first), tf.constant(second)))
    assert _state_says(opt) == second
    assert skipped == second, f"skipped() says {skipped}, the last step's state says {second}"


@pytest.mark.parametrize("first, second", [(False, True), (True, False)])
def test_skipped_after_a_second_apply_in_a_nested_function(first, second):
    """The second apply runs in a `tf.function` the step calls (a helper the user
    decorated): `skipped()` in the step says the second's, not the first apply's."""
    opt, var = _optimizer()
    apply_again = tf.function(lambda grad: opt.apply([grad], [var]))

    @tf.function
    def step(first_bad, second_bad):
        opt.apply([_bad(first_bad)], [var])
        apply_again(_bad(second_bad))
        return opt.skipped()

    skipped = bool(step(tf.constant(first), tf.constant(second)))
    assert _state_says(opt) == second
    assert skipped == second, f"skipped() says {skipped}, the last step's state says {second}"


def test_skipped_after_a_check_step_that_applies_nothing():
    """`check_step` is public (the finite check with per-variable evidence): a step that
    applies clean gradients, then checks other gradients for a diagnostic without applying
    them, ran an applied step: `skipped()` is not the diagnostic check's flag."""
    opt, var = _optimizer()

    @tf.function
    def step():
        opt.apply([tf.ones(3)], [var])
        opt.check_step([tf.constant([np.inf, 1.0, 1.0])], [var])  # look only
        return opt.skipped()

    skipped = bool(step())
    assert not _state_says(opt)
    assert not skipped


@pytest.mark.parametrize("first, second", [(False, True), (True, False)])
def test_skipped_after_more_applies_in_an_autograph_loop(first, second):
    """A warm-up apply, then a `tf.range` loop of applies (inner steps): the loop body is a
    graph of its own: `skipped()` after the loop is the loop's last step's, not the
    warm-up's."""
    opt, var = _optimizer()

    @tf.function
    def step(first_bad, second_bad):
        opt.apply([_bad(first_bad)], [var])
        for _ in tf.range(2):
            opt.apply([_bad(second_bad)], [var])
        return opt.skipped()

    skipped = bool(step(tf.constant(first), tf.constant(second)))
    assert _state_says(opt) == second
    assert skipped == second, f"skipped() says {skipped}, the last step's state says {second}"
