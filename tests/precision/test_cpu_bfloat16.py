"""Tests of `tfmixprec.cpu_bfloat16`: the bfloat16 layers routed around slow CPU kernels.

A route changes which kernels run and in which dtype a product is computed, never a layer's
output dtype, variables or config: values agree with plain `mixed_bfloat16` within bfloat16
rounding, and on a GPU, on a CPU without bfloat16, or switched off, nothing changes. The
routes run on any CPU (bfloat16 kernels are emulated where the CPU has no bfloat16
instructions), so the hardware is described, not detected.
"""

import json
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec._keras.kernels import REVERSIBLE_EMBEDDING
from tfmixprec.precision import cpu_bfloat16
from tfmixprec.precision.hardware import GPUInfo, HardwareInfo

AVX512_BF16 = HardwareInfo(cpu_name="Test EPYC", cpu_flags=frozenset({"avx512_bf16"}))
AMX = HardwareInfo(cpu_name="Test Xeon", cpu_flags=frozenset({"avx512_bf16", "amx_bf16"}))
NO_BF16 = HardwareInfo(cpu_name="Test CPU")
WITH_GPU = HardwareInfo(
    gpus=(GPUInfo("NVIDIA A100", (8, 0)),), cpu_flags=frozenset({"avx512_bf16"})
)
BF16_EPS = 2.0**-8  # bfloat16's unit roundoff (8 significand bits): half its epsilon 2^-7

needs_reversible = pytest.mark.skipif(
    REVERSIBLE_EMBEDDING is None, reason="this Keras has no keras.layers.ReversibleEmbedding"
)


@pytest.fixture
def switch_restored():
    yield
    cpu_bfloat16.enable()


@pytest.fixture
def described_cpu(monkeypatch):
    """The machine the routes meet is an AVX512_BF16 CPU without AMX, whatever runs the test."""
    monkeypatch.setattr(cpu_bfloat16, "detect_hardware", lambda: AVX512_BF16)
    return AVX512_BF16


def _language_model(tie_weights=True, soft_cap=None, vocabulary=96, width=32):
    """Token ids -> a Dense block -> logits through a ReversibleEmbedding's reverse
    projection: a language model's head, as KerasHub builds it."""
    tokens = keras.Input((8,), dtype="int32")
    embedding = REVERSIBLE_EMBEDDING(
        vocabulary, width, tie_weights=tie_weights, logit_soft_cap=soft_cap, name="embedding"
    )
    h = keras.layers.Dense(width, activation="gelu", name="hidden")(embedding(tokens))
    logits = embedding(h, reverse=True)
    return keras.Model(tokens, logits, name="tiny_lm")


def _depthwise_model():
    images = keras.Input((12, 12, 4))
    h = keras.layers.DepthwiseConv2D(3, padding="same", activation="relu", name="dw")(images)
    h = keras.layers.Conv2D(8, 1, name="pointwise")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(images, keras.layers.Dense(3, dtype="float32", name="head")(h))


@pytest.mark.parametrize(
    "policy, hardware, expected",
    [
        ("mixed_bfloat16", AVX512_BF16, True),
        ("bfloat16", AMX, True),
        ("mixed_bfloat16", NO_BF16, False),  # emulated bfloat16: auto picks float32 there
        ("mixed_bfloat16", WITH_GPU, False),  # never on a GPU
        ("mixed_float16", AVX512_BF16, False),
        ("float32", AVX512_BF16, False),
    ],
)
def test_applies(policy, hardware, expected):
    assert cpu_bfloat16.applies(policy, hardware) is expected


def test_routes_measured_per_cpu():
    names = [route.name for route in cpu_bfloat16.ROUTES]
    assert names == ["bfloat16 logits", "float32 depthwise convolution"]
    assert [r.name for r in cpu_bfloat16.routes_on(AVX512_BF16)] == names
    assert [r.name for r in cpu_bfloat16.routes_on(AMX)] == ["bfloat16 logits"]  # measured
    assert cpu_bfloat16.routes_on(NO_BF16) == []
    assert cpu_bfloat16.routes_on(WITH_GPU) == []
    assert cpu_bfloat16.status(hardware=AMX)["routes"] == ["bfloat16 logits"]


@needs_reversible
@pytest.mark.parametrize("tie_weights, soft_cap", [(True, None), (False, None), (True, 5.0)])
def test_logits_route_computes_in_bfloat16_and_returns_float32(tie_weights, soft_cap):
    with tfmixprec.policy_scope("mixed_bfloat16"):
        model = _language_model(tie_weights, soft_cap)
    tokens = np.random.default_rng(0).integers(0, 96, (4, 8)).astype("int32")
    plain = model(tokens)
    config = model.get_config()
    assert cpu_bfloat16.bfloat16_route_layers(model, AVX512_BF16) == {
        "embedding": ("bfloat16 logits", False)
    }
    assert cpu_bfloat16.fast_bfloat16_layers(model, AVX512_BF16) == ["embedding"]
    routed = model(tokens)
    assert plain.dtype == routed.dtype == "float32"  # the output dtype is Keras's
    assert model.get_config() == config  # nothing saved changes (reverse_dtype stays None)
    # The table rounded to bfloat16 (a roundoff per product) and the logits rounded once more
    # (another): within 2 roundoffs of the largest logit (a capped one: tanh is 1-Lipschitz,
    # so the cap only shrinks the distance).
    scale = float(np.max(np.abs(plain)))
    assert np.max(np.abs(np.asarray(routed) - np.asarray(plain))) <= 2 * BF16_EPS * scale
    assert not np.array_equal(routed, plain)  # the product did change dtype
    assert cpu_bfloat16.bfloat16_route_layers(model, AVX512_BF16) == {
        "embedding": ("bfloat16 logits", True)
    }
    assert cpu_bfloat16.fast_bfloat16_layers(model, AVX512_BF16) == ["embedding"]  # once
    # The forward lookup is Keras's own.
    lookup = model.get_layer("embedding")(tokens)
    assert lookup.dtype == "bfloat16"


@needs_reversible
def test_logits_route_gradients_within_bfloat16_rounding():
    with tfmixprec.policy_scope("mixed_bfloat16"):
        plain, routed = _language_model(), _language_model()
    routed.set_weights(plain.get_weights())
    cpu_bfloat16.fast_bfloat16_layers(routed, AVX512_BF16)
    tokens = np.random.default_rng(1).integers(0, 96, (4, 8)).astype("int32")
    labels = np.random.default_rng(2).integers(0, 96, (4, 8)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def gradients(model):
        with tf.GradientTape() as tape:
            value = loss(labels, model(tokens, training=True))
        return value, tape.gradient(value, model.trainable_variables)

    value_plain, grads_plain = gradients(plain)
    value_routed, grads_routed = gradients(routed)  # a second tf.function trace
    assert abs(float(value_routed) - float(value_plain)) <= 4 * BF16_EPS * float(value_plain)
    for a, b in zip(grads_plain, grads_routed):
        a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)
        assert a.dtype == b.dtype == "float32"
        scale = float(tf.reduce_max(tf.abs(a)))
        assert float(tf.reduce_max(tf.abs(a - b))) <= 8 * BF16_EPS * scale


@pytest.mark.parametrize("hardware, routed", [(AVX512_BF16, ["dw"]), (AMX, []), (NO_BF16, [])])
def test_depthwise_route_only_where_measured(hardware, routed):
    with tfmixprec.policy_scope("mixed_bfloat16"):
        model = _depthwise_model()
    images = np.random.default_rng(0).normal(size=(2, 12, 12, 4)).astype("float32")
    before = np.asarray(model(images))
    assert cpu_bfloat16.fast_bfloat16_layers(model, hardware) == routed
    after = np.asarray(model(images))
    assert model.get_layer("dw").compute_dtype == "bfloat16"
    # The depthwise product in float32 from bfloat16 inputs and kernel, its output rounded
    # to bfloat16 as before: the pointwise layer sees inputs at most an ulp apart.
    assert np.max(np.abs(after - before)) <= 4 * BF16_EPS * np.max(np.abs(before))


def test_nothing_routed_off_the_cpu_or_the_switch(switch_restored):
    with tfmixprec.policy_scope("mixed_bfloat16"):
        model = _depthwise_model()
    assert cpu_bfloat16.fast_bfloat16_layers(model, WITH_GPU) == []
    assert cpu_bfloat16.bfloat16_route_layers(model, WITH_GPU) == {}
    cpu_bfloat16.disable()
    assert cpu_bfloat16.status(hardware=AVX512_BF16) == {
        "enabled": False,
        "applies": False,
        "routes": ["bfloat16 logits", "float32 depthwise convolution"],
    }
    assert cpu_bfloat16.fast_bfloat16_layers(model, AVX512_BF16) == []
    cpu_bfloat16.enable()
    with tfmixprec.policy_scope("float32"):
        float32_model = _depthwise_model()
    assert cpu_bfloat16.fast_bfloat16_layers(float32_model, AVX512_BF16) == []


@needs_reversible
def test_a_table_only_looked_up_has_no_product_to_route():
    """A BERT classifier's token table is a `ReversibleEmbedding` never called in reverse."""
    with tfmixprec.policy_scope("mixed_bfloat16"):
        tokens = keras.Input((8,), dtype="int32")
        embedded = REVERSIBLE_EMBEDDING(96, 32, name="embedding")(tokens)
        pooled = keras.layers.GlobalAveragePooling1D()(embedded)
        model = keras.Model(tokens, keras.layers.Dense(2, dtype="float32")(pooled))
    assert cpu_bfloat16.bfloat16_route_layers(model, AVX512_BF16) == {}
    assert cpu_bfloat16.fast_bfloat16_layers(model, AVX512_BF16) == []


@needs_reversible
def test_a_routed_table_moved_to_float16_computes_as_keras_does():
    """Only bfloat16 logits are computed in the compute dtype: a routed layer set to another
    policy later (float16 here) multiplies in float32, as Keras does against its table."""
    with tfmixprec.policy_scope("mixed_bfloat16"):
        plain, routed = _language_model(), _language_model()
    table = plain.get_layer("embedding")
    table.set_weights([np.full_like(w, 0.1) for w in table.get_weights()])
    routed.set_weights(plain.get_weights())
    cpu_bfloat16.fast_bfloat16_layers(routed, AVX512_BF16)
    for model in (plain, routed):
        model.get_layer("embedding").dtype_policy = keras.DTypePolicy("mixed_float16")
    hidden = np.full((2, 8, 32), 60000.0, "float32")  # logits 32 * 6000: past 65504
    expected = plain.get_layer("embedding")(hidden, reverse=True)
    got = routed.get_layer("embedding")(hidden, reverse=True)
    assert got.dtype == expected.dtype == "float32"
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert np.max(np.abs(np.asarray(got))) > 65504 and np.isfinite(np.asarray(got)).all()


@needs_reversible
def test_a_chosen_reverse_dtype_is_left_alone():
    with tfmixprec.policy_scope("mixed_bfloat16"):
        model = _language_model()
    model.get_layer("embedding").reverse_dtype = "float32"
    assert cpu_bfloat16.fast_bfloat16_layers(model, AVX512_BF16) == []


@needs_reversible
def test_compile_routes_and_saved_file_is_keras_own(described_cpu, tmp_path):
    with tfmixprec.policy_scope("mixed_bfloat16"):
        base = _language_model()
        model = tfmixprec.MixedPrecisionModel(base.inputs, base.outputs)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(True))
    assert cpu_bfloat16.bfloat16_route_layers(model) == {"embedding": ("bfloat16 logits", True)}
    tokens = np.random.default_rng(0).integers(0, 96, (8, 8)).astype("int32")
    model.fit(tokens, tokens, batch_size=4, epochs=1, verbose=0)
    path = tmp_path / "lm.keras"
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        saved = json.loads(archive.read("config.json"))
    (layer_config,) = [c for c in saved["config"]["layers"] if c["name"] == "embedding"]
    assert layer_config["config"]["reverse_dtype"] is None  # the file is Keras's own
    loaded = keras.models.load_model(path)  # compiled through tfmixprec again: routed again
    assert cpu_bfloat16.bfloat16_route_layers(loaded) == {"embedding": ("bfloat16 logits", True)}
    np.testing.assert_array_equal(
        loaded.predict(tokens, verbose=0), model.predict(tokens, verbose=0)
    )


def test_doctor_names_the_routes_on_this_cpu(switch_restored):
    line = "  bfloat16 routes   "
    epyc = str(tfmixprec.doctor(AVX512_BF16, print_report=False))
    assert f"{line}bfloat16 logits, float32 depthwise convolution (tfmixprec.cpu_bfloat16)" in epyc
    xeon = tfmixprec.doctor(AMX, print_report=False)
    assert f"{line}bfloat16 logits (tfmixprec.cpu_bfloat16)" in str(xeon)
    assert xeon.to_dict()["bfloat16_routes"] == ["bfloat16 logits"]
    assert f"{line}none on this machine" in str(tfmixprec.doctor(NO_BF16, print_report=False))
    assert f"{line}none on this machine" in str(tfmixprec.doctor(WITH_GPU, print_report=False))
    cpu_bfloat16.disable()
    off = tfmixprec.doctor(AVX512_BF16, print_report=False)
    assert f"{line}off (tfmixprec.cpu_bfloat16.enable() turns them on)" in str(off)
    assert off.bfloat16_routes == []


@needs_reversible
def test_audit_reports_routes_to_take_then_taken():
    with tfmixprec.policy_scope("mixed_bfloat16"):
        model = _language_model()
    codes = lambda report: {f.code: f for f in report.findings}  # noqa: E731
    found = codes(tfmixprec.audit(model, hardware=AVX512_BF16))["cpu-bfloat16-kernels"]
    assert found.severity == "info"
    assert found.message.startswith(
        "on this CPU, 1 bfloat16 layer(s) run slower than they need: 'embedding' (bfloat16 logits)"
    )
    assert "tfmixprec.cpu_bfloat16.fast_bfloat16_layers(model)" in found.fix
    assert "cpu-bfloat16-kernels" not in codes(tfmixprec.audit(model, hardware=WITH_GPU))
    assert "cpu-bfloat16-kernels" not in codes(tfmixprec.audit(model, hardware=NO_BF16))
    cpu_bfloat16.disable()
    try:  # switched off: nothing to say (fast_bfloat16_layers would route nothing)
        assert "cpu-bfloat16-kernels" not in codes(tfmixprec.audit(model, hardware=AVX512_BF16))
    finally:
        cpu_bfloat16.enable()
    cpu_bfloat16.fast_bfloat16_layers(model, AVX512_BF16)
    after = codes(tfmixprec.audit(model, hardware=AVX512_BF16))
    assert "cpu-bfloat16-kernels" not in after
    assert after["cpu-bfloat16-routed"].message == (
        "1 bfloat16 layer(s) take a tfmixprec.cpu_bfloat16 route: 'embedding' (bfloat16 logits)."
    )


def test_audit_of_a_kerashub_backbone_finds_no_logits():
    """GPT-2's table is called in reverse by the task model, not by its backbone alone."""
    pytest.importorskip("keras_hub")
    from tfmixprec.tools import zoo

    with tfmixprec.policy_scope("mixed_bfloat16"):
        entry = zoo.build("gpt2", size="tiny")
    findings = lambda m: [f.code for f in tfmixprec.audit(m, hardware=AVX512_BF16).findings]  # noqa: E731
    assert "cpu-bfloat16-kernels" in findings(entry.model)
    assert "cpu-bfloat16-kernels" not in findings(entry.model.backbone)


def test_kerashub_gpt2_routed_trains_like_plain_bfloat16_under_two_replicas(two_cpu_strategy):
    """KerasHub's GPT-2, compiled the Keras way: routed under 2 replicas (each replica's call
    in its own thread), its losses within bfloat16 rounding of plain `mixed_bfloat16` in one."""
    pytest.importorskip("keras_hub")
    from zoo_checks import loss_tolerance

    from tfmixprec.tools import zoo

    def losses(strategy, routed):
        with tfmixprec.policy_scope("mixed_bfloat16"), strategy.scope():
            entry = zoo.build("gpt2", size="tiny")
            entry.model.compile(optimizer="adam", loss=entry.loss)
        if routed:
            assert cpu_bfloat16.fast_bfloat16_layers(entry.model, AVX512_BF16) == [
                "token_embedding"
            ]
        x, y, weights = entry.data(3)
        history = entry.model.fit(
            x, y, sample_weight=weights, batch_size=entry.batch_size, shuffle=False, verbose=0
        )
        return history.history["loss"][0]

    plain = losses(tf.distribute.get_strategy(), routed=False)
    routed = losses(two_cpu_strategy, routed=True)
    assert abs(routed - plain) <= loss_tolerance("bfloat16", 3) * plain


def _elementwise_model():
    """A Dense block with GELU, dropout, a Dense without activation and a softmax."""
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, activation="gelu", name="hidden")(inputs)
    x = keras.layers.Dropout(0.5, name="drop")(x)
    x = keras.layers.Dense(8, name="out")(x)
    return keras.Model(inputs, keras.layers.Softmax(name="probs")(x))


@pytest.mark.parametrize("hardware", [AVX512_BF16, AMX, NO_BF16, WITH_GPU])
def test_elementwise_route_is_taken_nowhere_by_default(hardware):
    assert cpu_bfloat16.ELEMENTWISE not in cpu_bfloat16.routes_on(hardware)
    with tfmixprec.policy_scope("mixed_bfloat16"):
        model = _elementwise_model()
    assert cpu_bfloat16.fast_bfloat16_layers(model, hardware) == []


def test_elementwise_route_on_request_computes_element_wise_work_in_float32():
    with tfmixprec.policy_scope("mixed_bfloat16"):
        plain, routed = _elementwise_model(), _elementwise_model()
    routed.set_weights(plain.get_weights())
    config = routed.get_config()
    routes = (cpu_bfloat16.ELEMENTWISE,)
    assert cpu_bfloat16.fast_bfloat16_layers(routed, NO_BF16, routes) == []  # no bfloat16 CPU
    taken = cpu_bfloat16.fast_bfloat16_layers(routed, AVX512_BF16, routes)
    assert taken == ["hidden", "drop", "out", "probs"]
    assert routed.get_config() == config
    x = np.random.default_rng(0).normal(size=(4, 16)).astype("float32")
    for name in ("hidden", "out", "probs"):  # each layer on the same bfloat16 inputs
        inputs = keras.ops.cast(x if name == "hidden" else plain.get_layer("hidden")(x), "bfloat16")
        if name == "probs":
            inputs = plain.get_layer("out")(inputs)
        expected = np.asarray(plain.get_layer(name)(inputs), "float32")
        got_tensor = routed.get_layer(name)(inputs)
        assert got_tensor.dtype == "bfloat16"  # the output dtype is Keras's
        got = np.asarray(keras.ops.cast(got_tensor, "float32"))
        # In bfloat16 the bias add and each operation of the activation round (GELU: 4 of
        # them) or the softmax's own; in float32 inside, only the output rounds: a few
        # roundoffs of the largest value.
        assert np.max(np.abs(got - expected)) <= 8 * BF16_EPS * np.max(np.abs(expected)), name
    drop = routed.get_layer("drop")
    hidden = plain.get_layer("hidden")(x)
    np.testing.assert_array_equal(drop(hidden, training=False), hidden)  # inference: identity
    dropped = np.asarray(keras.ops.cast(drop(hidden, training=True), "float32"))
    kept = dropped != 0
    np.testing.assert_array_equal(
        dropped[kept], np.asarray(keras.ops.cast(hidden * 2, "float32"))[kept]
    )


def test_elementwise_route_leaves_a_product_with_no_element_wise_work():
    """A `Dense` without bias whose activation is Keras's `linear` (what `activation=None`
    keeps) has nothing to compute in float32 around its product: not routed."""
    with tfmixprec.policy_scope("mixed_bfloat16"):
        inputs = keras.Input((16,))
        bare = keras.layers.Dense(8, use_bias=False, name="bare")(inputs)
        biased = keras.layers.Dense(8, name="biased")(bare)
        model = keras.Model(
            inputs, keras.layers.Dense(8, use_bias=False, activation="relu")(biased)
        )
    routes = (cpu_bfloat16.ELEMENTWISE,)
    taken = cpu_bfloat16.fast_bfloat16_layers(model, AVX512_BF16, routes)
    assert taken == ["biased", model.layers[-1].name]


def test_routing_a_fitted_model_traces_its_functions_again():
    """A model that already ran `fit`, `evaluate` and `predict` runs the routed layers from
    the next call: its traced functions are built again (and only where a layer was routed)."""
    with tfmixprec.policy_scope("mixed_bfloat16"):
        model = _elementwise_model()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x, y = np.zeros((4, 16), "float32"), np.zeros((4,), "int32")
    model.fit(x, y, verbose=0)
    model.evaluate(x, y, verbose=0)
    model.predict(x, verbose=0)
    kinds = ("train", "test", "predict")
    before = [getattr(model, f"{kind}_function") for kind in kinds]
    assert cpu_bfloat16.fast_bfloat16_layers(model, AVX512_BF16, (cpu_bfloat16.ELEMENTWISE,))
    after = [getattr(model, f"{kind}_function") for kind in kinds]
    assert all(new is not old for new, old in zip(after, before))
    assert cpu_bfloat16.fast_bfloat16_layers(model, AVX512_BF16, (cpu_bfloat16.ELEMENTWISE,))
    assert [getattr(model, f"{kind}_function") for kind in kinds] == after  # nothing new


def test_status_reads_the_model_asked_about_and_sets_no_global_policy():
    """`status()` read through Keras's `dtype_policy()` used to set an unset global policy;
    `status(model)` answers for the model, whatever the global policy."""
    from tfmixprec._keras.settings import global_policy, restore_global_policy

    kept = global_policy()
    try:
        with tfmixprec.policy_scope("mixed_bfloat16"):
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
        restore_global_policy(None)
        assert cpu_bfloat16.status(hardware=AVX512_BF16)["applies"] is False  # float32's
        assert global_policy() is None
        assert cpu_bfloat16.status(model, AVX512_BF16)["applies"] is True
        assert cpu_bfloat16.status(model, WITH_GPU)["applies"] is False
        assert cpu_bfloat16.status("mixed_bfloat16", NO_BF16)["applies"] is False
        assert global_policy() is None
    finally:
        restore_global_policy(kept)
