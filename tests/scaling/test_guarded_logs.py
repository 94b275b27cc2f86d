"""A guarded step's logs (`metrics_after_guard`) on models of the user's own: each step's logs
are what the model's `get_metrics_result()` says right after it, with the keys its own step
gives. `MixedPrecisionModel`'s step reads its results once, after the guard (Keras's
`compute_metrics` gets none inside it), only where no class of the model's own reads or makes
them: `MixedPrecisionMixin` before a Keras model class with its own `get_metrics_result`,
`train_step` or custom step (as the mixin's docstring allows); a metric whose result is a dict.

Most tests fit a tiny float16 model on 4 batches of 4, batch 1 overflowing in the forward pass
(x[4, 0] = 1e6, a fixed scale of 1)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from overflow_models import NestedLogsModel, fit_over_one_overflow

import tfmixprec
from tfmixprec.fit.training import MixedPrecisionMixin


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
    """`RmseResults.get_metrics_result` (below the mixin) is what the model says after each
    step, `rmse` included: the step's logs are that, read after the guard."""
    _, logged, own = fit_over_one_overflow(MixedRmseResults, ["mse"], jit_compile)
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
    """A `train_step` between the mixin and Keras's gets Keras's logs from
    `super().train_step(data)` (its `mse`), and its own `rmse` is in the step's logs."""
    model, logged, own = fit_over_one_overflow(MixedDerivedLogsStep, ["mse"], jit_compile)
    assert logged == own
    spec = (tf.TensorSpec([4, 3]), tf.TensorSpec([4, 4]))
    traced = tf.function(model.train_step).get_concrete_function(spec)
    assert "rmse" in traced.structured_outputs


class MixedNestedLogsStep(MixedPrecisionMixin, NestedLogsModel):
    """The mixin before the guide's step."""


def test_a_custom_step_below_the_mixin_keeps_its_keys():
    """The guide's step returns `loss` and `compile_metrics` (nested); the mixin's step adds
    only the loss scale's keys, not each result flat besides them."""
    model, logged, own = fit_over_one_overflow(MixedNestedLogsStep, ["mae"], False)
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
    """Keras's `CompileMetrics` nests a dict result under the metric's name (the callbacks'
    logs flatten it): the guarded step logs it as Keras's would, read after the guard, for
    MixedPrecisionModel and for a plain model with `OverflowGuard` (it raised a TypeError
    while tracing: the guard made one tensor of the dict)."""
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
        now = model.get_metrics_result()
        now = now.get("pred", now)  # nested under its name (Keras 3.15) or not (3.12)
        logged.append([float(logs[k]) for k in ("pred_mean", "pred_updates")])
        own.append([float(now[k]) for k in ("pred_mean", "pred_updates")])

    record = keras.callbacks.LambdaCallback(on_train_batch_end=record)
    callbacks = [tfmixprec.OverflowGuard(), record]
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=callbacks)
    assert logged == own and [row[1] for row in logged] == [1.0, 2.0]


@pytest.mark.xfail(
    strict=True,
    reason="guard_state puts back a skipped window's last micro-batch only (documented): "
    "the earlier micro-batches' state stays",
)
@pytest.mark.parametrize("jit_compile", [False, True])
def test_with_accumulation_one_overflow_leaves_the_epoch_loss_finite(jit_compile):
    """`compile(accumulation_steps=2)`: batch 0 (the first micro-batch of window 0)
    overflows in the forward pass, window 0 is skipped, window 1 (batches 2, 3) is applied.
    The guard puts back only a window's last micro-batch, so batch 0's inf/nan stays in the
    loss and metric totals: every later step and the epoch log `loss` nan. A known limit
    (`guard_state`'s docstring), held here so that the day it is lifted shows."""
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
