"""The audit's training call (`checks.training_call`): a model that runs in inference and
raises in every training call, because its own code mixes dtypes (KerasHub's MoE decoders
under mixed_float16), fails the audit with a `dtype-clash` error naming the layer and the fix
`calibrate` finds; clean models stay error-free; the model is left as it was."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from cli_runs import run_here
from overflow_models import tiny_moe

import tfmixprec
from tfmixprec._common.layers import iter_layers

keras_hub = pytest.importorskip("keras_hub")


class Gate(keras.layers.Layer):
    """In training calls only, multiplies its input by a mask cast to float32 by hand, as the
    MoE blocks' load-balancing loss does."""

    def call(self, x, training=None):
        if not training:
            return x
        return tf.multiply(x, keras.ops.cast(keras.ops.ones_like(x), "float32"))

    def compute_output_shape(self, shape):
        return shape


LINE = Gate.call.__code__.co_firstlineno + 3  # the multiply


def _gated(cls=keras.Model, policy="mixed_float16"):
    with tfmixprec.policy_scope(policy):
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(4, name="dense")(inputs)
        gated = Gate(name="gate")(hidden)
        outputs = keras.layers.Dense(3, name="out", dtype="float32")(gated)
        model = cls(inputs, outputs)
    model.compile(tfmixprec.LossScaleOptimizer(keras.optimizers.SGD()), "mse")
    return model


def _state(model):
    """Every weight, statistic and optimizer variable of `model`, as bytes."""
    return [v.numpy().tobytes() for v in [*model.variables, *model.optimizer.variables]]


GATE_FIX = (
    "Compute 'gate' in float32 (tfmixprec.calibrate(model, data) finds it, and "
    "report.apply(model) sets it), or cast the tensor in that code."
)


@pytest.mark.parametrize("cls", [keras.Model, tfmixprec.MixedPrecisionModel])
def test_a_clash_in_training_only_is_an_error_with_the_layer_and_the_fix(cls):
    model = _gated(cls)
    model(np.ones((2, 4), "float32"), training=False)  # inference runs
    before = _state(model)
    report = tfmixprec.audit(model)
    assert not report.ok
    (finding,) = report.errors
    assert (finding.code, finding.layer) == ("dtype-clash", "gate")
    assert finding.message.startswith(
        "a training call on a batch of zeros raises: the model's own code mixes dtypes in "
        "'gate': Mul of a float16 and a float32 tensor at "
    )
    assert finding.message.endswith(
        f"test_training_call.py:{LINE} (TensorFlow does not promote dtypes). The model runs in "
        "inference, but every training step raises."
    )
    assert finding.fix == GATE_FIX
    assert _state(model) == before
    assert tfmixprec.calibrate(
        model, (np.ones((2, 4)), np.zeros((2, 3))), steps=1
    ).float32_layers == ("gate",)


def test_a_model_built_in_float32_is_audited_for_its_training_under_a_policy():
    model = _gated(policy="float32")
    assert tfmixprec.audit(model).ok  # float32: no clash
    report = tfmixprec.audit(model, policy="mixed_float16")
    assert [(f.code, f.layer, f.fix) for f in report.errors] == [("dtype-clash", "gate", GATE_FIX)]
    assert model.get_layer("gate").compute_dtype == "float32"  # its policy back


MOE = {
    "mixtral": (
        lambda common: keras_hub.models.MixtralBackbone(**common),
        keras_hub.models.MixtralCausalLM,
        "mixtral_sparse_moe_block",
    ),
    "qwen_moe": (
        lambda common: keras_hub.models.QwenMoeBackbone(
            moe_intermediate_dim=32, shared_expert_intermediate_dim=64, **common
        ),
        keras_hub.models.QwenMoeCausalLM,
        "qwen_sparse_moe_block",
    ),
}


def _moe(name):
    backbone, task, _ = MOE[name]
    return tiny_moe(backbone, task)


@pytest.mark.parametrize("name", sorted(MOE))
def test_a_kerashub_moe_decoder_fails_the_audit(name):
    """The issue's case: the audit passed them; every training call raises."""
    model = _moe(name)
    before = _state(model)
    _, _, prefix = MOE[name]
    # Keras numbers a name taken before in this process (`..._moe_block_1`): the model's own
    block = next(layer.name for layer in iter_layers(model) if layer.name.startswith(prefix))
    (finding,) = tfmixprec.audit(model).errors
    assert (finding.code, finding.layer) == ("dtype-clash", block)
    assert f"mixes dtypes in '{block}': Mul of a float16 and a float32 tensor at " in (
        finding.message
    )
    router = f"{model.backbone.name}/transformer_layer_0/{block}/sparse_feedforward_gate_dense"
    assert finding.fix.startswith(f"Compute {router!r} in float32 (tfmixprec.calibrate(")
    assert _state(model) == before


def test_clean_models_stay_error_free():
    with tfmixprec.policy_scope("mixed_float16"):
        gpt2 = tfmixprec.zoo.build("gpt2", size="tiny")
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        mlp = keras.Model(
            inputs, keras.layers.Dense(4, activation="softmax", dtype="float32")(hidden)
        )
    gpt2.model.compile(tfmixprec.LossScaleOptimizer("adam"), gpt2.loss)
    mlp.compile(tfmixprec.LossScaleOptimizer("adam"), "sparse_categorical_crossentropy")
    for model in (gpt2.model, mlp):
        assert tfmixprec.audit(model).errors == [], model.name


def _audit_command(path):
    """`tfmixprec audit path`, run in this process (`run_here`): its exit code and output."""
    code, out, _ = run_here("audit", str(path))
    return code, out


def test_the_audit_command_fails_a_saved_moe_decoder(tmp_path):
    path = tmp_path / "mixtral.keras"
    _moe("mixtral").save(path)
    code, out = _audit_command(path)
    assert code == 1, out
    (line,) = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert line.startswith("ERROR   dtype-clash [mixtral_sparse_moe_block")
    assert "every training step raises" in line


class Counts(keras.layers.Layer):
    """In training calls only, multiplies by an int32 tensor: no layer in float32 helps."""

    def call(self, x, training=None):
        return tf.multiply(x, tf.ones_like(x, dtype="int32")) if training else x

    def compute_output_shape(self, shape):
        return shape


def test_a_clash_no_float32_layer_fixes_says_to_cast():
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((4,))
        hidden = Counts(name="counts")(keras.layers.Dense(4, name="hidden")(inputs))
        model = keras.Model(inputs, keras.layers.Dense(1, name="out", dtype="float32")(hidden))
    model.compile(tfmixprec.LossScaleOptimizer(keras.optimizers.SGD()), "mse")
    (finding,) = tfmixprec.audit(model).errors
    assert (finding.code, finding.layer) == ("dtype-clash", "counts")
    assert "Mul of a float16 and an int32 tensor" in finding.message
    assert finding.fix == (
        "Cast the tensor to the other dtype in that code: no layer in float32 helps."
    )
