"""The ops of `fit`'s traced step (`tfmixprec.testing.step_ops`) against Keras's own step:
tfmixprec's at most `BUDGET_ONE_CALLBACK` times Keras's with no callback or `LossScaleMonitor`,
and `BUDGET_EVERY_CALLBACK` times with every callback and `PrecisionRepair` armed, for
`MixedPrecisionModel`, a `keras.Model` compiled with tfmixprec's optimizer, and a `keras.Model`
compiled with Keras's that a tfmixprec callback adopts (benchmarks/step_ops.py holds the
cases; benchmarks/RESULTS.md, the table)."""

import importlib.util
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec.precision.cpu_route import route_of
from tfmixprec.tools.testing import step_ops

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_ops.py"
_spec = importlib.util.spec_from_file_location("step_ops_cases", SCRIPT)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


@pytest.fixture(scope="module")
def keras_step():
    """Keras's own step: a keras.Model with keras.optimizers.LossScaleOptimizer, plain fit."""
    return step_ops(cases.fit_model("keras"))


def _over(found: dict, base: dict) -> str:
    return ", ".join(
        f"{op} {found.get(op, 0)} (Keras {base.get(op, 0)})"
        for op in sorted(set(found) | set(base))
        if found.get(op, 0) > base.get(op, 0)
    )


CASES = [
    ("MixedPrecisionModel", "none"),
    ("MixedPrecisionModel", "monitor"),
    ("MixedPrecisionModel", "every"),
    ("optimizer", "none"),
    ("optimizer", "monitor"),
    ("optimizer", "every"),
    ("adopted", "monitor"),
    ("adopted", "every"),
]
_FITTED: dict = {}  # case -> (the fitted model, its step's ops)


def _fitted(case):
    if case not in _FITTED:
        model = cases.fit_model(*case)
        _FITTED[case] = model, step_ops(model)
    return _FITTED[case]


def _counted(case):
    return _fitted(case)[1]


def _budget(callbacks):
    return cases.BUDGET_EVERY_CALLBACK if callbacks == "every" else cases.BUDGET_ONE_CALLBACK


def _check(found, base, case, limit):
    total, keras_total = sum(found.values()), sum(base.values())
    assert total <= limit * keras_total, (
        f"{case[0]} with callbacks={case[1]}: {total} ops, {total / keras_total:.3f}x Keras's "
        f"{keras_total} (at most {limit}x); over Keras's: {_over(found, base)}"
    )


@pytest.mark.parametrize("case", CASES)
def test_the_step_costs_no_more_than_its_limit_of_kerass_ops(keras_step, case):
    found = _counted(case)
    assert found["If"] <= keras_step["If"]  # apply or skip; the keeper's one branch on shapes
    _check(found, keras_step, case, _budget(case[1]))


def test_the_counted_steps_take_no_cpu_route_and_leave_the_switch_as_it_was():
    """On a CPU without AVX512_FP16 a callback would route the float16 `Dense` through a
    float32 product (5 ops a GPU's step never has): the counts must not depend on the CPU."""
    before = tfmixprec.cpu_float16.status()
    model, _ = _fitted(("MixedPrecisionModel", "every"))
    routed = [layer.name for layer in model.layers if route_of(layer) is not None]
    assert routed == []
    assert tfmixprec.cpu_float16.status() == before


def test_step_ops_counts_every_function_the_step_calls():
    """A `cond` added to the step adds its op, and its branches' ops, once each."""

    def build(extra):
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        if extra:
            model.train_step = lambda data: {
                **keras.Model.train_step(model, data),
                "flag": tf.cond(tf.constant(True), lambda: tf.constant(1.0) * 2.0, lambda: 0.0),
            }
        model.compile("sgd", "mse", jit_compile=False)
        model.fit(np.zeros((8, 4), "float32"), np.zeros((8, 1), "float32"), verbose=0)
        return step_ops(model)

    plain, with_cond = build(False), build(True)
    assert plain.get("If", 0) + plain.get("StatelessIf", 0) == 0
    assert with_cond["StatelessIf"] == 1
    assert with_cond["Mul"] == plain["Mul"] + 1  # the true branch's product
    assert list(with_cond) == sorted(with_cond)
    assert tfmixprec.testing.step_ops is step_ops


def test_step_ops_needs_a_traced_step():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)], name="fresh")
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="model 'fresh' has no traced train function: .*step_ops"):
        step_ops(model)
