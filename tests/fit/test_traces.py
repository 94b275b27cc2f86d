"""One trace per `fit`: tfmixprec's models, callbacks and batch keepers trace the train
function once in a model's first `fit`, and a later `fit` with the same callbacks runs that
trace again (a new trace runs its first steps slower: benchmarks/RESULTS.md, section 1)."""

import functools
import importlib.util
import tempfile
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec  # noqa: F401 (the cases build with it)
from tfmixprec._keras.fit import traced_train_functions

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_waits.py"
_spec = importlib.util.spec_from_file_location("host_waits_cases", SCRIPT)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


class _Traces(keras.callbacks.Callback):
    """At the end of each `fit`: the train function it ran, and how often it was traced."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def on_train_end(self, logs=None):
        function = self.model.train_function
        self.seen.append((function, len(traced_train_functions(self.model))))


def _traces_per_fit(case, jit_compile, fits=3):
    """The traces each of `fits` calls of `fit` added (one epoch each, same callbacks)."""
    _, build, with_callbacks = cases.CASES[case]
    model = build(jit_compile)
    seen = []
    with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # adoption and min-scale lines: said elsewhere
        extra = cases.every_callback(log_dir) if with_callbacks else []
        for _ in range(fits):
            model.fit(cases.X, cases.Y, batch_size=32, verbose=0, callbacks=[*extra, _Traces(seen)])
    added, last = [], (None, 0)
    for function, count in seen:
        added.append(count - (last[1] if function is last[0] else 0))
        last = (function, count)
    return added


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("case", ["keras", "adopted", "MixedPrecisionModel", "float8"])
def test_one_trace_in_the_first_fit_and_none_after(case, jit_compile):
    assert _traces_per_fit(case, jit_compile) == [1, 0, 0]


def test_the_count_sees_a_new_trace():
    """A `fit` on batches of another size traces the same train function again."""
    _, build, _ = cases.CASES["MixedPrecisionModel"]
    model, seen = build(False), []
    for batch_size in (32, 16, 16):
        model.fit(cases.X, cases.Y, batch_size=batch_size, verbose=0, callbacks=[_Traces(seen)])
    assert [count for _, count in seen] == [1, 2, 2]
    assert seen[0][0] is seen[2][0]


def _python_traces(model, **fit_args):
    """How often `fit` ran the Python of `model`'s train step (once a trace)."""
    calls, step = [], model.train_step
    model.train_step = lambda data: calls.append(1) or step(data)
    try:
        model.fit(cases.X, cases.Y, batch_size=32, verbose=0, **fit_args)
    finally:
        del model.train_step
    return len(calls)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_mixed_precision_models_first_fit_traces_its_step_once(jit_compile):
    """Keras makes the optimizer's variables in the step's first trace, and TensorFlow, seeing
    variables made, traces it again; `MixedPrecisionModel.fit` makes them first (the model is
    built): one trace, the same variables, and the same weights after the fit as when they
    are made in the trace (a plain fit of the same model's weights, bit for bit)."""
    _, build, _ = cases.CASES["MixedPrecisionModel"]
    model = build(jit_compile)
    assert not model.optimizer.built
    assert _python_traces(model) == 1 and model.optimizer.built
    twice = build(jit_compile)
    twice.fit = functools.partial(keras.Model.fit, twice)  # Keras's own: none made first
    assert _python_traces(twice) == 2
    names = [[v.name for v in m.optimizer.variables] for m in (model, twice)]
    assert names[0] == names[1] and len(names[0]) > 12  # the slots too, in the same order
    for ours, theirs in zip(model.weights, twice.weights):
        assert ours.numpy().tobytes() == theirs.numpy().tobytes()


def _first_fit_traces(kind, callbacks, policy="mixed_float16"):
    """How often the first `fit` of a `kind` model traced its forward pass (a layer whose
    Python counts its calls), with `callbacks`."""
    calls = []
    with tfmixprec.policy_scope(policy):
        inputs = keras.Input((16,))
        hidden = keras.layers.Lambda(lambda t: calls.append(1) or t)(keras.layers.Dense(4)(inputs))
        outputs = keras.layers.Dense(1, dtype="float32")(hidden)
        cls = tfmixprec.MixedPrecisionModel if kind == "MixedPrecisionModel" else keras.Model
        model = cls(inputs, outputs)
    optimizer = {
        "MixedPrecisionModel": "adam",
        "plain keras.Model": "adam",
        "keras.Model": tfmixprec.LossScaleOptimizer(keras.optimizers.Adam()),
        "adopted": keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
    }[kind]
    model.compile(optimizer, "mse")
    before = len(calls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # adoption's line: said elsewhere
        model.fit(cases.X, cases.Y, batch_size=32, verbose=0, callbacks=callbacks())
    return len(calls) - before


@pytest.mark.parametrize(
    "kind, callbacks, policy, traces",
    [
        ("MixedPrecisionModel", list, "mixed_float16", 1),
        ("MixedPrecisionModel", list, "mixed_bfloat16", 1),  # a plain Adam: no scaling
        ("keras.Model", lambda: [tfmixprec.LossScaleMonitor()], "mixed_float16", 1),
        ("adopted", lambda: [tfmixprec.OverflowGuard()], "mixed_float16", 1),
        ("plain keras.Model", lambda: [tfmixprec.LossScaleMonitor()], "mixed_bfloat16", 1),
        ("plain keras.Model", lambda: [tfmixprec.OverflowGuard()], "mixed_float16", 1),
        # Keras's own fit, with nothing of tfmixprec's in it
        ("keras.Model", list, "mixed_float16", 2),
        ("plain keras.Model", list, "mixed_bfloat16", 2),
    ],
)
def test_a_first_fit_with_tfmixprec_traces_once(kind, callbacks, policy, traces):
    """`MixedPrecisionModel.fit` and the callbacks' `on_train_begin` make the optimizer's
    variables before the first trace: tfmixprec's, the adopted one's, and a plain one's."""
    assert _first_fit_traces(kind, callbacks, policy) == traces


@pytest.mark.parametrize(
    "case, jit_compile, keep",
    [
        ("MixedPrecisionModel", False, "callbacks"),
        ("adopted", True, "callbacks"),
        ("adopted, 2 replicas", False, "callbacks"),
        ("MixedPrecisionModel", True, "keep_overflow_batches"),
    ],
)
def test_a_first_fit_that_keeps_batches_traces_its_step_once(
    case, jit_compile, keep, two_cpu_strategy
):
    """`diagnose=`, `PrecisionRepair` and `keep_overflow_batches` keep overflow batches in
    variables that the step writes. They are made before the first trace
    (`OverflowBatches.make_slots_now`), not in it, where TensorFlow would trace the step again:
    one trace (the Python of a replica's step runs once a replica)."""
    if not cases._STRATEGIES:
        cases._STRATEGIES.append(two_cpu_strategy)  # one strategy on these devices a process
    _, build, _ = cases.CASES[case]
    model = build(jit_compile)
    replicas = model.distribute_strategy.num_replicas_in_sync
    with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # adoption and min-scale lines: said elsewhere
        if keep == "callbacks":
            callbacks = cases.every_callback(log_dir)
        else:
            model.keep_overflow_batches(2)
            callbacks = []
        assert _python_traces(model, callbacks=callbacks) == replicas


@pytest.mark.parametrize("jit_compile", [False, True])
def test_make_train_steps_step_is_traced_once(jit_compile):
    """`make_train_step` makes the optimizer's variables before its step's first trace (a
    built model): one trace, where Keras would make them in it and TensorFlow trace again."""
    calls = []
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((16,))
        hidden = keras.layers.Lambda(lambda t: calls.append(1) or t)(keras.layers.Dense(4)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(hidden))
    step = tfmixprec.make_train_step(model, "mse", "adam", jit_compile=jit_compile)
    assert step.optimizer.built
    before = len(calls)  # the model's construction ran it too
    for start in (0, 32):
        step(cases.X[start : start + 32], cases.Y[start : start + 32])
    assert len(calls) - before == 1


class _TrainingOnly(keras.Model):
    """A subclassed model whose `extra` layer runs in training only: a call in inference
    builds the model and leaves `extra` unbuilt, to make its variables in the step."""

    def __init__(self, cls_name):
        super().__init__(name=cls_name)
        self.body, self.extra, self.head = (keras.layers.Dense(n) for n in (4, 4, 1))

    def call(self, x, training=False):
        x = self.body(x)
        return self.head(self.extra(x) if training else x)


class _MixedTrainingOnly(_TrainingOnly, tfmixprec.MixedPrecisionModel):
    pass


@pytest.mark.parametrize("how", ["LossScaleMonitor", "MixedPrecisionModel", "make_train_step"])
def test_a_layer_built_in_the_step_is_left_to_the_trace(how):
    """The optimizer is built before the first trace only where every layer is built: else
    the layer that the step builds would hold variables the optimizer does not know (Keras's
    own `fit` builds the optimizer in the trace, and trains it)."""
    x, y = cases.X[:32], cases.Y[:32]
    keras.utils.set_random_seed(0)
    reference = _TrainingOnly("keras")
    reference(x[:2])
    reference.compile(keras.optimizers.SGD(0.1), "mse")
    reference.fit(x, y, batch_size=32, verbose=0)
    keras.utils.set_random_seed(0)
    model = (_MixedTrainingOnly if how == "MixedPrecisionModel" else _TrainingOnly)(how)
    model(x[:2])
    assert model.built and not model.extra.built
    optimizer = tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    if how == "make_train_step":
        step = tfmixprec.make_train_step(model, "mse", optimizer)
        assert not step.optimizer.built
        step(x, y)
    else:
        model.compile(optimizer, "mse")
        callbacks = [tfmixprec.LossScaleMonitor()] if how == "LossScaleMonitor" else []
        model.fit(x, y, batch_size=32, verbose=0, callbacks=callbacks)
    assert int(optimizer.iterations) == 1 and float(optimizer.overflow_steps) == 0
    # One SGD step on every layer, `extra` included, as Keras's own fit takes it: bit for bit
    # in `fit` (float32: the loss scale, a power of two, changes no bit); `make_train_step`
    # computes the loss in its own ops, within float32 rounding of one step.
    assert len(model.weights) == len(reference.weights) == 6
    for mine, theirs in zip(model.weights, reference.weights):
        mine, theirs = keras.ops.convert_to_numpy(mine), theirs.numpy()
        if how == "make_train_step":
            np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-7)
        else:
            assert mine.tobytes() == theirs.tobytes()


def _with_metrics(jit_compile):
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(8)(inputs)
        model = tfmixprec.MixedPrecisionModel(
            inputs, keras.layers.Dense(1, dtype="float32")(hidden)
        )
    metrics = ["mae", keras.metrics.MeanSquaredError()]
    model.compile("adam", "mse", metrics=metrics, jit_compile=jit_compile)
    return model


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_mixed_precision_models_metrics_are_built_before_its_first_trace(jit_compile):
    """With `compile(metrics=...)`, Keras makes the metrics' variables in the step's first
    trace on one device (under a strategy it builds them from the first batch first), and
    TensorFlow traces the step again. `MixedPrecisionModel.fit` builds them from the data's
    spec (`_keras.fit.BuiltBeforeTrace`): one trace, and the same logs and weights, bit for
    bit, as where the trace makes them (Keras's own `_maybe_symbolic_build`)."""
    ours, theirs = _with_metrics(jit_compile), _with_metrics(jit_compile)
    theirs._maybe_symbolic_build = functools.partial(keras.Model._maybe_symbolic_build, theirs)
    traces, logs = [], []
    for model in (ours, theirs):
        calls, step = [], model.train_step
        model.train_step = lambda data, step=step, calls=calls: calls.append(1) or step(data)
        history = model.fit(
            cases.X, cases.Y, batch_size=16, epochs=2, shuffle=False, verbose=0,
            validation_data=(cases.X[:32], cases.Y[:32]),
        )  # fmt: skip
        traces.append(len(calls))
        logs.append(history.history)
    assert traces == [1, 2]
    assert logs[0] == logs[1] and "val_mean_squared_error" in logs[0]
    for a, b in zip(ours.weights, theirs.weights):
        assert a.numpy().tobytes() == b.numpy().tobytes()


class _EagerOnly(keras.layers.Layer):
    """A layer that reads a value on the host: it runs only in an eager step."""

    def call(self, x):
        return x * float(tf.reduce_max(tf.abs(x)) >= 0.0)

    def compute_output_spec(self, x):
        return keras.KerasTensor(x.shape, x.dtype)


def _batches(with_none):
    for start in range(0, 64, 16):
        x, y = cases.X[start : start + 16], cases.Y[start : start + 16]
        yield (x, y, None) if with_none else (x, y)


def _eager_only():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    outputs = _EagerOnly()(keras.layers.Dense(1, dtype="float32")(inputs))
    model = tfmixprec.MixedPrecisionModel(inputs, outputs)
    model.compile("adam", "mse", metrics=["mae"], run_eagerly=True)
    return model


@pytest.mark.parametrize("case", ["a None in the batch", "run_eagerly", "evaluate first"])
def test_where_metrics_cannot_be_built_first_the_trace_builds_them(case):
    """`BuiltBeforeTrace` builds nothing where a symbolic pass could differ from the trace or
    fail: batches with a `None` (an `OptionalSpec`), a step run eagerly (a layer that reads a
    value on the host), an `evaluate` before any `fit` (which would build the optimizer).
    Each runs as on Keras's own path, to the same logs."""
    build = _eager_only if case == "run_eagerly" else functools.partial(_with_metrics, False)
    models = [build(), build()]
    models[1]._maybe_symbolic_build = functools.partial(
        keras.Model._maybe_symbolic_build, models[1]
    )
    logs = []
    for model in models:
        if case == "evaluate first":
            logs.append(model.evaluate(cases.X, cases.Y, verbose=0, return_dict=True))
            assert not model.optimizer.built
        else:
            batches = _batches(case == "a None in the batch")
            logs.append(model.fit(batches, verbose=0).history)
    assert logs[0] == logs[1] and "mae" in str(logs[0])
