"""KerasHub's T5 under mixed_float16 (issue 39): NaN from the first forward pass, with no
activation past 65504. Its attention builds the mask bias as `(1 - mask) * -1e9` in the
compute dtype, and -1e9 is -inf in float16; `explain_overflow` names that operation and says
it is the model's own code."""

import re

import numpy as np
import pytest

import tfmixprec
from tfmixprec._keras.op_watch import first_nonfinite_op

keras_hub = pytest.importorskip("keras_hub")
import keras  # noqa: E402


def _t5():
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        backbone = keras_hub.models.T5Backbone(
            vocabulary_size=100,
            num_layers=2,
            num_heads=2,
            hidden_dim=32,
            intermediate_dim=64,
            dropout=0.0,
        )
        model = keras_hub.models.T5Seq2SeqLM(backbone=backbone, preprocessor=None)
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = {
        "encoder_token_ids": rng.integers(1, 100, (2, 8)).astype("int32"),
        "encoder_padding_mask": np.ones((2, 8), "int32"),
        "decoder_token_ids": rng.integers(1, 100, (2, 8)).astype("int32"),
        "decoder_padding_mask": np.ones((2, 8), "int32"),
    }
    return model, (x, rng.integers(1, 100, (2, 8)).astype("int32"))


def test_t5_names_the_constant_of_its_own_code():
    model, batch = _t5()
    assert np.isnan(np.asarray(model(batch[0]), "float32")).all()  # from the first pass
    diagnosis = tfmixprec.explain_overflow(model, batch)
    assert (diagnosis.cause, diagnosis.layer) == (
        "forward-overflow",
        "transformer_encoder_layer_0/self_attention",
    )
    assert "a value inside it is not finite, though its output is finite in float32" in (
        diagnosis.message
    )
    assert re.search(  # the line depends on the keras-hub release
        r"The first float16 operation that is not finite is Mul at "
        r"keras_hub/src/models/t5/t5_multi_head_attention\.py:\d+: one of its inputs is a "
        r"constant too large for float16, so it is the model's own code, not float16's range "
        r"of its values\. Compute that layer in float32, or use a constant float16 holds\.$",
        diagnosis.message,
    )


def test_the_operation_watch_tells_a_constant_from_a_range():
    x = keras.ops.convert_to_tensor(np.full((2, 2), 300.0, "float16"))
    range_op = first_nonfinite_op(lambda: keras.ops.multiply(x, x))  # 90000 > 65504
    assert (range_op.operation, range_op.dtype) == ("Mul", "float16")
    assert (range_op.inputs_finite, range_op.constant) == (True, False)
    assert range_op.where.endswith("tests/replay/test_t5.py:" + str(_line("range_op =")))
    huge = keras.ops.convert_to_tensor(np.float16(-1e9))  # -inf: no operation made it
    constant_op = first_nonfinite_op(lambda: keras.ops.multiply(x, huge))
    assert (constant_op.inputs_finite, constant_op.constant) == (False, True)
    assert first_nonfinite_op(lambda: keras.ops.multiply(x, 2.0)) is None


def _line(text):
    """The line of this file that holds `text`."""
    lines = open(__file__).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_the_audit_names_the_first_layer_and_operation_that_are_not_finite():
    model, _ = _t5()
    report = tfmixprec.audit(model)
    [finding] = [f for f in report.findings if f.code == "nonfinite-output"]
    assert (finding.severity, finding.layer) == ("error", "self_attention")
    assert re.fullmatch(
        r"a call on a batch of zeros returns NaN/Inf in float16: the first layer whose output "
        r"is not finite is 'transformer_encoder_layer_0/self_attention', and its "
        r"Mul at keras_hub/src/models/t5/t5_multi_head_attention\.py:\d+ is given a constant "
        r"too large for float16: the model's own code, not float16's range of its values\.",
        finding.message,
    )
    with tfmixprec.policy_scope("mixed_bfloat16"):  # bfloat16 holds -1e9: nothing to say
        assert not [
            f
            for f in tfmixprec.audit(model, policy="mixed_bfloat16").findings
            if f.code == "nonfinite-output"
        ]


def test_nan_on_zeros_in_float32_too_is_not_the_precisions():
    """`x / sum(x)` is 0/0 on a batch of zeros in any dtype: no nonfinite-output error."""

    class SumNorm(keras.layers.Layer):
        def call(self, x):
            return x / keras.ops.sum(x, axis=-1, keepdims=True)

    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(8, name="dense")(SumNorm(name="norm")(inputs))
        model = keras.Model(inputs, keras.layers.Dense(1, dtype="float32", name="out")(hidden))
    assert [f.code for f in tfmixprec.audit(model).errors if f.code == "nonfinite-output"] == []
