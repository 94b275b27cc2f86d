"""A skipped step changes no variable, non-trainable state included (tfmixprec.guard_state):
BatchNormalization's moving statistics and a dropout's seed after a float16 overflow step, in
`fit` (MixedPrecisionModel, and a plain model whose Keras optimizer a callback adopted),
`make_train_step`, a custom loop (eager, in one and in two tf.functions) and under 2
replicas."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from overflow_models import NestedLogsModel, fit_over_one_overflow

import tfmixprec

BATCH = 4


def _model(cls=keras.Model):
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(8, name="hidden")(inputs)
        hidden = keras.layers.BatchNormalization(name="bn")(hidden)
        hidden = keras.layers.Dropout(0.5, name="drop")(hidden)
        outputs = keras.layers.Dense(1, dtype="float32", name="out")(hidden)
        return cls(inputs, outputs)


def _data(bad=(1,)):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * BATCH, 3)).astype("float32")
    for batch in bad:
        x[batch * BATCH, 0] = 1e6  # finite, but past float16: the forward overflows
    return x, np.ones((4 * BATCH, 1), "float32")


def _state(model):
    return [v.numpy().tobytes() for v in model.variables]


class States(keras.callbacks.Callback):
    """Every variable of the model before and after each batch."""

    def __init__(self):
        super().__init__()
        self.before, self.after = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.before.append(_state(self.model))

    def on_train_batch_end(self, batch, logs=None):
        self.after.append(_state(self.model))


@pytest.mark.parametrize(
    "kind", ["MixedPrecisionModel", "adopted keras.Model", "keras.Model with tfmixprec's optimizer"]
)
def test_a_skipped_step_in_fit_changes_no_variable(kind):
    # A scale of 1, so that only the batch whose activations pass float16's range overflows.
    if kind == "MixedPrecisionModel":
        model = _model(tfmixprec.MixedPrecisionModel)
        model.compile(optimizer=tfmixprec.LossScaleOptimizer("sgd", initial_scale=1.0), loss="mse")
        callbacks = []
    elif kind == "keras.Model with tfmixprec's optimizer":
        model = _model()
        model.compile(optimizer=tfmixprec.LossScaleOptimizer("sgd", initial_scale=1.0), loss="mse")
        model.optimizer.build(model.trainable_variables)  # before fit: the step traced once
        callbacks = [tfmixprec.OverflowGuard()]
    else:
        model = _model()
        keras_optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), 1.0)
        model.compile(optimizer=keras_optimizer, loss="mse")
        callbacks = [tfmixprec.LossScaleMonitor()]
    states = States()
    model.fit(*_data(), batch_size=BATCH, shuffle=False, verbose=0, callbacks=[*callbacks, states])
    assert model.optimizer.read_state()["overflow_steps"] == 1
    assert states.after[1] == states.before[1]  # the skipped step: every variable bit-identical
    assert states.after[2] != states.before[2]  # applied steps change the statistics
    moving = [model.get_layer("bn").moving_mean, model.get_layer("bn").moving_variance]
    assert all(np.isfinite(v.numpy()).all() for v in moving)
    predicted = model.predict(_data(bad=())[0], verbose=0)
    assert np.isfinite(predicted).all()


def test_keras_own_optimizer_writes_nan_statistics_on_the_skipped_step():
    """What the guard prevents: Keras's LossScaleOptimizer skips the weights but the forward
    pass has written NaN into the moving statistics, and predict returns NaN after it."""
    model = _model()
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), 1.0), loss="mse"
    )
    model.optimizer.build(model.trainable_variables)  # before fit: the step traced once
    model.fit(*_data(), batch_size=BATCH, shuffle=False, verbose=0)
    assert not np.isfinite(model.get_layer("bn").moving_variance.numpy()).all()
    assert not np.isfinite(model.predict(_data(bad=())[0], verbose=0)).all()


def test_make_train_step_skips_without_changing_state():
    model = _model()
    opt = tfmixprec.LossScaleOptimizer("sgd", initial_scale=1.0)
    step = tfmixprec.make_train_step(model, keras.losses.MeanSquaredError(), opt)
    x, y = _data()
    logs = step(x[:BATCH], y[:BATCH])
    before = _state(model)
    logs = step(x[BATCH : 2 * BATCH], y[BATCH : 2 * BATCH])
    assert float(logs["overflow"]) == 1.0 and _state(model) == before


@pytest.mark.parametrize("mode", ["eager", "one function", "two functions"])
def test_a_custom_loop_with_guard_state(mode):
    model = _model()
    opt = tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=1.0)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()

    def forward_and_apply(x, y):
        with tfmixprec.guard_state(model, opt):
            with tf.GradientTape() as tape:
                scaled = opt.scale_loss(loss_fn(y, model(x, training=True)))
            grads = tape.gradient(scaled, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)

    if mode == "eager":
        step = forward_and_apply
    elif mode == "one function":
        step = tf.function(forward_and_apply)
    else:  # the guard's read in one function, the step in another: values passed, no state
        inner = tf.function(forward_and_apply)
        step = tf.function(lambda x, y: inner(x, y))
    x, y = _data()
    step(x[:BATCH], y[:BATCH])
    before = _state(model)
    step(x[BATCH : 2 * BATCH], y[BATCH : 2 * BATCH])
    assert opt.read_state()["overflow_steps"] == 1 and _state(model) == before
    step(x[2 * BATCH : 3 * BATCH], y[2 * BATCH : 3 * BATCH])
    assert _state(model) != before


def test_under_two_replicas_each_copy_is_put_back(two_cpu_strategy):
    with two_cpu_strategy.scope():
        model = _model(tfmixprec.MixedPrecisionModel)
        opt = tfmixprec.LossScaleOptimizer("sgd", initial_scale=1.0)
        model.compile(optimizer=opt, loss="mse")
    states = States()
    x, y = _data(bad=(1,))
    model.fit(x, y, batch_size=2 * BATCH, shuffle=False, verbose=0, callbacks=[states])
    # Global batch 1 of 2 holds the overflow (in replica 0's half): skipped on both replicas.
    overflows = model.optimizer.read_state()["overflow_steps"]
    assert overflows == 1 and states.after[0] == states.before[0]
    bn = model.get_layer("bn")
    copies = [v.numpy() for v in two_cpu_strategy.experimental_local_results(bn.moving_variance)]
    assert all(np.isfinite(c).all() for c in copies)


def test_guard_state_bad_input():
    with pytest.raises(TypeError, match=r"guard_state needs the tfmixprec.LossScaleOptimizer"):
        with tfmixprec.guard_state(_model(), keras.optimizers.SGD()):
            pass


def _no_dropout_model(cls):
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(8, name="hidden")(inputs)
        hidden = keras.layers.BatchNormalization(name="bn")(hidden)
        outputs = keras.layers.Dense(1, dtype="float32", name="out")(hidden)
        return cls(inputs, outputs)


@pytest.mark.parametrize("kind", ["MixedPrecisionModel", "keras.Model"])
def test_an_epoch_with_a_skipped_step_logs_the_mean_over_the_applied_steps(kind):
    """The loss and metrics of `compile` are state the step writes too: put back on a skip,
    an epoch's loss is not nan, and it is the mean over the applied steps, bit for bit what
    the same fit without the bad batch logs (a fixed scale: the skip changes nothing)."""
    x, y = _data(bad=(1,))
    keep = np.r_[0:BATCH, 2 * BATCH : 4 * BATCH]  # every batch but the bad one
    histories, overflows, batches = [], [], []
    for x_fit, y_fit in [(x, y), (x[keep], y[keep])]:
        seen = []
        batches.append(seen)
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs, seen=seen: seen.append(
                (float(logs["loss"]), float(logs["mae"]))
            )
        )
        cls = tfmixprec.MixedPrecisionModel if kind == "MixedPrecisionModel" else keras.Model
        model = _no_dropout_model(cls)
        opt = tfmixprec.LossScaleOptimizer("sgd", initial_scale=1.0, dynamic=False)
        model.compile(optimizer=opt, loss="mse", metrics=["mae"])
        histories.append(
            model.fit(
                x_fit,
                y_fit,
                batch_size=BATCH,
                shuffle=False,
                verbose=0,
                callbacks=[tfmixprec.OverflowGuard(), record],
            ).history
        )
        overflows.append(model.optimizer.read_state()["overflow_steps"])
    skipped, clean = histories
    assert overflows == [1, 0]
    assert np.isfinite(skipped["loss"][0])
    assert (skipped["loss"], skipped["mae"]) == (clean["loss"], clean["mae"])
    # the step's logs: the skipped step's are the mean so far, the others the clean fit's,
    # and the last one is, bit for bit, what Keras's own metrics say at the epoch's end
    assert batches[0] == [batches[1][0], batches[1][0], *batches[1][1:]]
    assert batches[0][-1] == (skipped["loss"][0], skipped["mae"][0])


@pytest.mark.parametrize("second", ["sgd", "keras LossScaleOptimizer"])
def test_an_adopted_model_compiled_again_with_another_optimizer_still_fits(second):
    """The guard adoption put around the step reads the optimizer while tracing: compiled
    again with one that skips nothing, the step runs as Keras's own."""
    model = _model()
    keras_optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), 1.0)
    model.compile(optimizer=keras_optimizer, loss="mse")
    x, y = _data(bad=())
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[tfmixprec.LossScaleMonitor()])
    assert vars(model)["train_step"].tfmixprec_guarded
    if second == "sgd":
        optimizer = "sgd"
    else:
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), 1.0)
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x, y, batch_size=BATCH, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert not isinstance(model.optimizer, tfmixprec.LossScaleOptimizer)


@pytest.mark.parametrize("kind", ["MixedPrecisionModel", "keras.Model"])
def test_the_logs_of_a_skipped_step_and_of_an_epoch_without_an_applied_step(kind):
    """The skipped step's own logs already hold the mean over the applied steps (so
    TerminateOnNaN does not stop at an ordinary skip, even on an epoch's last batch), and an
    epoch in which every step was skipped logs nan, not the 0 of an empty mean."""
    cls = tfmixprec.MixedPrecisionModel if kind == "MixedPrecisionModel" else keras.Model
    model = _no_dropout_model(cls)
    opt = tfmixprec.LossScaleOptimizer("sgd", initial_scale=1.0, dynamic=False)
    model.compile(optimizer=opt, loss="mse", metrics=["mae"])
    x, y = _data(bad=(1, 3))  # batch 3 ends the epoch
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(float(logs["loss"]))
    )
    callbacks = [tfmixprec.OverflowGuard(), record, keras.callbacks.TerminateOnNaN()]
    history = model.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks
    )
    assert len(history.history["loss"]) == 2 and np.isfinite(seen).all()
    assert seen[1] == seen[0] and seen[3] == seen[2]  # a skipped step's logs: the mean so far
    x_all_bad, _ = _data(bad=(0, 1, 2, 3))
    clean = _data(bad=())
    for validation in (None, clean):  # a validation after it resets and fills the metrics
        seen.clear()
        history = model.fit(
            x_all_bad,
            y,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
            validation_data=validation,
            callbacks=[tfmixprec.OverflowGuard(), record],
        ).history
        assert np.isnan(history["loss"]) and np.isnan(history["mae"])
        assert len(seen) == 4 and np.isnan(seen).all()  # each step's logs: no step applied
        assert validation is None or np.isfinite(history["val_loss"])


def test_with_accumulation_an_epoch_of_one_skipped_window_logs_its_counted_micro_batches():
    """A window of 4 micro-batches whose last one overflows: the window is skipped and its last
    micro-batch put back; the three before it still count, so the epoch's loss is their mean,
    not nan (no step applied, but not every micro-batch skipped)."""
    model = _no_dropout_model(keras.Model)
    opt = tfmixprec.LossScaleOptimizer(
        "sgd", initial_scale=1.0, dynamic=False, accumulation_steps=4
    )
    model.compile(optimizer=opt, loss="mse")
    model.optimizer.build(model.trainable_variables)  # before fit: the step traced once
    x, y = _data(bad=(3,))
    history = model.fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[tfmixprec.OverflowGuard()]
    ).history
    state = model.optimizer.read_state()
    assert (state["iterations"], state["overflow_steps"]) == (0, 1)
    assert np.isfinite(history["loss"][0])


def test_only_what_the_step_writes_is_put_back():
    """A frozen layer's weights are non-trainable state the step only reads: the guard puts
    back what the block may write (batch-norm statistics, metrics), not a frozen table (a
    select of it would copy it every step)."""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((4,), dtype="int32")
        table = keras.layers.Embedding(1000, 8, trainable=False, name="frozen")
        hidden = keras.layers.Flatten()(table(inputs))
        hidden = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(8)(hidden))
        model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(hidden))
    opt = tfmixprec.LossScaleOptimizer("sgd", initial_scale=1.0)
    opt.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tfmixprec.guard_state(model, opt):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
                scaled = opt.scale_loss(loss)
            opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

    x, y = np.zeros((4, 4), "int32"), np.zeros((4, 1), "float32")
    graph = step.get_concrete_function(x, y).graph
    inside = {id(outer): inner for outer, inner in graph.captures}

    def assigned(variable):
        handle = inside[id(variable.value.handle)]
        return any(op.type == "AssignVariableOp" and op.inputs[0] is handle
                   for op in graph.get_operations())  # fmt: skip

    bn = model.get_layer("bn")
    assert assigned(bn.moving_mean) and assigned(bn.moving_variance)
    assert not assigned(table.embeddings)
    before = table.embeddings.numpy().copy()
    x[0, 0] = 1  # any ids: only the table's reads change
    step(x, np.full((4, 1), np.inf, "float32"))  # a skipped step
    np.testing.assert_array_equal(table.embeddings.numpy(), before)


class GuideModel(keras.Model):
    """The Keras guide's custom `train_step` with its own trackers ("Customizing what happens
    in fit()": a `metrics` property, `compile` without a loss), scaling the loss itself."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y, y_pred))
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_models_own_loss_tracker_logs_its_mean_not_nan(jit_compile):
    """No step overflows: with OverflowGuard each step logs the model's own trackers' means.
    Keras's own loss tracker, which this model never updates, says nothing of whether a step
    was applied (it was read so, and every step logged nan)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(4)(keras.layers.Dense(4)(inputs))
    model = GuideModel(inputs, outputs, name="guide")
    opt = tfmixprec.LossScaleOptimizer("sgd", initial_scale=1.0, dynamic=False)
    model.compile(optimizer=opt, jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3)).astype("float32"), rng.normal(size=(16, 4)).astype("float32")
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(
            (float(logs["loss"]), float(model.loss_tracker.result()))
        )
    )
    model.fit(
        x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[tfmixprec.OverflowGuard(), record]
    )
    assert len(seen) == 4
    assert [logged for logged, _ in seen] == [own for _, own in seen]


def _derived(base):
    """A model whose `get_metrics_result` (Keras's public hook behind `compute_metrics`)
    reports `mae` in percent and adds `rmse` from the `mse` metric."""

    class Derived(base):
        def get_metrics_result(self):
            results = super().get_metrics_result()
            results["rmse"] = keras.ops.sqrt(results["mse"])
            results["mae"] = results["mae"] * 100.0
            return results

    return Derived


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("kind", ["keras.Model", "MixedPrecisionFunctional"])
def test_the_logs_follow_an_overridden_get_metrics_result(kind, jit_compile):
    """Batch 1 overflows (float16 forward) and is put back. Each step's logs are what the
    model's own `get_metrics_result()` says after it, bit for bit: the guard does not read
    each `metric.result()` itself where the model reports its results its own way."""
    base = keras.Model if kind == "keras.Model" else tfmixprec.MixedPrecisionFunctional
    model, logged, own = fit_over_one_overflow(_derived(base), ["mse", "mae"], jit_compile)
    assert np.isfinite([row["rmse"] for row in logged]).all(), logged
    assert logged == own


class CountedMAE(keras.metrics.MeanAbsoluteError):
    """`mae`, counting the calls of `result()` (in a traced step: once a trace)."""

    calls = 0

    def result(self):
        self.calls += 1
        return super().result()


class OwnComputeMetrics(tfmixprec.MixedPrecisionFunctional):
    """Keras's pattern for a metric of one's own (`compute_metrics`'s docstring): Keras's
    results from `super().compute_metrics`, then one more, read from them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extra = keras.metrics.Mean(name="extra")

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        results = super().compute_metrics(x, y, y_pred, sample_weight)
        self.extra.update_state(results["loss"] * 2.0)
        results["extra"] = self.extra.result()
        return results


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_mixed_precision_models_step_reads_each_result_once(jit_compile):
    """MixedPrecisionModel's step reads each metric result once, after the guard put the
    metrics back (inside it, Keras's `compute_metrics` gets no results), and logs them as
    Keras's own step would: its keys, in its order, then the loss scale's."""
    metric = CountedMAE(name="mae")
    model, logged, own = fit_over_one_overflow(
        tfmixprec.MixedPrecisionFunctional, ["mse", metric], jit_compile
    )
    assert logged == own and np.isfinite([row["mae"] for row in logged]).all()
    metric.calls = 0
    spec = (tf.TensorSpec([4, 3]), tf.TensorSpec([4, 4]))
    traced = tf.function(model.train_step).get_concrete_function(spec)
    assert metric.calls == 1
    assert list(traced.structured_outputs) == [
        "loss", "mse", "mae", "loss_scale", "overflow", "overflow_steps", "skipped_fraction"
    ]  # fmt: skip
    assert model.get_metrics_result()["mae"] == own[-1]["mae"]  # outside the step: all


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_models_own_compute_metrics_gets_kerass_results(jit_compile):
    """A `compute_metrics` of the model's own reads Keras's results from `super()` (they are
    not left out of its step): batch 1 overflows and is put back, and each step logs what
    `get_metrics_result()` says after it, its own metric's too."""
    model, logged, own = fit_over_one_overflow(OwnComputeMetrics, ["mae"], jit_compile)
    assert sorted(logged[0]) == ["extra", "loss", "mae"]  # in `model.metrics`'s order (Keras's)
    assert logged == own and np.isfinite([row["extra"] for row in logged]).all()


def test_under_two_replicas_each_result_is_read_after_the_put_back(two_cpu_strategy):
    """Each replica traces the step in its own thread: the overflow step (batch 1) logs the
    means of step 0, bit for bit, and every step's logs are what `get_metrics_result()` says
    after it, up to the order in which the replicas' float32 totals were summed (a few ulps:
    Keras's step averages the replicas' means, `get_metrics_result` divides the summed
    totals, the same where, as here, each replica's half of a batch weighs the same)."""
    _, logged, own = fit_over_one_overflow(
        tfmixprec.MixedPrecisionFunctional, ["mae"], False, two_cpu_strategy
    )
    assert list(logged[0]) == ["loss", "mae"] and logged[1] == logged[0]
    rows = [[row[key] for key in ("loss", "mae")] for row in (*logged, *own)]
    eps = float(np.finfo(np.float32).eps)
    np.testing.assert_allclose(rows[: len(logged)], rows[len(logged) :], rtol=4 * eps, atol=0)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_nested_compile_metrics_log_is_read_after_the_put_back(jit_compile):
    """Batch 1 overflows and is put back: its `mae` log is the mean over the applied steps
    (what `get_metrics_result()` says after it), though the step logs it inside a nested
    `compile_metrics` dict (it was the nan read inside the guard)."""
    _, logged, own = fit_over_one_overflow(NestedLogsModel, ["mae"], jit_compile)
    assert logged == own
