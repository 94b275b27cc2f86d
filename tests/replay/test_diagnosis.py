"""explain_overflow: each cause on a model built to show it, and the replay changes nothing."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from overflow_models import bad_run_model, loss_data, loss_model
from tensorboard.backend.event_processing import event_accumulator

import tfmixprec


def _model(kernel=0.1, policy="mixed_float16", scale=2.0**15):
    with tfmixprec.policy_scope(policy):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(
            16, name="big", kernel_initializer=keras.initializers.Constant(kernel)
        )(inputs)
        constant = keras.initializers.Constant(0.5)
        outputs = keras.layers.Dense(1, name="out", dtype="float32", kernel_initializer=constant)(
            hidden
        )
        model = tfmixprec.MixedPrecisionModel(inputs, outputs)
        optimizer = tfmixprec.LossScaleOptimizer("adam", initial_scale=scale)
        model.compile(optimizer=optimizer, loss="mse")
    return model


def _batch(x_value=1.0, n=4):
    return np.full((n, 8), x_value, "float32"), np.ones((n, 1), "float32")


def _state(model):
    model.optimizer.build(model.trainable_variables)
    values = [v.numpy().copy() for v in model.weights + list(model.optimizer.variables)]
    policies = [layer.dtype_policy.name for layer in model.layers]
    return values, policies


def _explain_leaving_model_unchanged(model, batch):
    """`explain_overflow(model, batch)`, asserting that weights, optimizer variables and layer
    policies are bit-identical afterwards."""
    values_before, policies_before = _state(model)
    diagnosis = tfmixprec.explain_overflow(model, batch)
    values_after, policies_after = _state(model)
    assert policies_before == policies_after
    assert len(values_before) == len(values_after)
    for a, b in zip(values_before, values_after):
        assert a.tobytes() == b.tobytes()
    return diagnosis


def test_forward_overflow_names_the_layer_and_the_float32_max():
    model = _model(kernel=300.0)
    diagnosis = _explain_leaving_model_unchanged(model, _batch(100.0))
    assert (diagnosis.cause, diagnosis.layer) == ("forward-overflow", "big")
    assert "reach 2.4e+05 in float32, past float16's 65504" in diagnosis.message
    assert "finite in float32 and bfloat16" in diagnosis.message
    big = diagnosis.layers[0]
    assert (big.layer, big.compute_dtype, big.inf) == ("big", "float16", 64)
    assert big.float32_max_abs == 240000.0
    assert diagnosis.loss_scale == 2.0**15


def test_attention_logits_past_65504_are_a_forward_overflow():
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((4, 8))
        attention = keras.layers.MultiHeadAttention(2, 8, name="attention")
        mixed = attention(inputs, inputs)
        outputs = keras.layers.Dense(1, dtype="float32", name="head")(mixed)
        model = tfmixprec.MixedPrecisionModel(inputs, outputs)
        model.compile(optimizer="adam", loss="mse")
    x = np.full((2, 4, 8), 200.0, "float32")
    diagnosis = tfmixprec.explain_overflow(model, (x, np.zeros((2, 4, 1), "float32")))
    assert (diagnosis.cause, diagnosis.layer) == ("forward-overflow", "attention")


def test_bad_data_names_the_labels():
    model = _model()
    x, y = _batch()
    y[2, 0] = np.nan
    diagnosis = tfmixprec.explain_overflow(model, (x, y))
    assert (diagnosis.cause, diagnosis.layer) == ("bad-data", None)
    assert diagnosis.message.startswith("the batch's labels hold 1 NaN/Inf values")


def test_loss_overflow_and_scaled_loss_overflow():
    model = _model(kernel=1.0, policy="float32")
    model.get_layer("out").kernel.assign(np.full((16, 1), 1e18, "float32"))
    diagnosis = tfmixprec.explain_overflow(model, _batch(1.0), scale=1.0)
    assert diagnosis.cause == "loss-overflow"
    assert "the loss is not" in diagnosis.message
    model.get_layer("out").kernel.assign(np.full((16, 1), 1e16, "float32"))
    diagnosis = tfmixprec.explain_overflow(model, _batch(1.0), scale=2.0**15)
    assert diagnosis.cause == "loss-overflow"
    assert "the loss times 32768 is not" in diagnosis.message


def test_backward_overflow_counts_the_halvings():
    model = _model(kernel=300.0)
    diagnosis = _explain_leaving_model_unchanged(model, _batch(1.0))
    assert (diagnosis.cause, diagnosis.layer) == ("backward-overflow", "big")
    assert (diagnosis.halvings, diagnosis.finite_scale) == (14, 2.0)  # dL/dh = 19200: S < 3.4
    assert "nothing to fix" in diagnosis.message
    assert diagnosis.layers[0].gradient_nonfinite > 0


def test_underflow_share_at_the_scale():
    keras.utils.set_random_seed(0)
    model = _model(kernel=0.1)

    def tiny_loss(y_true, y_pred):
        return keras.losses.mean_squared_error(y_true, y_pred) * 2.0**-40

    diagnosis = tfmixprec.explain_overflow(model, _batch(1.0), scale=1.0, loss_fn=tiny_loss)
    assert diagnosis.cause == "underflow"
    assert diagnosis.underflow_fraction > 0.9
    assert "flush to zero in float16" in diagnosis.message
    at_scale = tfmixprec.explain_overflow(model, _batch(1.0), scale=2.0**40, loss_fn=tiny_loss)
    assert at_scale.cause == "none" and at_scale.underflow_fraction == 0.0


def test_default_scale_is_the_overflowing_steps_scale():
    model = _model(kernel=300.0, scale=1024.0)
    x, y = _batch(1.0, n=8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # overflows, backs off to 512
    assert model.optimizer.read_state()["loss_scale"] == 512.0
    diagnosis = tfmixprec.explain_overflow(model, (x, y))
    assert diagnosis.loss_scale == 1024.0
    assert (diagnosis.cause, diagnosis.halvings) == ("backward-overflow", 9)  # 1024 -> 2


def test_report_forms():
    model = _model(kernel=300.0)
    diagnosis = tfmixprec.explain_overflow(model, _batch(100.0))
    as_dict = json.loads(json.dumps(diagnosis.to_dict()))
    assert as_dict["cause"] == "forward-overflow" and as_dict["loss"] == "inf"
    assert as_dict["layers"][0]["layer"] == "big"
    table = diagnosis.to_markdown()
    assert table.startswith("**forward-overflow** in `big`: 64 NaN/Inf in its output")
    assert "| big | float16 | 0 | 0 | 64 | 2.4e+05 |" in table
    assert str(diagnosis).startswith("forward-overflow in layer 'big': ")


def test_a_subclassed_model_and_a_plain_optimizer():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.big = keras.layers.Dense(
                4, name="big", kernel_initializer=keras.initializers.Constant(300.0)
            )
            self.out = keras.layers.Dense(1, name="out", dtype="float32")

        def call(self, x):
            return self.out(self.big(x))

    with tfmixprec.policy_scope("mixed_float16"):
        model = Net()
        model.compile(optimizer="sgd", loss="mse", auto_scale_loss=False)
    model(np.zeros((1, 8), "float32"))
    diagnosis = tfmixprec.explain_overflow(model, _batch(100.0))
    assert (diagnosis.cause, diagnosis.layer, diagnosis.loss_scale) == (
        "forward-overflow",
        "big",
        1.0,
    )


def test_bad_input():
    with pytest.raises(TypeError, match="explain_overflow expects a keras.Model"):
        tfmixprec.explain_overflow("model", _batch())
    unbuilt = keras.Sequential([keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="is not built"):
        tfmixprec.explain_overflow(unbuilt, _batch())
    model = _model()
    with pytest.raises(ValueError, match=r"batch must be a tuple \(x, y\)"):
        tfmixprec.explain_overflow(model, np.zeros((4, 8)))


def test_inputs_past_65504_overflow_at_the_first_layers_cast():
    model = _model()
    x, y = _batch()
    x[0, 0] = 1e5  # finite data, but not in float16
    diagnosis = tfmixprec.explain_overflow(model, (x, y))
    assert (diagnosis.cause, diagnosis.layer) == ("forward-overflow", "big")
    assert "its inputs reach 1e+05 in float32, past float16's 65504" in diagnosis.message


def test_an_overflow_between_layers_names_the_next_layer():
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(4, name="first")(inputs)
        exploded = keras.ops.exp(hidden * 40.0)  # not a layer: no watched call
        outputs = keras.layers.Dense(1, name="second", dtype="float32")(exploded)
        model = tfmixprec.MixedPrecisionModel(inputs, outputs)
        model.compile(optimizer="sgd", loss="mse")
    x = np.abs(np.random.default_rng(0).normal(size=(4, 8))).astype("float32")
    diagnosis = tfmixprec.explain_overflow(model, (x, np.ones((4, 1), "float32")))
    assert diagnosis.cause == "forward-overflow"
    assert diagnosis.layer == "second"
    assert "an operation before it that is not a layer" in diagnosis.message


def test_sample_weights_with_a_string_loss():
    model = _model()
    x, y = _batch()
    weighted = tfmixprec.explain_overflow(model, (x, y, np.array([0.0, 0.0, 2.0, 2.0])))
    plain = tfmixprec.explain_overflow(model, (x, y))
    assert weighted.cause == plain.cause
    assert weighted.loss == plain.loss  # equal rows: weights (0, 0, 2, 2) average to 1
    halved = tfmixprec.explain_overflow(model, (x, y, np.array([0.0, 0.0, 1.0, 1.0])))
    assert halved.loss == plain.loss / 2


@pytest.fixture(scope="module")
def refusing_model():
    """One `_model()` for the calls below, each refused before it replays anything."""
    return _model()


@pytest.mark.parametrize("scale", ["big", float("nan"), 0.0, -1.0, float("inf"), True, 1e39, 1e-50])
def test_bad_scale(refusing_model, scale):
    with pytest.raises(ValueError, match=r"scale must be a number in float32's normal range"):
        tfmixprec.explain_overflow(refusing_model, _batch(), scale=scale)


def test_bad_loss_fn_labels_and_uncompiled_model(refusing_model):
    with pytest.raises(TypeError, match="loss_fn must be a callable.*Received: loss_fn='mse'"):
        tfmixprec.explain_overflow(refusing_model, _batch(), loss_fn="mse")
    with pytest.raises(ValueError, match="batch must hold labels"):
        tfmixprec.explain_overflow(refusing_model, (_batch()[0], None))
    uncompiled = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)], name="bare")
    with pytest.raises(ValueError, match="model 'bare' is not compiled with one"):
        tfmixprec.explain_overflow(uncompiled, _batch())


def test_overflow_scale_without_a_recorded_scale_is_the_current_one():
    model = _model(scale=64.0)
    optimizer = model.optimizer
    optimizer.consecutive_overflows.assign(1)  # as restored from a checkpoint without it
    assert optimizer.overflow_scale() == 64.0


@pytest.mark.parametrize("jit_compile", ["auto", True])
def test_callbacks_replay_overflow_steps_automatically(tmp_path, capsys, jit_compile):
    """Keras's default "auto" (XLA on a GPU, none on a CPU) and XLA: the step keeps the
    batches on the device, and the replays are the same."""
    model, x, y = bad_run_model(jit_compile=jit_compile)
    monitor = tfmixprec.LossScaleMonitor(verbose=1, update_freq=100, diagnose=3)
    board = tfmixprec.TensorBoard(str(tmp_path), update_freq=1, diagnose=1)
    fit = dict(batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[monitor, board])
    model.fit(x, y, **fit)
    found = [(step, d.cause, d.layer, d.loss_scale) for step, d in monitor.diagnoses]
    assert found == [  # the cap: 3 of the 4 overflow steps
        (1, "forward-overflow", "big", 8.0),
        (3, "bad-data", None, 4.0),
        (5, "forward-overflow", "big", 2.0),
    ]
    printed = [line for line in capsys.readouterr().out.splitlines() if "0-based" in line]
    assert printed[1].startswith("overflow step 3 (0-based, skipped steps counted): bad-data")
    acc = event_accumulator.EventAccumulator(
        str(tmp_path / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    texts = [
        (e.step, e.tensor_proto.string_val[0].decode())
        for e in acc.Tensors("mixed_precision/diagnosis")
    ]
    assert [step for step, _ in texts] == [1]  # its own cap: 1, at the step it happened
    assert texts[0][1].startswith("**forward-overflow** in `big`")
    model.fit(x, y, **fit)  # the cap is per fit
    assert len(monitor.diagnoses) == 6


@pytest.mark.parametrize("compiled", ["keras", "tfmixprec"])
def test_diagnose_on_a_plain_keras_model(compiled):
    """A plain keras.Model compiled the Keras way (its LossScaleOptimizer adopted by the
    callback) or with a tfmixprec one: the step keeps its overflow batches the same way."""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, name="big")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1, name="out", dtype="float32")(hidden))
        if compiled == "keras":
            optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), 8.0)
        else:
            optimizer = tfmixprec.LossScaleOptimizer("sgd", initial_scale=8.0)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    _, x, y = bad_run_model()
    monitor = tfmixprec.LossScaleMonitor(diagnose=2)
    model_class = type(model)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[monitor])
    found = [(step, d.cause, d.layer, d.loss_scale) for step, d in monitor.diagnoses]
    assert found == [(1, "forward-overflow", "big", 8.0), (3, "bad-data", None, 4.0)]
    # The keeping ends with the fit: the step is traced again without it (an adopted Keras
    # optimizer leaves the state guard on the step: a skipped step changes no variable).
    assert not _keeping(model) and type(model) is model_class
    before = len(monitor.diagnoses)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert len(monitor.diagnoses) == before


def test_diagnose_without_loss_scaling_has_nothing_to_replay():
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_bfloat16"):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer="sgd", loss="mse")
    _, x, y = bad_run_model()
    monitor = tfmixprec.LossScaleMonitor(diagnose=2)
    model.fit(x[:24], y[:24], batch_size=8, verbose=0, callbacks=[monitor])
    assert monitor.diagnoses == [] and not _keeping(model)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_keeping_overflow_batches_keeps_the_data_and_stops(jit_compile):
    model, x, y = bad_run_model(jit_compile=jit_compile)
    keeper = model.keep_overflow_batches(1)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    (kept,) = keeper.kept
    assert (kept.step, kept.scale) == (1, 8.0)
    np.testing.assert_array_equal(kept.batch[0], x[8:16])
    np.testing.assert_array_equal(kept.batch[1], y[8:16])
    assert kept.batch[2] is None
    assert model.keep_overflow_batches(0) is None
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert len(keeper.kept) == 1  # no longer kept


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_ragged_last_batch_is_kept_as_it_was(jit_compile):
    """The slots hold the largest batch; a smaller last batch that overflows comes back with
    its own rows, with XLA too (the rows keep their size within a step)."""
    model, x, y = bad_run_model(jit_compile=jit_compile)
    x, y = x[:30], y[:30]  # batches of 8, 8, 8 and 6; the last holds the NaN
    keeper = model.keep_overflow_batches(3)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    first, last = keeper.kept
    assert (first.step, last.step) == (1, 3) and (first.scale, last.scale) == (8.0, 4.0)
    np.testing.assert_array_equal(first.batch[0], x[8:16])
    np.testing.assert_array_equal(last.batch[0], x[24:30])  # NaN included, 6 rows
    np.testing.assert_array_equal(last.batch[1], y[24:30])
    (latest,) = keeper.latest
    assert latest.step == 3 and latest.batch[0].shape == (6, 8)
    assert model.jit_compile is jit_compile  # the model's own setting, as it was


def test_automatic_diagnosis_bad_input():
    with pytest.raises(ValueError, match=r"diagnose must be an int >= 0.*Received: diagnose=-1"):
        tfmixprec.LossScaleMonitor(diagnose=-1)
    with pytest.raises(ValueError, match="Received: diagnose=True"):
        tfmixprec.TensorBoard("logs", diagnose=True)
    model, x, y = bad_run_model()
    with pytest.raises(ValueError, match="limit must be an int >= 0. Received: limit=-2"):
        model.keep_overflow_batches(-2)


class _RaiseAt(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.at = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at:
            raise RuntimeError("stop here")


def test_a_failed_fit_leaves_no_keeping_behind():
    model, x, y = bad_run_model()
    monitor = tfmixprec.LossScaleMonitor(diagnose=2)
    with pytest.raises(RuntimeError, match="stop here"):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[monitor, _RaiseAt(1)])
    fresh = tfmixprec.LossScaleMonitor(diagnose=1)
    x2 = x.copy()
    x2[9, 0] = 0.0  # this time only the NaN batch (3) overflows
    model.fit(x2, y, batch_size=8, shuffle=False, verbose=0, callbacks=[fresh])
    assert [(d.cause) for _, d in fresh.diagnoses] == ["bad-data"]  # not the old batch 1


def test_a_batch_that_cannot_be_replayed_never_stops_training():
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        first = keras.layers.Dense(1, name="o1", dtype="float32")(inputs)
        second = keras.layers.Dense(1, name="o2", dtype="float32")(inputs)
        model = tfmixprec.MixedPrecisionModel(inputs, {"o1": first, "o2": second})
        model.compile(optimizer="sgd", loss={"o1": "mse", "o2": "mae"}, jit_compile=False)
    x = np.ones((16, 8), "float32")
    x[1, 0] = np.nan
    y = {"o1": np.ones((16, 1), "float32"), "o2": np.ones((16, 1), "float32")}
    monitor = tfmixprec.LossScaleMonitor(diagnose=2)
    with pytest.warns(
        RuntimeWarning, match="could not replay overflow step 0, so diagnose= is off"
    ):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[monitor])
    assert monitor.diagnoses == []
    assert model.optimizer.read_state()["iterations"] == 1  # the second batch trained


def test_diagnose_where_batches_cannot_be_kept_warns_and_trains():
    model, x, y = bad_run_model()
    model.compile(
        optimizer=tfmixprec.LossScaleOptimizer("sgd", accumulation_steps=2),
        loss="mse",
        jit_compile=False,
    )
    with pytest.raises(ValueError, match="Received: accumulation_steps=2"):
        model.keep_overflow_batches(1)
    monitor = tfmixprec.LossScaleMonitor(diagnose=2)
    with pytest.warns(RuntimeWarning, match="diagnose= is off for this fit"):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[monitor])
    assert monitor.diagnoses == [] and model.optimizer.read_state()["overflow_steps"] >= 1


def _keeping(model):
    """Whether the model's step is wrapped to keep overflow batches."""
    return hasattr(vars(model).get("train_step"), "_tfmixprec_replaced_step")


def _plain_bad_run_model():
    """`bad_run_model`'s layers in a plain keras.Model with a tfmixprec optimizer."""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, name="big")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1, name="out", dtype="float32")(hidden))
        optimizer = tfmixprec.LossScaleOptimizer("sgd", initial_scale=8.0)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    model.optimizer.build(model.trainable_variables)  # before fit: the step traced once
    return model


@pytest.mark.usefixtures("fit_left_early")  # the fit raises: Keras's cycle
def test_diagnose_after_a_fit_that_raised_on_a_plain_model():
    """Keras skips on_train_end when fit raises: the next fit's callbacks replace the keeper
    the failed fit left (full), instead of reusing it."""

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise RuntimeError("stop here")

    model = _plain_bad_run_model()
    _, x, y = bad_run_model()
    fit = dict(batch_size=8, shuffle=False, verbose=0)
    with pytest.raises(RuntimeError, match="stop here"):
        model.fit(x, y, **fit, callbacks=[tfmixprec.LossScaleMonitor(diagnose=1), Stop()])
    clean = x.copy()
    clean[9, 0] = 0.0  # only batch 3 (a NaN) overflows now
    monitor = tfmixprec.LossScaleMonitor(diagnose=1)
    model.fit(clean, y, **fit, callbacks=[monitor])
    assert [(step, d.cause) for step, d in monitor.diagnoses] == [(5, "bad-data")]
    assert not _keeping(model)


def test_diagnose_keeps_a_train_step_set_on_the_instance():
    model = _plain_bad_run_model()
    base = type(model).train_step

    def own_step(data):
        logs = base(model, data)
        logs["own"] = keras.ops.convert_to_tensor(1.0)
        return logs

    model.train_step = own_step
    _, x, y = bad_run_model()
    history = model.fit(
        x,
        y,
        batch_size=8,
        shuffle=False,
        verbose=0,
        callbacks=[tfmixprec.LossScaleMonitor(diagnose=1)],
    )
    assert "own" in history.history  # the user's step ran, wrapped
    # After the fit: the user's step, inside the state guard the adoption of Keras's
    # LossScaleOptimizer put around it for good (a skipped step changes no variable); the
    # diagnosis's keeping is gone.
    step = vars(model)["train_step"]
    assert step.tfmixprec_guarded and step.__wrapped__ is own_step


def test_a_layer_called_twice_is_judged_by_the_call_that_overflowed():
    """The shared layer's first call reaches 80000 (float16's inf), its second 8: the advice
    reads the first call's float32 replay, and the row holds both calls."""
    tfmixprec.set_policy("mixed_float16")
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(4, use_bias=False, kernel_initializer="ones", name="shared")
    big = shared(keras.layers.Rescaling(200.0)(inputs))
    small = shared(keras.layers.Rescaling(0.02)(inputs))
    joined = keras.layers.Concatenate()([big, small])
    model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32", name="out")(joined))
    model.compile(optimizer="sgd", loss="mse")
    x = np.full((2, 4), 100.0, "float32")
    diagnosis = tfmixprec.explain_overflow(model, (x, np.ones((2, 1), "float32")))
    assert (diagnosis.cause, diagnosis.layer) == ("forward-overflow", "shared")
    assert "its outputs reach 8e+04 in float32, past float16's 65504" in diagnosis.message
    (row,) = [r for r in diagnosis.layers if r.layer == "shared"]
    assert (row.inf, row.max_abs, row.float32_max_abs) == (8, 8.0, 80000.0)


def test_several_overflow_steps_in_one_execution_are_all_kept():
    """With steps_per_execution=4 the callbacks run once per 4 steps: the step keeps the
    batches of the first N overflow steps itself, not the host between executions."""
    model, x, y = bad_run_model(steps_per_execution=4)
    keeper = model.keep_overflow_batches(2)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert [(k.step, k.scale) for k in keeper.kept] == [(1, 8.0), (3, 4.0)]
    np.testing.assert_array_equal(keeper.kept[1].batch[0], x[24:32])


def test_an_eager_step_keeps_its_batches_too():
    model, x, y = bad_run_model(run_eagerly=True)
    keeper = model.keep_overflow_batches(1)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    (kept,) = keeper.kept
    assert kept.step == 1
    np.testing.assert_array_equal(kept.batch[0], x[8:16])


@pytest.mark.parametrize("traced", [False, True])
def test_a_batch_of_strings_comes_back_as_it_was(traced):
    """A tensor of strings (a model that tokenizes inside its step) is kept as the bytes of
    its `TensorProto`, beside the batch's numbers, and comes back equal, eagerly and traced."""
    model, _, _ = bad_run_model()
    keeper = tfmixprec.OverflowBatches(2)
    text = tf.constant([["a", "éé"], ["", "a longer string"]])
    numbers = tf.constant([[1.5], [-2.0]])

    def keep(x, y):
        keeper.keep_if_overflow((x, y), tf.constant(True), model.optimizer)

    (tf.function(keep) if traced else keep)(text, numbers)
    (kept,) = keeper.kept
    got_text, got_numbers, weight = kept.batch
    assert weight is None and got_text.dtype == object and got_text.shape == (2, 2)
    assert got_text.tolist() == [[b"a", "éé".encode()], [b"", b"a longer string"]]
    np.testing.assert_array_equal(got_numbers, numbers.numpy())


def test_a_batch_that_is_not_dense_is_said_and_not_kept():
    model, _, _ = bad_run_model()
    keeper = tfmixprec.OverflowBatches(1)
    ragged = (tf.ragged.constant([[1.0], [2.0, 3.0]]), tf.ones((2, 1)))
    with pytest.warns(UserWarning, match="batches are not kept: a RaggedTensor in the batch"):
        keeper.keep_if_overflow(ragged, tf.constant(True), model.optimizer)
    assert keeper.seen == 0 and keeper.kept == [] and keeper.latest == []
    dense = tfmixprec.OverflowBatches(1)
    dense.keep_if_overflow((tf.ones((2, 3)), tf.ones((2, 1))), tf.constant(True), model.optimizer)
    with pytest.warns(UserWarning, match="a batch of another structure or dtype than the first"):
        dense.keep_if_overflow(
            (tf.ones((2, 3), tf.float16), tf.ones((2, 1))), tf.constant(True), model.optimizer
        )
    assert dense.seen == 1  # the first batch, kept before


def test_a_fit_on_batches_of_another_structure_keeps_again_after_its_next_overflow():
    """A second `MixedPrecisionModel.fit` on `(x, y, sample_weight)` batches, where the first
    kept `(x, y)`: said, with what happens; the keeper starts again after that fit's first
    overflow step (step 5, not kept; the first fit's batches dropped) and keeps step 7."""
    model, x, y = bad_run_model()
    keeper = model.keep_overflow_batches(2)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert [k.step for k in keeper.kept] == [1, 3]
    said = "MixedPrecisionModel.fit starts the keeper again after the next overflow step"
    with pytest.warns(UserWarning, match=said):
        model.fit(x, y, sample_weight=np.ones(32), batch_size=8, shuffle=False, verbose=0)
    assert [k.step for k in keeper.kept] == [7] and keeper.seen == 1
    batch = keeper.kept[0].batch
    np.testing.assert_array_equal(batch[0], x[24:32])
    np.testing.assert_array_equal(batch[2], np.ones(8))


def test_repair_joining_diagnose_in_a_later_fit_keeps_both():
    """A dormant keeper traced for diagnose= alone holds no newest batch: when a later fit
    adds PrecisionRepair, it makes its slots again with it, and both callbacks work."""
    model, x, y = bad_run_model()
    x[9, 0] = 0.0  # only the NaN batch overflows in the first fit
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0,
              callbacks=[tfmixprec.LossScaleMonitor(diagnose=1)])  # fmt: skip
    monitor = tfmixprec.LossScaleMonitor(diagnose=1)
    repair = tfmixprec.PrecisionRepair(max_consecutive=1, verbose=0)
    x[9, 0] = 1e6
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[monitor, repair])
    assert [(step, d.cause) for step, d in monitor.diagnoses] == [(5, "forward-overflow")]
    assert [(j.step, j.layers) for j in repair.judgments][:1] == [(5, ("big",))]


def test_xla_with_several_replicas_cannot_keep_batches(two_cpu_strategy):
    with two_cpu_strategy.scope(), tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        model = tfmixprec.MixedPrecisionModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with pytest.raises(ValueError, match="with 2 replicas needs a step without XLA"):
        model.keep_overflow_batches(1)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_batch_of_unknown_size_and_batches_that_grow(jit_compile):
    """A `tf.data` batch declares no size, and each batch here is longer than the one before
    (sequences sorted by length): the rows grow in the step, and every overflow is kept."""
    model, x, y = bad_run_model(jit_compile=jit_compile)
    x[1, 0] = 1e6  # batch 0 overflows too
    sizes = [4, 8, 8, 12]  # the NaN row 25 in the last and longest
    starts = np.cumsum([0, *sizes])

    def batches():
        for start, size in zip(starts, sizes):
            yield x[start : start + size], y[start : start + size]

    spec = (tf.TensorSpec([None, 8]), tf.TensorSpec([None, 1]))
    keeper = model.keep_overflow_batches(4)
    model.fit(tf.data.Dataset.from_generator(batches, output_signature=spec), verbose=0)
    assert keeper.missed == 0
    kept = keeper.kept
    for k in kept:
        start, size = starts[k.step], sizes[k.step]
        np.testing.assert_array_equal(k.batch[0], x[start : start + size])
    assert [k.step for k in kept] == [0, 1, 3]


def test_a_keeper_inside_an_xla_step_keras_built_grows_between_steps():
    """`keep_overflow_batches`, then a `compile()`: Keras builds the XLA step itself, and the
    keeper runs inside it with rows of fixed size. A batch larger than any before is not kept
    (said), the rows grow between steps, and the next overflow is kept."""
    model, x, y = bad_run_model()
    x[1, 0] = 1e6  # batch 0 overflows too
    keeper = model.keep_overflow_batches(3)
    model.compile(
        optimizer=tfmixprec.LossScaleOptimizer("sgd", initial_scale=8.0),
        loss="mse",
        jit_compile=True,
    )
    with pytest.warns(RuntimeWarning, match="1 overflow step.s. not kept for a replay"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0)
    assert keeper.missed == 1
    assert [k.step for k in keeper.kept] == [1, 3]
    np.testing.assert_array_equal(keeper.kept[0].batch[0], x[8:16])


def test_a_loss_in_its_own_float16_dtype_is_named_as_such():
    model = loss_model()
    x, y = loss_data(8)
    diagnosis = tfmixprec.explain_overflow(model, (x, y))
    assert (diagnosis.cause, diagnosis.layer) == ("loss-overflow", None)
    assert diagnosis.message == (
        "the predictions are finite but the loss is not (inf): it computes in float16, its own "
        "dtype (a keras.losses.Loss built with dtype='float16'), and overflows by itself. Build "
        "it with dtype='float32' (calibrate and PrecisionRepair set it so)."
    )
