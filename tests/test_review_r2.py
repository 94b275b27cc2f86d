"""Reviewer R2's failing tests for faf1be5 (MixedPrecisionModel's step reads its metric
results once, after the state guard; Keras's `get_metrics_result` returns `{}` inside it).

Each test fits a tiny float16 model on 4 batches of 4, batch 1 overflowing in the forward pass
(x[4, 0] = 1e6, a fixed scale of 1), and checks the contract: each step's logs are what the
model's own `get_metrics_result()` says right after it, with the keys its own step gives.
The models put `MixedPrecisionMixin` before a Keras model class of the user's own, as its
docstring allows ("Gives a Keras model class tfmixprec's mixed-precision train_step")."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec.fit.training import MixedPrecisionMixin


def _fit_over_one_overflow(cls, metrics, jit_compile):
    """A functional `cls` model fitted on 4 batches, batch 1 overflowing; each step's logs
    (None for a key they lack) and what `get_metrics_result()` said after each."""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(4, dtype="float32")(keras.layers.Dense(4)(inputs))
        model = cls(inputs, outputs, name="r2")
        opt = tfmixprec.LossScaleOptimizer("sgd", initial_scale=1.0, dynamic=False)
        model.compile(optimizer=opt, loss="mse", metrics=metrics, jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3)).astype("float32"), rng.normal(size=(16, 4)).astype("float32")
    x[4, 0] = 1e6
    logged, own = [], []

    def record(batch, logs):
        now = {k: float(np.float32(v)) for k, v in model.get_metrics_result().items()}
        logged.append({k: float(logs[k]) if k in logs else None for k in now})
        own.append(now)

    record = keras.callbacks.LambdaCallback(on_train_batch_end=record)
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[record])
    assert model.optimizer.read_state()["overflow_steps"] == 1
    return model, logged, own


class RmseResults(keras.Model):
    """A model class of the user's own whose `get_metrics_result` adds `rmse` (Keras's public
    hook behind `compute_metrics`)."""

    def get_metrics_result(self):
        results = super().get_metrics_result()
        results["rmse"] = keras.ops.sqrt(results["mse"])
        return results


class MixedRmseResults(MixedPrecisionMixin, RmseResults):
    """The mixin before it: `get_metrics_result` resolves to the mixin's (marked as Keras's),
    whose `super()` is `RmseResults`'s."""


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_get_metrics_result_below_the_mixin_is_in_the_logs(jit_compile):
    """`RmseResults.get_metrics_result` is what the model says after each step (`rmse`
    included), but the step's logs are rebuilt from `model.metrics` alone, so `rmse` is
    missing from every step's logs (got None). Before faf1be5 the guard saw an own
    `get_metrics_result` and read it. (Eagerly and under a strategy the guard still calls
    `model.get_metrics_result()`, so there `rmse` is logged: the paths disagree.)"""
    _, logged, own = _fit_over_one_overflow(MixedRmseResults, ["mse"], jit_compile)
    assert [row["rmse"] for row in own] == [pytest.approx(np.sqrt(r["mse"])) for r in own]
    assert logged == own


class DerivedLogsStep(keras.Model):
    """A model class of the user's own whose `train_step` adds a log derived from Keras's
    (a common pattern: `logs = super().train_step(data)`, then `logs["rmse"] = ...`)."""

    def train_step(self, data):
        logs = super().train_step(data)
        logs["rmse"] = keras.ops.sqrt(logs["mse"])
        return logs


class MixedDerivedLogsStep(MixedPrecisionMixin, DerivedLogsStep):
    """The mixin before it: the mixin's step calls `DerivedLogsStep.train_step`, which calls
    Keras's, inside `results_after_guard`."""


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_train_step_below_the_mixin_gets_kerass_logs(jit_compile):
    """Inside the mixin's step Keras's `compute_metrics` now returns `{}`, so a `train_step`
    between the mixin and Keras's gets no `mse` from `super().train_step(data)`: tracing
    fails with KeyError: 'mse'. Before faf1be5 it got Keras's logs and this fit ran."""
    model, logged, own = _fit_over_one_overflow(MixedDerivedLogsStep, ["mse"], jit_compile)
    assert logged == own
    spec = (tf.TensorSpec([4, 3]), tf.TensorSpec([4, 4]))
    traced = tf.function(model.train_step).get_concrete_function(spec)
    assert "rmse" in traced.structured_outputs


class NestedLogsStep(keras.Model):
    """The Keras 3 guide's custom `train_step` ("Customizing what happens in fit()"): every
    metric updated by hand, `{m.name: m.result()}` returned, so the compiled metrics come as
    one nested dict under `compile_metrics`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class MixedNestedLogsStep(MixedPrecisionMixin, NestedLogsStep):
    """The mixin before the guide's step."""


def test_a_custom_step_below_the_mixin_keeps_its_keys():
    """The guide's step returns `loss` and `compile_metrics` (nested); the mixin's step
    should add only the loss scale's keys. Since faf1be5 `metrics_after_guard(...,
    every_result=True)` also adds each result flat in front (`mae` besides
    `compile_metrics: {mae}`): keys the model's own step never gives."""
    model, logged, own = _fit_over_one_overflow(MixedNestedLogsStep, ["mae"], False)
    assert logged == own
    spec = (tf.TensorSpec([4, 3]), tf.TensorSpec([4, 4]))
    traced = tf.function(model.train_step).get_concrete_function(spec)
    assert list(traced.structured_outputs) == [
        "loss", "compile_metrics", "loss_scale", "overflow", "overflow_steps", "skipped_fraction"
    ]  # fmt: skip
    assert list(traced.structured_outputs["compile_metrics"]) == ["mae"]


class MeanAndCount(keras.metrics.Metric):
    """A metric whose `result()` is a dict (Keras allows it: `get_metrics_result` and the
    callbacks' logs flatten it): the mean absolute prediction and the number of updates."""

    def __init__(self, name="pred", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), "zeros", name="total")
        self.updates = self.add_variable((), "zeros", name="updates")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(keras.ops.mean(keras.ops.abs(keras.ops.cast(y_pred, "float32"))))
        self.updates.assign_add(1.0)

    def result(self):
        return {"pred_mean": self.total / self.updates, "pred_updates": self.updates * 1.0}


@pytest.mark.parametrize("cls", [tfmixprec.MixedPrecisionFunctional, keras.Model])
def test_a_metric_with_a_dict_result_is_logged(cls):
    """Keras's `CompileMetrics` nests a dict result under the metric's name; a plain Keras
    model (no tfmixprec callback) fits and logs `pred_mean`/`pred_updates`. The guard's
    `metrics_after_guard` rebuilds the results from `model.metrics` and calls
    `tf.convert_to_tensor` on that nested dict: TypeError "Expected any non-tensor type, but
    got a tensor instead" while tracing, for MixedPrecisionModel and for a plain model with
    `OverflowGuard` (also on faf1be5~1: the same line was there before)."""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(4, dtype="float32")(keras.layers.Dense(4)(inputs))
        model = cls(inputs, outputs)
        opt = tfmixprec.LossScaleOptimizer("sgd", initial_scale=1.0, dynamic=False)
        model.compile(optimizer=opt, loss="mse", metrics=[MeanAndCount()])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 4)).astype("float32")
    logged, own = [], []

    def record(batch, logs):
        now = model.get_metrics_result()["pred"]
        logged.append([float(logs[k]) for k in ("pred_mean", "pred_updates")])
        own.append([float(now[k]) for k in ("pred_mean", "pred_updates")])

    record = keras.callbacks.LambdaCallback(on_train_batch_end=record)
    callbacks = [tfmixprec.OverflowGuard(), record]
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=callbacks)
    assert logged == own and [row[1] for row in logged] == [1.0, 2.0]


def test_under_two_replicas_weighted_logs_are_the_results(two_cpu_strategy):
    """Two replicas, no overflow, sample weights rising over the batch: each step's logs
    should be what `get_metrics_result()` says after it, up to a few ulps (the contract, and
    `test_under_two_replicas_each_result_is_read_after_the_put_back`'s docstring). The step
    reads each replica's own weighted mean and Keras's `reduce_per_replica("auto")` averages
    the replicas' results, where `get_metrics_result` divides the summed totals: the weighted
    `mse` is logged up to 8% off. (Plain Keras logs the same; also on faf1be5~1.)"""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"), two_cpu_strategy.scope():
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(4, dtype="float32")(keras.layers.Dense(4)(inputs))
        model = tfmixprec.MixedPrecisionModel(inputs, outputs)
        opt = tfmixprec.LossScaleOptimizer("sgd", initial_scale=1.0, dynamic=False)
        model.compile(optimizer=opt, loss="mse", metrics=["mae"], weighted_metrics=["mse"])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 3)).astype("float32"), rng.normal(size=(12, 4)).astype("float32")
    weights = np.linspace(0.5, 2.0, 12).astype("float32")
    logged, own = [], []

    def record(batch, logs):
        now = model.get_metrics_result()
        logged.append([float(logs[k]) for k in ("loss", "mae", "mse")])
        own.append([float(now[k]) for k in ("loss", "mae", "mse")])

    record = keras.callbacks.LambdaCallback(on_train_batch_end=record)
    model.fit(
        x, y, sample_weight=weights, batch_size=4, shuffle=False, verbose=0, callbacks=[record]
    )
    eps = float(np.finfo(np.float32).eps)
    np.testing.assert_allclose(logged, own, rtol=4 * eps, atol=0)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_with_accumulation_one_overflow_leaves_the_epoch_loss_finite(jit_compile):
    """`compile(accumulation_steps=2)`: batch 0 (the first micro-batch of window 0)
    overflows in the forward pass, window 0 is skipped, window 1 (batches 2, 3) is applied.
    The guard puts back only a window's last micro-batch, so batch 0's inf/nan stays in the
    loss and metric totals: every later step and the epoch log `loss` nan (and batch 0 counts
    in `accuracy`), the "epoch mean loss nan after one skipped batch" the guard exists to
    prevent. Documented in `guard_state` ("the earlier micro-batches' state stays"); also on
    faf1be5~1."""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(4, dtype="float32")(keras.layers.Dense(4)(inputs))
        model = tfmixprec.MixedPrecisionModel(inputs, outputs)
        opt = tfmixprec.LossScaleOptimizer("sgd", initial_scale=1.0, dynamic=False)
        model.compile(
            optimizer=opt,
            loss="mse",
            metrics=["mae"],
            jit_compile=jit_compile,
            accumulation_steps=2,
        )
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 3)).astype("float32"), rng.normal(size=(16, 4)).astype("float32")
    x[0, 0] = 1e6
    logged = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: logged.append([logs["loss"], logs["mae"]])
    )
    history = model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[record])
    assert model.optimizer.read_state()["overflow_steps"] == 1
    assert np.isfinite(logged[2:]).all(), logged
    assert np.isfinite(history.history["loss"]).all(), history.history
