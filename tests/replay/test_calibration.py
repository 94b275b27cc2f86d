"""calibrate: the smallest float32 set on models built to show each case, the starting scale,
apply, and a replay that changes nothing."""

import dataclasses
import json
import re

import keras
import numpy as np
import pytest
from overflow_models import C, loss_data, loss_model
from overflow_models import data as _data
from overflow_models import model as _model

import tfmixprec
from tfmixprec._common.layers import iter_layers, layer_names
from tfmixprec.replay.calibration import Replayer, calibration_batches

_BIG = keras.initializers.Constant(10000.0)


def _state(model):
    model.optimizer.build(model.trainable_variables)
    values = [v.numpy().tobytes() for v in model.weights + list(model.optimizer.variables)]
    return values, [layer.dtype_policy.name for layer in model.layers]


EXPECTED = {
    "flows": ("big", "proj"),
    "norm": ("big",),
    "residual": ("big", "add"),
    "attention": ("mha/softmax", "mha/key", "mha/attention_output"),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_the_float32_set_is_exact_and_minimal(kind):
    model = _model(kind)
    before = _state(model)
    report = tfmixprec.calibrate(model, _data(kind), steps=1, batch_size=32)
    assert _state(model) == before  # nothing changed: weights, slots, scale, policies
    # Keras numbers the names it makes up (the attention's "softmax") across the process.
    found = tuple(re.sub(r"_\d+$", "", name) for name in report.float32_layers)
    assert (found, report.cause) == (EXPECTED[kind], "forward-overflow")
    # Minimal: finite with the set, not finite without any one of its layers.
    layers = {layer_names(model)[id(layer)]: layer for layer in iter_layers(model)}
    chosen = [layers[path] for path in report.float32_layers]
    replayer = Replayer(
        model, calibration_batches(_data(kind), 1, 32), keras.losses.MeanSquaredError()
    )
    assert not replayer.finite_at(1.0, [])
    assert replayer.finite_at(1.0, chosen)
    for left_out in chosen:
        assert not replayer.finite_at(1.0, [layer for layer in chosen if layer is not left_out])


def test_the_reasons_name_the_values():
    report = tfmixprec.calibrate(_model("flows"), _data("flows"), steps=1)
    big, proj = report.reasons
    assert big.startswith("its outputs reach ") and big.endswith(", past float16's 65504")
    assert float(big.split()[3].rstrip(",")) > 65504
    assert proj.startswith("it receives values up to ") and proj.endswith("casts them to float16")


def test_a_gradient_that_overflows_even_unscaled_takes_its_layer():
    """Large targets: `after`'s kernel gradient (a sum over the batch) passes 65504 in
    float16, while the gradient it passes back (through a small kernel) stays in range."""
    model = _model("norm")
    x, _ = _data("norm")
    for name, value in (("big", 0.1), ("after", 1e-3), ("out", 1.0)):  # forward in range
        kernel = model.get_layer(name).kernel
        kernel.assign(np.full(kernel.shape, value, "float32"))
    report = tfmixprec.calibrate(model, (x, np.full((32, 1), 8e4, "float32")), steps=1)
    assert (report.cause, report.float32_layers) == ("backward-overflow", ("after",))
    assert report.reasons == ("its gradients are not finite in float16 even unscaled",)


def test_initial_scale_follows_the_largest_gradient_and_counts_keras_skips():
    model = _model("norm")
    big = model.get_layer("big")
    big.kernel.assign(np.full(big.kernel.shape, 0.1, "float32"))
    x, y = _data("norm")[0], np.ones((32, 1), "float32")
    report = tfmixprec.calibrate(model, (x, y), steps=1)
    assert report.float32_layers == ()
    # The paper's rule with the stated margin: the largest power of two S with g * S * 8 <=
    # 65504, verified finite on the batches.
    expected = 2.0 ** np.floor(np.log2(65504 / (report.gradient_max * 8)))
    assert report.initial_scale == expected < 2.0**15
    assert report.start_skips == 0 and report.keras_start_skips > 0
    # What fit does from the start: from Keras's 2^15 the first `keras_start_skips` steps
    # are skipped (the same batch again: a skipped step changes no weight) and the next is
    # applied; from the calibrated scale none is skipped.
    skips = report.keras_start_skips
    for apply in (False, True):
        trial = _model("norm")
        trial.set_weights(model.get_weights())
        if apply:
            report.apply(trial)
        trial.optimizer.build(trial.trainable_variables)  # before fit: the step traced once
        trial.fit(x, y, batch_size=32, epochs=skips + 1, verbose=0)
        state = trial.optimizer.read_state()
        assert (state["overflow_steps"], state["iterations"]) == (
            (0, skips + 1) if apply else (skips, 1)
        )


def test_apply_changes_the_layers_and_the_scale_and_returns_the_changes():
    model = _model("flows")
    report = tfmixprec.calibrate(model, _data("flows"), steps=1)
    changes = report.apply(model)
    assert [(c.layer, c.old, c.new) for c in changes] == [
        ("big", "mixed_float16", "float32"),
        ("proj", "mixed_float16", "float32"),
        ("loss_scale", "32768", tfmixprec.scaling.loss_scale.format_scale(report.initial_scale)),
    ]
    assert model.get_layer("big").compute_dtype == "float32"
    assert float(model.optimizer.loss_scale) == report.initial_scale
    assert model.optimizer.get_config()["initial_scale"] == report.initial_scale
    model.optimizer.build(model.trainable_variables)  # before fit: the step traced once
    history = model.fit(*_data("flows"), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert model.optimizer.read_state()["overflow_steps"] == 0


def test_apply_sets_keras_own_optimizer_before_its_first_step():
    with tfmixprec.policy_scope("mixed_float16"):
        model = _model("flows", optimizer=keras.optimizers.SGD(1e-3))
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    report = tfmixprec.calibrate(model, _data("flows"), steps=1)
    report.apply(model)
    model.fit(*_data("flows"), epochs=1, verbose=0)
    assert float(model.optimizer.dynamic_scale.numpy()) == report.initial_scale


def test_apply_refuses_another_model_and_a_started_optimizer_changing_nothing():
    report = tfmixprec.calibrate(_model("flows"), _data("flows"), steps=1)
    other = _model("norm")
    before = _state(other)
    with pytest.raises(ValueError, match="apply found no layer 'proj' in model"):
        report.apply(other)
    assert _state(other) == before
    started = _model("flows")
    started.optimizer.build(started.trainable_variables)  # before fit: the step traced once
    started.fit(*_data("flows"), epochs=1, verbose=0)
    before = _state(started)
    with pytest.raises(ValueError, match="has taken 1 steps. Pass set_scale=False"):  # skipped
        report.apply(started)
    assert _state(started) == before
    assert [c.layer for c in report.apply(started, set_scale=False)] == ["big", "proj"]
    with pytest.raises(TypeError, match="set_scale"):
        report.apply(started, set_scale=1)


def test_bad_data_is_named_and_not_fixed():
    x, y = _data("flows")
    x[3, 2] = np.nan
    report = tfmixprec.calibrate(_model("flows"), (x, y), steps=1)
    assert (report.cause, report.float32_layers, report.initial_scale) == ("bad-data", (), 1.0)
    assert report.problem.startswith("the batch's inputs hold 1 NaN/Inf values")


def test_a_model_not_finite_in_float32_is_not_a_precision_problem():
    model = _model("norm")
    big = model.get_layer("big")
    big.kernel.assign(np.full(big.kernel.shape, 1e38, "float32"))
    report = tfmixprec.calibrate(model, _data("norm"), steps=1)
    assert (report.cause, report.float32_layers) == ("not-precision", ())
    assert report.problem.startswith("layer 'big' is not finite even in float32")


def test_the_report_prints_and_serializes():
    report = tfmixprec.calibrate(_model("flows"), _data("flows"), steps=1)
    text = str(report).splitlines()
    assert text[0].startswith(f"initial_scale: {int(report.initial_scale)} (largest gradient ")
    assert text[1:] == [
        "float32_layers (forward-overflow):",
        f"  big: {report.reasons[0]}",
        f"  proj: {report.reasons[1]}",
    ]
    data = json.loads(json.dumps(report.to_dict()))
    assert data["float32_layers"] == ["big", "proj"]
    assert [row["layer"] for row in data["layers"]] == ["big", "proj", "after", "out"]
    big = next(row for row in report.layers if row.layer == "big")
    assert big.nonfinite > 0 and big.past_float16 > 0 and big.float32_max_abs > 65504
    assert "| `big` | float16 |" in report.to_markdown()


def test_a_dataset_and_a_kerashub_model():
    pytest.importorskip("keras_hub")  # the minimum-versions run has no KerasHub
    with tfmixprec.policy_scope("mixed_float16"):
        zoo = tfmixprec.zoo.build("gpt2")
    model = zoo.model
    model.compile(tfmixprec.LossScaleOptimizer("adam"), zoo.loss)
    x, y, weights = zoo.data(2)
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(zoo.batch_size)
    before = _state(model)
    report = tfmixprec.calibrate(model, dataset, steps=2)
    assert _state(model) == before
    assert (report.batches, report.float32_layers, report.cause) == (2, (), "none")
    # Every layer has its own name in a report: KerasHub's dropouts, made in their block's
    # __init__, share names across blocks and have no parent in their path.
    keys = layer_names(model)
    assert len(set(keys.values())) == len(keys) == len(iter_layers(model)) + 1
    assert f"{model.backbone.name}/transformer_layer_0/feedforward_dropout" in keys.values()
    assert report.initial_scale == 2.0**15 and report.keras_start_skips == 0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"data": "x.npy"}, TypeError, "data must be a tf.data.Dataset"),
        ({"data": [1, 2, 3, 4]}, ValueError, "needs the labels. Received: a list of 4 items"),
        (
            {"data": (np.zeros((4, 8)), np.zeros((3, 1)))},
            ValueError,
            r"rows \(x, y and sample_weight, as fit takes\)\. Received: arrays of \[3, 4\] rows",
        ),
        ({"data": (np.zeros((4, 8)), None)}, ValueError, "without labels"),
        ({"steps": 0}, ValueError, "steps"),
        ({"batch_size": 2.5}, ValueError, "batch_size"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    arguments = {"data": _data("flows"), **kwargs}
    with pytest.raises(error, match=match):
        tfmixprec.calibrate(_model("flows"), **arguments)


def test_the_report_as_a_tensorboard_text(tmp_path):
    import tensorflow as tf
    from tensorboard.backend.event_processing import event_accumulator

    report = tfmixprec.calibrate(_model("flows"), _data("flows"), steps=1)
    report.write_summary(str(tmp_path))
    events = event_accumulator.EventAccumulator(
        str(tmp_path / "train"), size_guidance={"tensors": 0}
    )
    events.Reload()
    [written] = events.Tensors("mixed_precision/calibration")
    assert written.step == 0
    assert tf.make_ndarray(written.tensor_proto).item().decode() == report.to_markdown()


def test_batch_norm_statistics_and_dropout_seeds_stay():
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, name="big", kernel_initializer=_BIG)(inputs)
        hidden = keras.layers.BatchNormalization(name="bn")(hidden)
        hidden = keras.layers.Dropout(0.5, name="drop")(hidden)
        model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(hidden))
        model.compile(tfmixprec.LossScaleOptimizer("sgd"), "mse")
    before = [v.numpy().tobytes() for v in model.variables]
    policy = keras.config.dtype_policy().name
    report = tfmixprec.calibrate(model, _data("norm"), steps=1)
    assert report.float32_layers == ("big", "bn")  # bn casts its float32 input back
    assert [v.numpy().tobytes() for v in model.variables] == before
    assert keras.config.dtype_policy().name == policy


class _Block(keras.layers.Layer):
    """`x + down(up(x))`: a residual add in the layer's own call, as Transformer blocks do."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(16, name="up", kernel_initializer=_BIG)
        small = keras.initializers.Constant(1e-6)
        self.down = keras.layers.Dense(8, name="down", kernel_initializer=small)

    def call(self, x):
        return x + self.down(self.up(x))


def test_a_layer_whose_call_mixes_dtypes_joins_with_its_sublayers():
    """`down` in float32 returns float32 into the block's `x + ...` with a float16 `x`, which
    TensorFlow refuses: the block joins (its inputs then cast to float32)."""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        model = keras.Model(
            inputs, keras.layers.Dense(1, dtype="float32")(_Block(name="block")(inputs))
        )
        model.compile(tfmixprec.LossScaleOptimizer("sgd"), "mse")
    report = tfmixprec.calibrate(model, _data("norm"), steps=1)
    assert report.cause == "forward-overflow"
    assert report.float32_layers == ("block/up", "block/down", "block")  # its name first
    why = dict(zip(report.float32_layers, report.reasons))
    assert why["block"] == "'block' computes with 'down': its call mixes their dtypes"
    report.apply(model)
    assert np.isfinite(model.predict(_data("norm")[0], verbose=0)).all()


class _Times(keras.Model):
    """A subclassed model whose call multiplies by 30000 between layers (keras.ops)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(16, name="dense")
        self.norm = keras.layers.LayerNormalization(name="norm")
        self.head = keras.layers.Dense(1, name="head", dtype="float32")

    def call(self, x):
        return self.head(self.norm(self.dense(x) * 30000.0))


def test_an_operation_outside_the_layers_moves_nothing():
    with tfmixprec.policy_scope("mixed_float16"):
        model = _Times(name="times")
        model.build((None, 8))
        model.compile(tfmixprec.LossScaleOptimizer("sgd"), "mse")
    report = tfmixprec.calibrate(model, _data("norm"), steps=1)
    assert (report.cause, report.float32_layers) == ("not-precision", ())
    assert report.problem == (
        "an operation outside any layer (keras.ops in a model's call, say) passes float16's "
        "65504 before layer 'norm': cast it to float32 in that call."
    )
    assert [c.layer for c in report.apply(model)] == ["loss_scale"]
    assert all(layer.compute_dtype == "float16" for layer in (model.dense, model.norm))


def test_several_outputs_with_one_compiled_loss():
    """`compile(loss="mse")` on two outputs: the loss of each, summed, as Keras does."""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = {"a": keras.Input((8,), name="a"), "b": keras.Input((8,), name="b")}
        hidden = keras.layers.Dense(16, name="big", kernel_initializer=_BIG)(inputs["a"])
        hidden = keras.layers.LayerNormalization(name="norm")(hidden)
        hidden = keras.layers.Concatenate(name="join")([hidden, inputs["b"]])
        first = keras.layers.Dense(1, name="first", dtype="float32")(hidden)
        second = keras.layers.Dense(3, name="second", dtype="float32")(hidden)
        model = keras.Model(inputs, [first, second])
        model.compile(tfmixprec.LossScaleOptimizer("sgd"), "mse")
    x = {"a": _data("norm")[0], "b": _data("norm")[0]}
    y = [np.zeros((32, 1), "float32"), np.zeros((32, 3), "float32")]
    report = tfmixprec.calibrate(model, (x, y), steps=1)
    assert (report.cause, report.float32_layers) == ("forward-overflow", ("big",))


def test_the_scale_stays_within_the_optimizer_bounds():
    optimizer = tfmixprec.LossScaleOptimizer("sgd", initial_scale=2**10, max_scale=2**12)
    model = _model("flows", optimizer=optimizer)
    report = tfmixprec.calibrate(model, _data("flows"), steps=1)
    assert report.initial_scale <= 2**12
    report.apply(model)
    assert float(model.optimizer.loss_scale) == report.initial_scale
    other = _model("flows")  # a report of another optimizer's bounds: refused, nothing changed
    report = tfmixprec.calibrate(other, _data("flows"), steps=1)
    wide = dataclasses.replace(report, initial_scale=2.0**20)
    bounded = tfmixprec.LossScaleOptimizer("sgd", initial_scale=2**10, max_scale=2**12)
    target = _model("flows", optimizer=bounded)
    before = _state(target)
    with pytest.raises(ValueError, match=r"outside the optimizer's \[min_scale, max_scale\]"):
        wide.apply(target)
    assert _state(target) == before


def test_a_layer_shared_by_the_model_and_a_nested_model_is_named_once():
    keras.utils.set_random_seed(0)
    shared = keras.layers.Dense(8, name="shared")
    inner_in = keras.Input((8,))
    sub = keras.Model(inner_in, shared(inner_in), name="sub")
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(1, name="out")(keras.layers.Add()([shared(inputs), sub(inputs)]))
    model = keras.Model(inputs, outputs)
    keys = layer_names(model)
    assert keys[id(shared)] == "sub/shared" and len(set(keys.values())) == len(keys)


def _unbuilt_state(model):
    """`_state` of a model whose optimizer is not built (building it twice adds variables)."""
    values = [v.numpy().tobytes() for v in model.weights + list(model.optimizer.variables)]
    return values, [layer.dtype_policy.name for layer in model.layers], vars(model.loss).copy()


LOSS_FIX = (
    "the loss overflows in float16: it computes in its own dtype (float16) and is inf on "
    "outputs that are finite, 1.592e+05 in float32"
)


def test_a_loss_that_overflows_in_its_own_dtype_is_named_and_computed_in_float32():
    model = loss_model()
    before = _unbuilt_state(model)
    report = tfmixprec.calibrate(model, loss_data(), steps=2, batch_size=32)
    assert _unbuilt_state(model) == before and model.loss.dtype == "float16"  # no change yet
    assert (report.cause, report.float32_layers, report.problem) == ("loss-overflow", (), None)
    assert report.float32_loss == LOSS_FIX
    assert report.start_skips == 0  # at its start, with the loss in float32
    assert str(report).splitlines()[1:] == ["float32_layers: none", f"float32_loss: {LOSS_FIX}"]
    changes = report.apply(model)
    assert [(c.layer, c.old, c.new) for c in changes[:1]] == [("loss", "float16", "float32")]
    assert changes[0].why == LOSS_FIX and changes[1].layer == "loss_scale"
    assert model.loss.dtype == "float32"
    assert model.evaluate(*loss_data(), verbose=0) == 159201.0


def test_a_loss_that_casts_to_float16_itself_is_named_not_fixed():
    def loss(y_true, y_pred):  # casts to float16 by its own code
        diff = keras.ops.cast(y_pred, "float16") - keras.ops.cast(y_true, "float16")
        return keras.ops.mean(keras.ops.square(diff), axis=-1)

    model = loss_model(loss)
    report = tfmixprec.calibrate(model, loss_data(), steps=1)
    assert (report.cause, report.float32_layers, report.float32_loss) == ("loss-overflow", (), None)
    assert report.problem == (
        "the loss overflows by itself: it is inf on finite outputs, even with every layer in "
        "float32. Its own code computes in float16 (a Loss built with dtype='float16', or a cast "
        "inside it), or the labels are out of range: compute it in float32 and check the labels."
    )
    assert f"not fixed by float32 layers (loss-overflow): {report.problem}" in str(report)
    # A report that moves the loss cannot be applied to a loss without a dtype of its own.
    moving = dataclasses.replace(report, float32_loss=LOSS_FIX)
    before = _unbuilt_state(model)
    with pytest.raises(ValueError, match="compiled with loss=<function .*has no dtype of its own"):
        moving.apply(model)
    assert _unbuilt_state(model) == before


def test_a_plain_function_loss_computes_in_float32_as_fit_does():
    """`compile(loss="mse")` on float16 outputs: Keras computes it in float32 (finite); the
    replay does too, so the forward overflow is repaired, not called a loss overflow."""
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        big = keras.layers.Dense(16, name="big", kernel_initializer=C(10000.0), trainable=False)
        proj = keras.layers.Dense(16, name="proj", kernel_initializer=C(1e-6), trainable=False)
        outputs = keras.layers.Dense(1, name="out")(proj(big(inputs)))  # float16 outputs
        model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(1e-6), "mse")
    report = tfmixprec.calibrate(model, loss_data(8), steps=1, batch_size=8)
    assert (report.cause, report.float32_layers, report.float32_loss) == (
        "forward-overflow",
        ("big", "proj"),
        None,
    )


def test_a_custom_loss_keeps_what_its_config_leaves_out():
    """An unregistered `Loss` subclass with an argument its config does not hold: the float32
    trial is the same loss (its weight kept), not one rebuilt from its config."""

    class Weighted(keras.losses.Loss):
        def __init__(self, weight, **kwargs):
            super().__init__(**kwargs)
            self.weight = weight

        def call(self, y_true, y_pred):
            return self.weight * keras.ops.mean(keras.ops.square(y_pred - y_true), axis=-1)

    model = loss_model(Weighted(0.5, dtype="float16"))  # 0.5 x 159201 still passes 65504
    report = tfmixprec.calibrate(model, loss_data(), steps=1)
    assert report.float32_loss.endswith("is inf on outputs that are finite, 7.96e+04 in float32")
    assert model.loss.dtype == "float16" and model.loss.weight == 0.5
