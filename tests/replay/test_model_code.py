"""A model whose own code mixes dtypes under a mixed policy (issue 39): `explain_overflow`
names the layer, the operation and the line as cause `model-code`, and `calibrate` finds the
fewest layers whose float32 lets the call run. KerasHub's MoE decoders do it in training calls:
their sparse MoE block multiplies the router's float16 softmax by a mask cast to float32."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from overflow_models import tiny_moe

import tfmixprec
from tfmixprec.replay.clash import clash_of

keras_hub = pytest.importorskip("keras_hub")


class Gate(keras.layers.Layer):
    """In training calls, multiplies its input by a mask it casts to float32 by hand, as the
    MoE blocks do in their load-balancing loss."""

    def call(self, x, training=None):
        if not training:
            return x
        mask = keras.ops.cast(keras.ops.ones_like(x), "float32")
        return tf.multiply(x, mask)  # float16 times float32: TensorFlow does not promote

    def compute_output_shape(self, shape):
        return shape


def _gated():
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(4, name="dense")(inputs)
        gated = Gate(name="gate")(hidden)
        outputs = keras.layers.Dense(1, name="out", dtype="float32")(gated)
        model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse")
    return model


LINE = f"tests/replay/test_model_code.py:{Gate.call.__code__.co_firstlineno + 4}"


def _batch(n=4):
    return np.ones((n, 4), "float32"), np.zeros((n, 1), "float32")


def test_the_clash_is_read_eagerly_and_traced_alike():
    model = _gated()
    x, _ = _batch()
    for call in (model, tf.function(model)):
        with pytest.raises((tf.errors.InvalidArgumentError, TypeError)) as raised:
            call(x, training=True)
        clash = clash_of(raised.value, model, [model.get_layer("dense")])
        assert (clash.layer, clash.operation) == (model.get_layer("gate"), "Mul")
        assert clash.dtypes == ("float16", "float32")
        assert clash.where.endswith(LINE)
    assert clash_of(ValueError("no clash"), model, []) is None


def test_explain_overflow_names_the_model_code():
    model = _gated()
    diagnosis = tfmixprec.explain_overflow(model, _batch())
    assert (diagnosis.cause, diagnosis.layer) == ("model-code", "gate")
    where = re.escape(LINE)
    assert re.fullmatch(
        r"the model's own code mixes dtypes in 'gate': Mul of a float16 and a float32 tensor "
        rf"at \S*{where} \(TensorFlow does not promote dtypes\): not a value out of range, the "
        r"model's own code\. Computing the layers around that operation in float32 may let it "
        r"run \(tfmixprec\.calibrate\(model, data\) finds the fewest, or says none does\), or "
        r"cast the tensor in that code\.",
        diagnosis.message,
    )


def test_calibrate_moves_the_layer_that_lets_the_call_run():
    model = _gated()
    report = tfmixprec.calibrate(model, _batch(), steps=1)
    assert (report.cause, report.float32_layers, report.problem) == ("model-code", ("gate",), None)
    assert report.reasons[0].endswith("; with it in float32 the call runs")
    report.apply(model)
    assert model.get_layer("gate").compute_dtype == "float32"
    model.fit(*_batch(), verbose=0)  # runs now


MOE = {
    "mixtral": (
        lambda common: keras_hub.models.MixtralBackbone(**common),
        keras_hub.models.MixtralCausalLM,
        "mixtral_sparse_moe_block",
        "keras_hub/src/models/mixtral/mixtral_decoder.py",
    ),
    "qwen_moe": (
        lambda common: keras_hub.models.QwenMoeBackbone(
            moe_intermediate_dim=32, shared_expert_intermediate_dim=64, **common
        ),
        keras_hub.models.QwenMoeCausalLM,
        "qwen_sparse_moe_block",
        "keras_hub/src/models/qwen_moe/qwen_moe_decoder.py",
    ),
    "qwen3_moe": (
        lambda common: keras_hub.models.Qwen3MoeBackbone(
            moe_intermediate_dim=32, head_dim=8, **common
        ),
        keras_hub.models.Qwen3MoeCausalLM,
        "qwen3_sparse_moe_block",
        "keras_hub/src/models/qwen3_moe/qwen3_moe_decoder.py",
    ),
}


def _moe(name):
    """A tiny KerasHub MoE decoder under mixed_float16, compiled the ordinary way."""
    backbone, task, _, _ = MOE[name]
    model = tiny_moe(backbone, task)
    tokens = np.random.default_rng(0).integers(1, 64, (2, 9)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((2, 8), "int32")}
    return model, (x, tokens[:, 1:])


@pytest.mark.parametrize("name", sorted(MOE))
def test_kerashub_moe_decoders(name):
    model, (x, y) = _moe(name)
    _, _, block, source = MOE[name]
    diagnosis = tfmixprec.explain_overflow(model, (x, y))
    assert (diagnosis.cause, diagnosis.layer) == ("model-code", block)
    assert f"Mul of a float16 and a float32 tensor at {source}:" in diagnosis.message
    report = tfmixprec.calibrate(model, (x, y), steps=1, batch_size=2)
    router = f"{name}_backbone/transformer_layer_0/{block}/sparse_feedforward_gate_dense"
    assert (report.cause, report.float32_layers, report.problem) == ("model-code", (router,), None)
    report.apply(model)
    model.optimizer.build(model.trainable_variables)  # before fit: the step traced once
    history = model.fit(x, y, batch_size=2, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


class Switch(keras.layers.Layer):
    """`Gate` where `mix` is True, else passes its input on: two of one class."""

    def __init__(self, mix, **kwargs):
        super().__init__(**kwargs)
        self.mix = mix

    def call(self, x, training=None):
        if not (training and self.mix):
            return x
        return tf.multiply(x, keras.ops.cast(keras.ops.ones_like(x), "float32"))

    def compute_output_shape(self, shape):
        return shape


def test_the_second_of_two_layers_of_a_class_is_named_when_it_raises():
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((4,))
        hidden = Switch(False, name="quiet")(keras.layers.Dense(4, name="d1")(inputs))
        hidden = Switch(True, name="mixing")(keras.layers.Dense(4, name="d2")(hidden))
        model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(hidden))
    model.compile("sgd", "mse")
    assert tfmixprec.explain_overflow(model, _batch()).layer == "mixing"
    assert tfmixprec.calibrate(model, _batch(), steps=1).float32_layers == ("mixing",)


def test_a_clash_no_float32_layer_fixes_is_named_and_nothing_moves():
    class Counts(keras.layers.Layer):
        """Multiplies by an int32 tensor in every call: float32 does not help."""

        def call(self, x):
            return tf.multiply(x, tf.ones_like(x, dtype="int32"))

        def compute_output_shape(self, shape):
            return shape

    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((4,))
        hidden = Counts(name="counts")(keras.layers.Dense(4, name="dense")(inputs))
        model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(hidden))
    model.compile("sgd", "mse")
    report = tfmixprec.calibrate(model, _batch(), steps=1)
    assert (report.cause, report.float32_layers, report.layers) == ("model-code", (), ())
    assert report.problem.startswith(
        "the model's own code mixes dtypes in 'counts': Mul of a float16 and an int32 tensor"
    )
    assert report.problem.endswith(
        ", and no layer in float32 lets the call run: cast the tensor in that code."
    )


def test_the_layer_is_found_without_kerass_traceback_note():
    """With Keras's traceback filtering off, its error names no layer: the raising layer is
    read from the traceback's frames."""
    model = _gated()
    keras.config.disable_traceback_filtering()
    try:
        diagnosis = tfmixprec.explain_overflow(model, _batch())
    finally:
        keras.config.enable_traceback_filtering()
    assert (diagnosis.cause, diagnosis.layer) == ("model-code", "gate")
