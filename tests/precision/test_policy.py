"""Tests of the policy helper: set/choose policies and float32 outputs."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec import GPUInfo, HardwareInfo
from tfmixprec._common.layers import iter_layers
from tfmixprec._keras.settings import global_policy, restore_global_policy

V100 = GPUInfo("Tesla V100-SXM2-16GB", (7, 0))
T4 = GPUInfo("Tesla T4", (7, 5))
A100 = GPUInfo("NVIDIA A100-SXM4-40GB", (8, 0))
H100 = GPUInfo("NVIDIA H100 80GB HBM3", (9, 0))
P100 = GPUInfo("Tesla P100-PCIE-16GB", (6, 0))
AMX_CPU = HardwareInfo(cpu_name="Xeon SPR", cpu_flags=frozenset({"avx512f", "amx_bf16"}))


@pytest.mark.parametrize(
    "hardware, expected, reason_part",
    [
        (HardwareInfo(gpus=(V100,)), "mixed_float16", "compute capability 7.0"),
        (HardwareInfo(gpus=(T4,)), "mixed_float16", "compute capability 7.5"),
        (HardwareInfo(gpus=(A100,)), "mixed_bfloat16", "8.0 (>= 8.0)"),
        (HardwareInfo(gpus=(H100, H100)), "mixed_bfloat16", "9.0"),
        (HardwareInfo(gpus=(A100, V100)), "mixed_float16", "7.0"),  # weakest decides
        (HardwareInfo(gpus=(P100,)), "float32", "no Tensor Cores"),
        (HardwareInfo(gpus=(GPUInfo("Mystery GPU"),)), "float32", "unknown compute"),
        (HardwareInfo(tpus=8), "mixed_bfloat16", "TPU"),
        (AMX_CPU, "mixed_bfloat16", "AMX_BF16"),
        (HardwareInfo(cpu_flags=frozenset({"avx512_bf16"})), "mixed_bfloat16", "AVX512_BF16"),
        (HardwareInfo(cpu_flags=frozenset({"avx2", "avx512f"})), "float32", "no CPU bfloat16"),
        (HardwareInfo(), "float32", "no GPU"),
    ],
)
def test_choose_policy(hardware, expected, reason_part):
    choice = tfmixprec.choose_policy(hardware)
    assert choice.name == expected
    assert reason_part in choice.reason
    assert choice.reason.endswith(".")


def test_set_policy_names_and_auto():
    for name in ("mixed_float16", "mixed_bfloat16", "float32"):
        policy = tfmixprec.set_policy(name)
        assert isinstance(policy, keras.DTypePolicy)
        assert policy.name == name == keras.config.dtype_policy().name
    assert tfmixprec.set_policy("auto", HardwareInfo(gpus=(T4,))).name == "mixed_float16"
    assert tfmixprec.set_policy("auto", HardwareInfo()).name == "float32"


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        ("mixed_flaot16", ValueError, r"Did you mean 'mixed_float16'\?.*'mixed_flaot16'"),
        ("bfloat16", ValueError, r"Did you mean 'mixed_bfloat16'\?"),
        ("fp32", ValueError, r"Valid names: mixed_float16, mixed_bfloat16, float32, auto"),
        (16, TypeError, r"policy must be a policy name.*name=16 of type int"),
    ],
)
def test_bad_policy_names_change_nothing(bad, exc, match):
    tfmixprec.set_policy("mixed_bfloat16")
    with pytest.raises(exc, match=match):
        tfmixprec.set_policy(bad)
    with pytest.raises(exc, match=match):
        with tfmixprec.policy_scope(bad):
            pass
    assert keras.config.dtype_policy().name == "mixed_bfloat16"


def test_policy_scope_restores_also_on_error():
    tfmixprec.set_policy("float32")
    with tfmixprec.policy_scope("mixed_float16") as policy:
        assert policy.name == keras.config.dtype_policy().name == "mixed_float16"
    assert keras.config.dtype_policy().name == "float32"
    with pytest.raises(RuntimeError, match="boom"):
        with tfmixprec.policy_scope("mixed_bfloat16"):
            raise RuntimeError("boom")
    assert keras.config.dtype_policy().name == "float32"


def test_policy_scope_leaves_an_unset_global_policy_unset():
    """A process that never set a global policy has none after the block either (reading it
    through keras.config would set it), also when the block raises."""
    restore_global_policy(None)
    with tfmixprec.policy_scope("mixed_bfloat16") as policy:
        assert policy.name == global_policy().name == "mixed_bfloat16"
    assert global_policy() is None
    with pytest.raises(RuntimeError, match="boom"):
        with tfmixprec.policy_scope("mixed_float16"):
            raise RuntimeError("boom")
    assert global_policy() is None
    assert keras.config.dtype_policy().name == "float32"  # what Keras reads while unset


# ------------------------------------------------------------------ float32_outputs
def _weights(model):
    return [w.numpy().copy() for w in model.weights]


def _check_outputs(model, x, expected_changes):
    before = _weights(model)
    y16 = keras.tree.map_structure(lambda t: np.asarray(t, "float32"), model.predict(x, verbose=0))
    changes = tfmixprec.float32_outputs(model)
    assert [(c.layer, c.old, c.new) for c in changes] == expected_changes
    for a, b in zip(before, _weights(model)):
        assert a.tobytes() == b.tobytes()  # no weight value changed
    y32 = model.predict(x, verbose=0)
    for a, b in zip(keras.tree.flatten(y16), keras.tree.flatten(y32)):
        assert b.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)  # float16 rounding only
    assert tfmixprec.float32_outputs(model) == []  # idempotent
    return changes


def test_float32_outputs_sequential():
    tfmixprec.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(8, activation="sigmoid", name="gate"),
            keras.layers.Dense(4, name="logits"),
            keras.layers.Softmax(name="probs"),
        ]
    )
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    (change,) = _check_outputs(model, x, [("probs", "mixed_float16", "float32")])
    assert change.why == "produces a model output in float16; Softmax layer"
    # Inside the model a sigmoid feeds float16 layers, which compute in float16 anyway.
    for name in ("hidden", "gate", "logits"):
        assert model.get_layer(name).dtype_policy.name == "mixed_float16"


def test_float32_outputs_reads_the_dtype_a_real_call_returns():
    """An output layer whose call returns float32 under a float16 policy (Keras's
    ReversibleEmbedding with reverse_dtype='float32', as in KerasHub's causal LMs) needs no
    change; its symbolic output says float16."""
    tfmixprec.set_policy("mixed_float16")
    tokens = keras.Input((5,), dtype="int32")
    embedding = keras.layers.ReversibleEmbedding(64, 16, reverse_dtype="float32", name="tied")
    hidden = keras.layers.Dense(16, name="hidden")(embedding(tokens))
    model = keras.Model(tokens, embedding(hidden, reverse=True))
    assert model.outputs[0].dtype == "float16"  # what Keras infers symbolically
    assert model(np.zeros((1, 5), "int32")).dtype == "float32"  # what it returns
    assert tfmixprec.float32_outputs(model) == []
    assert embedding.dtype_policy.name == "mixed_float16"


def test_float32_outputs_functional_multi_output_with_nested_model():
    tfmixprec.set_policy("mixed_float16")
    keras.utils.set_random_seed(1)
    inner = keras.Sequential([keras.Input((16,)), keras.layers.Dense(2, name="inner_out")])
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu", name="trunk")(inputs)
    out_a = keras.layers.Dense(3, name="head_a")(hidden)
    out_b = keras.layers.Dense(1, activation="log_softmax", name="head_b")(hidden)
    out_c = inner(hidden)
    model = keras.Model(inputs, [out_a, out_b, out_c])
    x = np.random.default_rng(1).normal(size=(5, 6)).astype("float32")
    _check_outputs(
        model,
        x,
        [
            ("head_a", "mixed_float16", "float32"),
            ("head_b", "mixed_float16", "float32"),
            ("inner_out", "mixed_float16", "float32"),
        ],
    )
    assert model.get_layer("trunk").dtype_policy.name == "mixed_float16"


class TwoHeads(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.body = keras.layers.Dense(8, activation="relu", name="body")
        self.attention = keras.layers.Dense(8, activation="softmax", name="attention")
        self.gate = keras.layers.Multiply(name="gate")  # autocasts its inputs
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x):
        h = self.body(x)
        return self.head(self.gate([h, self.attention(h)]))


def test_float32_outputs_subclassed():
    tfmixprec.set_policy("mixed_float16")
    keras.utils.set_random_seed(2)
    model = TwoHeads()
    x = np.random.default_rng(2).normal(size=(3, 4)).astype("float32")
    model(x)
    _check_outputs(model, x, [("head", "mixed_float16", "float32")])
    assert model.attention.dtype_policy.name == "mixed_float16"  # inside: left alone


def test_float32_outputs_bfloat16_and_float32_models():
    tfmixprec.set_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="out")])
    changes = tfmixprec.float32_outputs(model)
    assert [(c.layer, c.old) for c in changes] == [("out", "mixed_bfloat16")]
    tfmixprec.set_policy("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    assert tfmixprec.float32_outputs(model) == []


def test_float32_outputs_bad_input_changes_nothing():
    tfmixprec.set_policy("mixed_float16")
    with pytest.raises(TypeError, match=r"expects a keras.Model.*builtins.str"):
        tfmixprec.float32_outputs("model.keras")
    with pytest.raises(TypeError, match=r"keras.src.layers.core.dense.Dense"):
        tfmixprec.float32_outputs(keras.layers.Dense(3))
    unbuilt = keras.Sequential([keras.layers.Dense(3, activation="softmax")], name="lazy")
    with pytest.raises(ValueError, match=r"Model 'lazy' is not built.*model.build\(input_shape\)"):
        tfmixprec.float32_outputs(unbuilt)
    assert unbuilt.layers[0].dtype_policy.name == "mixed_float16"


# ---------------------------------------------------------- float32_outputs(softmax=True)
def _attention_model():
    """Tokens -> MultiHeadAttention (dropout > 0: its own Softmax layer runs) -> a standalone
    Softmax over the features -> a log-softmax Activation -> Dense(softmax) -> the output."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 8))
    attended = keras.layers.MultiHeadAttention(2, 4, dropout=0.1, name="attention")(inputs, inputs)
    weights = keras.layers.Softmax(name="feature_softmax")(attended)
    mixed = keras.layers.Multiply(name="reweigh")([weights, attended])
    logs = keras.layers.Activation("log_softmax", name="log_probs")(mixed)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(logs)
    hidden = keras.layers.Dense(8, activation="softmax", name="gating")(pooled)
    outputs = keras.layers.Dense(3, name="logits")(hidden)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize(
    "function, why",
    [
        (tf.nn.softmax, "softmax activation"),  # its __name__ is softmax_v2
        (tf.nn.log_softmax, "log_softmax activation"),
        (keras.ops.softmax, "softmax activation"),
    ],
)
def test_a_softmax_is_matched_by_what_it_is_not_its_name(function, why):
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((4,))
        hidden = keras.layers.Activation(function, name="probs")(keras.layers.Dense(4)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden))
    changes = tfmixprec.float32_outputs(model, softmax=True)
    assert [(c.layer, c.new, c.why) for c in changes] == [
        ("out", "float32", "produces a model output in float16"),
        ("probs", "float32", f"{why} (softmax=True)"),
    ]
    assert model.get_layer("probs").compute_dtype == "float32"


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_float32_outputs_softmax_moves_every_standalone_softmax_layer(policy, tmp_path):
    low = policy.split("_")[1]
    with tfmixprec.policy_scope(policy):
        model = _attention_model()
    x = np.random.default_rng(0).normal(size=(2, 6, 8)).astype("float32")
    before = _weights(model)
    assert [c.layer for c in tfmixprec.float32_outputs(model)] == ["logits"]  # the default
    assert model.get_layer("feature_softmax").dtype_policy.name == policy
    changes = tfmixprec.float32_outputs(model, softmax=True)
    assert [(c.layer, c.old, c.new, c.why) for c in changes] == [
        ("feature_softmax", policy, "float32", "Softmax layer (softmax=True)"),
        ("log_probs", policy, "float32", "log_softmax activation (softmax=True)"),
    ]
    assert tfmixprec.float32_outputs(model, softmax=True) == []  # a second call: nothing
    for a, b in zip(before, _weights(model)):
        assert a.tobytes() == b.tobytes()  # no weight value changed
    # The attention's own softmax keeps the attention's dtype (its product with the values
    # shares it), and a Dense's softmax activation its matmul's.
    attention = model.get_layer("attention")
    assert attention._softmax.dtype_policy.name == attention.dtype_policy.name == policy
    assert model.get_layer("gating").dtype_policy.name == policy
    # A real call computes the softmax layers in float32 and the layers after them in `low`.
    probe = keras.Model(
        model.input,
        [model.get_layer(n).output for n in ("feature_softmax", "reweigh", "log_probs")],
    )
    assert [t.dtype.name for t in probe(x)] == ["float32", low, "float32"]
    assert np.isfinite(model.predict(x, verbose=0)).all()
    # A .keras file keeps the float32 policies.
    path = tmp_path / "softmax.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    names = ("feature_softmax", "log_probs", "logits", "gating", "reweigh")
    assert [loaded.get_layer(n).dtype_policy.name for n in names] == [
        "float32",
        "float32",
        "float32",
        policy,
        policy,
    ]
    assert loaded.get_layer("attention")._softmax.dtype_policy.name == policy
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


def test_float32_outputs_softmax_leaves_a_kerashub_gpt2s_attention_softmax():
    """KerasHub's GPT-2 (dropout > 0) runs each attention's softmax as a Softmax layer inside
    its decoder layers: no standalone softmax, nothing to change (its logits are float32)."""
    keras_hub = pytest.importorskip("keras_hub")  # the minimum-versions run has no KerasHub
    with tfmixprec.policy_scope("mixed_float16"):
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=64,
            num_layers=1,
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            dropout=0.1,
            max_sequence_length=8,
        )
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    inner = [layer for layer in iter_layers(model) if isinstance(layer, keras.layers.Softmax)]
    assert inner  # the attention's own
    assert tfmixprec.float32_outputs(model, softmax=True) == []
    assert {layer.dtype_policy.name for layer in inner} == {"mixed_float16"}


def test_float32_outputs_softmax_reaches_nested_models_not_other_layers():
    """A Softmax of a nested model is standalone; one held inside a plain layer is the
    layer's own (as MultiHeadAttention's is) and keeps its dtype."""

    class Gate(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.softmax = keras.layers.Softmax()

        def call(self, x):
            return x * self.softmax(x)

    tfmixprec.set_policy("mixed_float16")
    inner = keras.Sequential(
        [keras.Input((4,)), keras.layers.Softmax(name="inner_softmax")], name="inner"
    )
    inputs = keras.Input((4,))
    gated = Gate(name="gate")(inputs)
    outputs = keras.layers.Dense(2, dtype="float32", name="out")(inner(gated))
    model = keras.Model(inputs, outputs)
    changes = tfmixprec.float32_outputs(model, softmax=True)
    assert [c.layer for c in changes] == ["inner_softmax"]
    assert model.get_layer("gate").softmax.dtype_policy.name == "mixed_float16"


def test_float32_outputs_softmax_puts_back_a_model_that_no_longer_calls():
    """A subclassed call that multiplies the softmax's output by a float16 tensor with a raw
    TensorFlow op fails once the softmax is float32: the policies go back, with an error."""

    class RawProduct(keras.Model):
        def __init__(self):
            super().__init__(name="raw_product")
            self.hidden = keras.layers.Dense(4, name="hidden")
            self.probs = keras.layers.Softmax(name="probs")
            self.out = keras.layers.Dense(2, dtype="float32", name="out")

        def call(self, x):
            hidden = self.hidden(x)
            return self.out(tf.matmul(self.probs(hidden), hidden, transpose_b=True))

    tfmixprec.set_policy("mixed_float16")
    model = RawProduct()
    model(np.zeros((2, 4), "float32"))
    with pytest.raises(
        ValueError,
        match=(
            r"(?s)^Model 'raw_product' fails to call with these layers in float32, so they are "
            r"back as they were: probs \(.*Received: softmax=True$"
        ),
    ):
        tfmixprec.float32_outputs(model, softmax=True)
    assert model.probs.dtype_policy.name == "mixed_float16"
    assert model(np.zeros((2, 4), "float32")).shape == (2, 2)
    with pytest.raises(TypeError, match=r"^softmax must be a bool. Received: softmax='yes'$"):
        tfmixprec.float32_outputs(model, softmax="yes")


# ------------------------------------------------------------- mixed_float16 without a GPU
@pytest.fixture
def warn_again(monkeypatch):
    """The warning comes once per process: let this test see it again."""
    from tfmixprec.precision import policy

    monkeypatch.setitem(policy._WARNED, "float16_without_gpu", False)


@pytest.mark.parametrize(
    "hardware, faster",
    [(HardwareInfo(cpu_name="AMD EPYC"), "float32"), (AMX_CPU, "mixed_bfloat16")],
)
def test_mixed_float16_without_a_gpu_warns_once(warn_again, hardware, faster):
    with pytest.warns(UserWarning) as caught:
        tfmixprec.set_policy("mixed_float16", hardware)
        tfmixprec.set_policy("mixed_float16", hardware)
        with tfmixprec.policy_scope("mixed_float16", hardware):
            pass
    messages = [str(w.message) for w in caught if "mixed_float16 without a GPU" in str(w.message)]
    assert len(messages) == 1
    assert messages[0] == (
        "mixed_float16 without a GPU trains at best as fast as float32 (slow float16 CPU "
        f"kernels). For speed use {faster!r} (set_policy('auto') picks it); to keep float16, "
        "train a MixedPrecisionModel, which routes around the slow kernels. See the tfmixprec "
        'guide "float16 on CPUs" (docs/guides/float16-on-cpus.md in the tfmixprec repository).'
    )
    assert len(messages[0]) <= 400
    assert caught[0].filename == __file__  # points at the user's set_policy call
    assert keras.config.dtype_policy().name == "mixed_float16"  # the policy is still set


def test_the_warning_points_at_a_policy_scope(warn_again):
    with pytest.warns(UserWarning, match="mixed_float16 without a GPU") as caught:
        with tfmixprec.policy_scope("mixed_float16", HardwareInfo()):
            pass
    assert caught[0].filename == __file__


def test_the_warning_says_when_the_workarounds_are_off(warn_again):
    tfmixprec.cpu_float16.disable()
    try:
        with pytest.warns(UserWarning, match="mixed_float16 without a GPU") as caught:
            tfmixprec.set_policy("mixed_float16", HardwareInfo())
    finally:
        tfmixprec.cpu_float16.enable()
    message = str(caught[0].message)
    assert "tfmixprec's routes around them are off: tfmixprec.cpu_float16.enable()." in message
    assert len(message) <= 400


@pytest.mark.parametrize(
    "name, hardware",
    [
        ("mixed_bfloat16", HardwareInfo()),
        ("float32", HardwareInfo()),
        ("auto", HardwareInfo()),
        ("mixed_float16", HardwareInfo(gpus=(T4,))),
        ("mixed_float16", HardwareInfo(tpus=8)),
    ],
)
def test_no_warning_where_the_policy_fits(warn_again, name, hardware):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tfmixprec.set_policy(name, hardware)
        with tfmixprec.policy_scope(name, hardware):
            pass


def test_this_machine_is_detected_for_the_warning(warn_again):
    """The real detection (no `hardware=`): warns exactly where there is no GPU or TPU."""
    hardware = tfmixprec.detect_hardware()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tfmixprec.set_policy("mixed_float16")
    warned = [w for w in caught if "mixed_float16 without a GPU" in str(w.message)]
    assert len(warned) == (0 if hardware.gpus or hardware.tpus else 1)


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.layers.Reshape((6,)),
        lambda: keras.layers.Flatten(),
        lambda: keras.layers.Dropout(0.2),
        lambda: keras.layers.Activation("linear"),
        lambda: keras.layers.Identity(),
    ],
    ids=["Reshape", "Flatten", "Dropout", "Activation", "Identity"],
)
def test_float32_outputs_reaches_the_softmax_behind_a_pass_through_layer(make):
    """The loss sees the softmax through a layer that only moves values: both compute in
    float32 after the change (a float32 reshape alone would take float16 probabilities)."""
    tfmixprec.set_policy("mixed_float16")
    carrier = make()
    inputs = keras.Input((8,))
    probs = keras.layers.Dense(6, activation="softmax", name="probs")(inputs)
    model = keras.Model(inputs, carrier(probs))
    (error,) = tfmixprec.audit(model).errors
    assert (error.code, error.layer) == ("low-precision-softmax", "probs")
    assert f"produces a model output (through {carrier.name!r})" in error.message
    changes = tfmixprec.float32_outputs(model)
    assert [c.layer for c in changes] == ["probs", carrier.name]
    assert model(np.zeros((2, 8), "float32")).dtype == "float32"
    assert tfmixprec.audit(model).errors == [] and tfmixprec.float32_outputs(model) == []


def test_float32_outputs_of_a_layer_of_layers_and_a_nested_subclassed_model():
    class Head(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.proj = keras.layers.Dense(4, activation="softmax", name="proj")

        def call(self, x):
            return self.proj(x)

    class Block(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(4, name="inner")

        def call(self, x):
            return self.dense(x)

    tfmixprec.set_policy("mixed_float16")
    inputs = keras.Input((8,))
    model = keras.Model(inputs, [Head(name="head")(inputs), Block()(inputs)])
    changed = [c.layer for c in tfmixprec.float32_outputs(model)]
    assert changed == ["proj", "head", "inner"]  # the computing layers, and what passes them on
    assert [t.dtype for t in model(np.zeros((2, 8), "float32"))] == ["float32", "float32"]


def test_float32_outputs_of_an_identity_on_the_inputs():
    """A pass-through layer that returns the model's input itself (an identity, a dropout in
    inference mode) made the output: it is the layer that sets the output's dtype."""
    tfmixprec.set_policy("mixed_float16")
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Identity(name="same")(inputs))
    assert [c.layer for c in tfmixprec.float32_outputs(model)] == ["same"]
    assert model(np.zeros((2, 8), "float32")).dtype == "float32"
    tfmixprec.set_policy("float32")  # no cast: the layer returns its input tensor itself
    model = keras.Model(inputs := keras.Input((8,)), keras.layers.Identity()(inputs))
    assert tfmixprec.float32_outputs(model) == []
