"""Table tests of the loss-scale transition, `next_state`, on plain tensors: no optimizer, no
variables. Each row starts from a state, runs one step (finite or not) and lists the fields
that must change, with their values; every other field must be the state's own object (the
contract `LossScale.adjust` relies on to assign only what changed)."""

import numpy as np
import pytest
import tensorflow as tf

from tfmixprec.scaling.loss_scale import (
    STATE_FIELDS,
    LossScale,
    LossScaleConfig,
    LossScaleState,
    initial_state,
    next_state,
)

DYNAMIC = LossScaleConfig(initial_scale=8.0, growth_interval=3, min_scale=1.0, max_scale=32.0)
FIXED = LossScaleConfig(initial_scale=8.0, dynamic=False)
HYSTERESIS = LossScaleConfig(initial_scale=8.0, growth_interval=3, hysteresis=2)


def _state(config, num_variables=None, **fields):
    state = initial_state(config, num_variables)
    converted = {
        name: tf.constant(value, getattr(state, name).dtype) for name, value in fields.items()
    }
    return state._replace(**converted)


def _changed(before, after):
    """{field: value} of the fields `after` holds new objects for (the rest must be `is`)."""
    return {
        name: np.asarray(new).tolist()
        for name, old, new in zip(STATE_FIELDS, before, after)
        if new is not old
    }


# (config, starting fields, finite, iteration, nonfinite flags, the fields that change)
ROWS = {
    "a clean step counts": (
        DYNAMIC,
        {},
        True,
        0,
        None,
        {
            "consecutive_overflows": 0,
            "good_steps": 1,
            "scale": 8.0,
            "min_scale_overflows": 0,
            "hysteresis_tracker": 1,
        },
    ),
    "growth after growth_interval clean steps": (
        DYNAMIC,
        {"good_steps": 2, "min_scale_overflows": 3, "hysteresis_tracker": 0},
        True,
        2,
        None,
        {
            "consecutive_overflows": 0,
            "good_steps": 0,
            "scale": 16.0,
            "min_scale_overflows": 0,
            "hysteresis_tracker": 1,
        },
    ),
    "growth stops at max_scale": (
        DYNAMIC,
        {"scale": 24.0, "good_steps": 2},
        True,
        2,
        None,
        {
            "consecutive_overflows": 0,
            "good_steps": 0,
            "scale": 32.0,
            "min_scale_overflows": 0,
            "hysteresis_tracker": 1,
        },
    ),
    "an overflow backs off and is counted": (
        DYNAMIC,
        {"good_steps": 2, "overflow_steps": 4, "longest_overflow_run": 2},
        False,
        10,
        None,
        {
            "scale": 4.0,
            "last_overflow_scale": 8.0,
            "overflow_steps": 5,
            "consecutive_overflows": 1,
            "longest_overflow_run": 2,
            "last_overflow_iteration": 10,
            "good_steps": 0,
            "min_scale_overflow_iteration": -1,
            "min_scale_overflows": 0,
            "hysteresis_tracker": 0,
        },
    ),
    "backoff stops at min_scale, where the overflow is counted (on_min_scale)": (
        DYNAMIC,
        {"scale": 1.0, "overflow_steps": 2, "consecutive_overflows": 2},
        False,
        7,
        None,
        {
            "scale": 1.0,
            "last_overflow_scale": 1.0,
            "overflow_steps": 3,
            "consecutive_overflows": 3,
            "longest_overflow_run": 3,
            "last_overflow_iteration": 7,
            "good_steps": 0,
            "min_scale_overflow_iteration": 9,  # the step's number: 7 applied + 2 skipped
            "min_scale_overflows": 1,
            "hysteresis_tracker": 0,
        },
    ),
    "only the first overflow at min_scale is the one on_min_scale reports": (
        DYNAMIC,
        {"scale": 1.0, "min_scale_overflow_iteration": 4, "min_scale_overflows": 1},
        False,
        7,
        None,
        {
            "scale": 1.0,
            "last_overflow_scale": 1.0,
            "overflow_steps": 1,
            "consecutive_overflows": 1,
            "longest_overflow_run": 1,
            "last_overflow_iteration": 7,
            "good_steps": 0,
            "min_scale_overflow_iteration": 4,
            "min_scale_overflows": 2,
            "hysteresis_tracker": 0,
        },
    ),
    "hysteresis: the first of two overflows does not back off": (
        HYSTERESIS,
        {},
        False,
        0,
        None,
        {
            "scale": 8.0,
            "last_overflow_scale": 8.0,
            "overflow_steps": 1,
            "consecutive_overflows": 1,
            "longest_overflow_run": 1,
            "last_overflow_iteration": 0,
            "good_steps": 0,
            "min_scale_overflow_iteration": -1,
            "min_scale_overflows": 0,
            "hysteresis_tracker": 1,
        },
    ),
    "hysteresis: the second one does": (
        HYSTERESIS,
        {"hysteresis_tracker": 1, "overflow_steps": 1, "consecutive_overflows": 1},
        False,
        0,
        None,
        {
            "scale": 4.0,
            "last_overflow_scale": 8.0,
            "overflow_steps": 2,
            "consecutive_overflows": 2,
            "longest_overflow_run": 2,
            "last_overflow_iteration": 0,
            "good_steps": 0,
            "min_scale_overflow_iteration": -1,
            "min_scale_overflows": 0,
            "hysteresis_tracker": 0,
        },
    ),
    "a fixed scale counts a clean step and nothing else": (
        FIXED,
        {"consecutive_overflows": 3},
        True,
        5,
        None,
        {"consecutive_overflows": 0, "good_steps": 1},
    ),
    "a fixed scale counts an overflow and never moves": (
        FIXED,
        {"scale": 1.0},
        False,
        5,
        None,
        {
            "last_overflow_scale": 1.0,
            "overflow_steps": 1,
            "consecutive_overflows": 1,
            "longest_overflow_run": 1,
            "last_overflow_iteration": 5,
            "good_steps": 0,
        },
    ),
}


@pytest.mark.parametrize("row", list(ROWS), ids=list(ROWS))
@pytest.mark.parametrize("mode", ["eager", "tf.function"])
def test_next_state_table(row, mode):
    config, fields, finite, iteration, nonfinite, expected = ROWS[row]
    before = _state(config, **fields)

    def step(state):
        return next_state(config, state, finite, tf.constant(iteration, tf.int64), nonfinite)

    if mode == "eager":
        after = step(before)
        assert _changed(before, after) == expected
    else:  # in a graph the unchanged fields come back as the same values
        after = tf.function(step)(before)
        values = {name: np.asarray(v).tolist() for name, v in zip(STATE_FIELDS, after)}
        for name, value in zip(STATE_FIELDS, before):
            assert values[name] == expected.get(name, np.asarray(value).tolist()), name


def test_overflow_attribution_per_variable():
    before = _state(DYNAMIC, num_variables=3, overflow_steps=2)
    before = before._replace(
        nonfinite_steps=tf.constant([1, 0, 4], tf.int64),
        last_nonfinite_step=tf.constant([0, -1, 1], tf.int64),
    )
    flags = tf.constant([0, 1, 1], tf.int64)
    after = next_state(DYNAMIC, before, False, tf.constant(6, tf.int64), flags)
    assert after.nonfinite_steps.numpy().tolist() == [1, 1, 5]
    assert after.last_nonfinite_step.numpy().tolist() == [0, 8, 8]  # step 6 + 2 skipped
    clean = next_state(DYNAMIC, after, True, tf.constant(6, tf.int64))
    assert clean.nonfinite_steps is after.nonfinite_steps
    assert clean.last_nonfinite_step is after.last_nonfinite_step


def test_a_whole_run_gives_the_exact_scale_sequence():
    """Grow every 3 clean steps, back off on each overflow, bounded by [1, 32]."""
    state, iteration, scales = _state(DYNAMIC), 0, []
    for finite in [True] * 9 + [False] * 7 + [True] * 3:
        state = next_state(DYNAMIC, state, finite, tf.constant(iteration, tf.int64))
        iteration += int(finite)
        scales.append(float(state.scale))
    assert scales == [8, 8, 16, 16, 16, 32, 32, 32, 32, 16, 8, 4, 2, 1, 1, 1, 1, 1, 2]
    assert int(state.overflow_steps) == 7 and int(state.longest_overflow_run) == 7
    assert int(state.min_scale_overflow_iteration) == 14  # 9 applied + 5 skipped before it
    assert int(state.min_scale_overflows) == 0  # reset by the growth at the last step


def test_next_state_refuses_a_tensor_flag():
    with pytest.raises(TypeError, match=r"finite as a Python bool.*finite=<tf.Tensor"):
        next_state(DYNAMIC, _state(DYNAMIC), tf.constant(True), tf.constant(0, tf.int64))


def test_the_state_is_the_variables_of_loss_scale():
    """`LossScale` holds one variable a field, and starts where `initial_state` says."""
    made = {}

    def add_variable(name, dtype, value, shape=()):
        made[name] = tf.Variable(
            tf.fill(shape, tf.constant(value, tf.as_dtype("int64" if dtype == "int" else dtype))),
            name=name,
        )
        return made[name]

    unit = LossScale(HYSTERESIS, add_variable)
    unit.build(2)
    now = unit.state_now()
    assert isinstance(now, LossScaleState)
    assert set(unit.variables_by_name()) == set(STATE_FIELDS)
    start = initial_state(HYSTERESIS, 2)
    for name, value, expected in zip(STATE_FIELDS, now, start):
        assert value.dtype == expected.dtype, name
        assert np.asarray(value).tolist() == np.asarray(expected).tolist(), name
    unit.adjust(True, tf.constant(0, tf.int64))
    assert int(unit.good_steps.numpy()) == 1
