"""The diagnosis, the attribution, calibration and PrecisionRepair on models with float8 layers:
a replay names a float8 layer whose quantization saturates or flushes, with the scale it had;
the attribution names a float8 layer's amax history; a float8 layer that must leave float16
computes in float32 and keeps its quantization (Keras cannot take it back to float16 during
`fit`: the last test shows why)."""

import contextlib
import json

import keras
import numpy as np
import pytest

import tfmixprec
from tfmixprec.precision.float8 import Float8TensorStats, is_float8
from tfmixprec.replay.diagnosis import Float8Replay

C = keras.initializers.Constant
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def _stats(fmt, scale, amax, values, saturated=0, zero=0, flushed=0):
    """A replay's statistics of one tensor (its history always moves in a replay)."""
    return Float8TensorStats(fmt, scale, amax, values, saturated, zero, flushed, True)


def _saturating(scale):
    """`a` (kernel 1/32) -> `b` (float8, kernel 1/32) -> `out` (float32, kernel 1), 32 wide.
    With inputs 1 and labels 0: `b` quantizes inputs 1 (past 448 at an inputs_scale of 1/1024:
    0.4375 once clipped, so the prediction is 14) and the gradient at its output is
    2 * 14 / 4 = 7 a value, times the loss scale (past 57344 at an outputs_grad_scale of 0.5
    from a loss scale of 8192 on)."""
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((32,))
        hidden = keras.layers.Dense(32, name="a", kernel_initializer=C(1 / 32))(inputs)
        hidden = keras.layers.Dense(32, name="b", kernel_initializer=C(1 / 32))(hidden)
        outputs = keras.layers.Dense(1, name="out", dtype="float32", kernel_initializer=C(1.0))(
            hidden
        )
        model = tfmixprec.MixedPrecisionModel(inputs, outputs)
        tfmixprec.float8_layers(model)
        model.compile(tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(0.0), scale), "mse")
    layer = model.get_layer("b")
    layer.inputs_scale.assign(1 / 1024)
    layer.outputs_grad_scale.assign(0.5)
    return model


def _ones(n=4):
    return np.ones((n, 32), "float32"), np.zeros((n, 1), "float32")


def _state(model):
    model.optimizer.build(model.trainable_variables)
    values = [v.numpy().tobytes() for v in model.weights + list(model.optimizer.variables)]
    counts = [(s.inputs, s.kernel, s.outputs_grad) for s in tfmixprec.float8_stats(model)]
    return values, counts, [layer.dtype_policy.name for layer in model.layers]


def test_a_replay_names_the_float8_layer_that_saturates_with_its_scales():
    model = _saturating(8192.0)
    before = _state(model)
    diagnosis = tfmixprec.explain_overflow(model, _ones())
    assert _state(model) == before  # weights, float8 variables and counters, policies
    # b's bias gradient, 4 x 7 x 8192, passes 65504: 2 halvings make it finite.
    assert (diagnosis.cause, diagnosis.halvings, diagnosis.finite_scale) == (
        "backward-overflow",
        2,
        2048.0,
    )
    assert diagnosis.float8 == (
        Float8Replay(
            "b",
            "float8_from_mixed_float16",
            inputs=_stats(E4M3, 1 / 1024, 1.0, 128, saturated=128),
            kernel=_stats(E4M3, 1.0, 1 / 32, 1024),
            outputs_grad=_stats(E5M2, 0.5, 57344.0, 128, saturated=128),
        ),
    )
    assert "In float8, 'b' saturated or flushed values at the scales they had" in str(diagnosis)
    assert str(diagnosis).splitlines()[1] == (
        "float8 layer 'b': inputs (e4m3fn) 100.00% saturated (past 448 x scale 0.0009766), "
        "amax 1; outputs_grad (e5m2) 100.00% saturated (past 57344 x scale 0.5), amax 5.734e+04"
    )
    table = diagnosis.to_markdown()
    assert "| b | outputs_grad | float8_e5m2 | 0.5 | 5.734e+04 | 128 | 100.00% | 0.00% |" in table
    assert "| b | kernel | float8_e4m3fn | 1 | 0.03125 | 1024 | 0.00% | 0.00% |" in table
    as_dict = json.loads(json.dumps(diagnosis.to_dict()))
    assert as_dict["float8"][0]["outputs_grad"]["saturated"] == 128


def test_a_flushing_kernel_and_an_inf_output_gradient():
    model = _saturating(2.0**15)  # 7 x 32768 passes 65504 in float16: an Inf at b's output
    layer = model.get_layer("b")
    kernel = np.full((32, 32), 1 / 32, "float32")
    kernel[0, :] = 2.0**-13  # under e4m3's smallest subnormal (2^-9) at a kernel scale of 1
    layer.kernel.assign(kernel)
    [record] = tfmixprec.explain_overflow(model, _ones()).float8
    assert record.kernel == _stats(E4M3, 1.0, 1 / 32, 1024, zero=32, flushed=32)
    assert record.outputs_grad.amax == np.inf
    assert record.outputs_grad.saturated == 128
    assert "kernel (e4m3fn) 3.12% flushed to 0 at scale 1" in str(record)


def test_a_finite_replay_names_no_float8_layer():
    diagnosis = tfmixprec.explain_overflow(_saturating(16.0), _ones())
    assert (diagnosis.cause, diagnosis.float8) == ("none", ())  # saturated, but not an overflow
    assert "float8" not in diagnosis.to_markdown() and "float8" not in str(diagnosis)


def _forward(strategy=None, float8=True):
    """`b`'s float8 matmul passes 65504 in float16 on rows of 30 (30 x ~100 x 32), and is
    finite in float32; `norm` brings its output back into range."""
    keras.utils.set_random_seed(0)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with tfmixprec.policy_scope("mixed_float16"), scope:
        inputs = keras.Input((32,))
        hidden = keras.layers.Dense(32, name="a", kernel_initializer=C(1 / 32))(inputs)
        big = keras.initializers.RandomUniform(60.0, 140.0, seed=0)
        hidden = keras.layers.Dense(32, name="b", kernel_initializer=big)(hidden)
        hidden = keras.layers.LayerNormalization(name="norm")(hidden)
        hidden = keras.layers.Dense(32, name="c")(hidden)
        outputs = keras.layers.Dense(1, name="out", dtype="float32")(hidden)
        model = keras.Model(inputs, outputs)
        if float8:
            assert [c.layer for c in tfmixprec.float8_layers(model)] == ["b", "c"]
        model.compile(tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(1e-6)), "mse")
    return model


def _overflowing(n=256):
    x = 0.1 * np.random.default_rng(1).normal(size=(n, 32)).astype("float32")
    x[::8] = 30.0  # one row in 8: every batch of 32 overflows in b
    return x, np.zeros((n, 1), "float32")


def test_a_float8_layer_that_passes_65504_is_the_forward_overflow():
    diagnosis = tfmixprec.explain_overflow(_forward(), _overflowing(32))
    assert (diagnosis.cause, diagnosis.layer) == ("forward-overflow", "b")
    assert 'keep its float8 quantization (layer.dtype_policy = "float8_from_float32")' in str(
        diagnosis
    )


def _overflow_fit(strategy=None):
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = _saturating(2.0**15)
    model.fit(*_ones(12), batch_size=4, epochs=1, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_attribution_names_a_float8_amax_history(replicas, two_cpu_strategy):
    """Scales 2^15, 2^14, 2^13: b's output gradient (7 x scale) is Inf in float16 each step,
    and its amax, which Keras keeps as the history's gradient, with it."""
    model = _overflow_fit(two_cpu_strategy if replicas == 2 else None)
    report = tfmixprec.overflow_report(model)
    paths = {v.name: v.path for v in model.get_layer("b").weights}
    b = next(row for row in report.layers if row.layer == "b")
    assert (b.overflow_steps, b.last_step, b.float8) == (3, 2, ("outputs_grad amax history",))
    # Its kernel's gradient stays finite: the quantized output gradient is clipped.
    assert b.variables == (paths["bias"], paths["outputs_grad_amax_history"])
    # Under 2 replicas a's kernel gradient sums 2 rows, not 4: finite.
    assert [(row.layer, row.float8) for row in report.layers] == [("a", ())] * (replicas == 1) + [
        ("b", ("outputs_grad amax history",))
    ]
    history = paths["outputs_grad_amax_history"]
    assert f"`{history}` (float8 outputs_grad amax history) |" in report.to_markdown()
    assert str(report).splitlines()[-1] == (
        "  b: the float8 outputs_grad amax history was not finite (Keras keeps the largest |x| "
        "of the tensor quantized as its gradient)"
    )
    assert report.to_dict()["layers"][-1]["float8"] == ["outputs_grad amax history"]
    by_path = model.optimizer.overflow_report()  # no model: the variables' own marks
    assert [row.float8 for row in by_path.layers] == [row.float8 for row in report.layers]


def test_calibrate_moves_a_float8_layer_to_float32_keeping_its_quantization():
    model = _forward()
    counts = [(s.inputs, s.kernel, s.outputs_grad) for s in tfmixprec.float8_stats(model)]
    report = tfmixprec.calibrate(model, _overflowing(32), steps=1)
    assert report.float32_layers == ("b",)
    assert counts == [(s.inputs, s.kernel, s.outputs_grad) for s in tfmixprec.float8_stats(model)]
    [change, _] = report.apply(model)
    assert (change.layer, change.old, change.new) == (
        "b",
        "float8_from_mixed_float16",
        "float8_from_float32",
    )
    layer = model.get_layer("b")
    assert is_float8(layer) and layer.compute_dtype == "float32"


def _repaired(strategy=None):
    model = _forward(strategy)
    if strategy is None:  # (Keras builds it under a strategy)
        model.optimizer.build(model.trainable_variables)  # before fit: the step traced once
    repair = tfmixprec.PrecisionRepair(verbose=0)
    model.fit(*_overflowing(), batch_size=32, epochs=2, shuffle=False, verbose=0,
              callbacks=[repair])  # fmt: skip
    return model, repair


@pytest.fixture(scope="module")
def repaired_on_one_device():
    """One device's repaired fit, read by the two tests below (neither changes it)."""
    return _repaired()


def test_the_repair_keeps_a_float8_layer_quantized_in_float32(tmp_path, repaired_on_one_device):
    model, repair = repaired_on_one_device
    [found] = repair.repairs
    assert (found.step, found.layers, found.cause, found.float8) == (
        4,
        ("b",),
        "forward-overflow",
        ("b",),
    )
    assert str(found).startswith(
        "PrecisionRepair: step 4: 'b' (float8, quantization kept: float8_from_float32) now "
        "compute in float32 (forward-overflow: 'b': its outputs reach "
    )
    assert "- `b` (float8, quantization kept: float8_from_float32)" in found.to_markdown()
    layer = model.get_layer("b")
    assert (layer.dtype_policy.name, is_float8(layer)) == ("float8_from_float32", True)
    state = model.optimizer.read_state()
    assert (state["overflow_steps"], state["iterations"]) == (5, 11)  # none after the repair
    assert float(layer.inputs_amax_history.numpy()[0]) > 0  # float8 still trained
    path = str(tmp_path / "repaired.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.get_layer("b").dtype_policy.name == "float8_from_float32"
    assert loaded.optimizer.read_state() == state
    x = _overflowing(32)[0]
    assert np.array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_two_replicas_repair_a_float8_layer_as_one_device(two_cpu_strategy, repaired_on_one_device):
    _, one = repaired_on_one_device
    model, two = _repaired(two_cpu_strategy)
    found = [(r.step, r.layers, r.cause, r.float8) for r in one.repairs + two.repairs]
    assert found == [(4, ("b",), "forward-overflow", ("b",))] * 2
    assert model.get_layer("b").dtype_policy.name == "float8_from_float32"


def test_keras_cannot_take_a_float8_layer_back_to_float16_cleanly(tmp_path):
    """Why the repair keeps the quantization: a plain policy makes the layer compute without
    float8, but its float8 variables stay on it (Keras removes none), and the model saved
    then does not load with its optimizer (the reloaded layer has no float8 variables)."""
    model = _forward()
    model.optimizer.build(model.trainable_variables)  # before fit: the step traced once
    model.fit(*_overflowing(64), batch_size=32, epochs=1, shuffle=False, verbose=0)
    layer = model.get_layer("b")
    layer.dtype_policy = "mixed_float16"
    assert not is_float8(layer)
    assert "outputs_grad_amax_history" in [v.name for v in layer.trainable_variables]
    path = str(tmp_path / "unquantized.keras")
    model.save(path)
    with pytest.raises(ValueError, match="nonfinite_steps"):
        keras.models.load_model(path)
