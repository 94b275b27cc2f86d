"""Tests of `tfmixprec.cpu_float16`: float16 on a CPU routed around the slow kernels.

The workarounds change which kernels run, not what is computed: training with and without
them gives the same updates (within float16 rounding), and on a GPU they never apply.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec._common.observe import observe
from tfmixprec._keras.kernels import float32_product_call
from tfmixprec._keras.settings import (
    global_policy,
    optimizer_options,
    restore_global_policy,
    restore_optimizer_options,
)
from tfmixprec.precision import cpu_float16
from tfmixprec.precision.cpu_route import route_of
from tfmixprec.precision.hardware import GPUInfo, HardwareInfo, detect_hardware

CPU_ONLY = HardwareInfo(cpu_name="Test CPU")  # no AVX-512 flags: every route
EPYC = HardwareInfo(cpu_name="AMD EPYC", cpu_flags=frozenset({"avx512f", "avx512_bf16"}))
SAPPHIRE_RAPIDS = HardwareInfo(
    cpu_name="Xeon", cpu_flags=frozenset({"avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16"})
)
WITH_GPU = HardwareInfo(gpus=(GPUInfo("NVIDIA A100", (8, 0)),))


@pytest.fixture
def remapper_restored():
    """Tests that turn grappler's remapper on or off put it back as it was."""
    before = tf.config.optimizer.get_experimental_options().get("remapping", True)
    state = dict(cpu_float16._STATE)
    yield
    tf.config.optimizer.set_experimental_options({"remapping": before})
    cpu_float16._STATE.update(state)


@pytest.mark.parametrize(
    "policy, hardware, expected",
    [
        ("mixed_float16", CPU_ONLY, True),
        ("float16", CPU_ONLY, True),
        ("mixed_float16", WITH_GPU, False),  # never on a GPU
        ("mixed_bfloat16", CPU_ONLY, False),
        ("float32", CPU_ONLY, False),
    ],
)
def test_applies(policy, hardware, expected):
    assert cpu_float16.applies(policy, hardware) is expected


def test_applies_follows_the_switch(remapper_restored):
    cpu_float16.disable()
    assert cpu_float16.applies("mixed_float16", CPU_ONLY) is False
    assert cpu_float16.status()["enabled"] is False
    cpu_float16.enable()
    assert cpu_float16.applies("mixed_float16", CPU_ONLY) is True


def test_remapper_turned_off_once_and_kept_off_by_disable(remapper_restored):
    """`disable()` leaves the remapper off: TensorFlow reads the option on every call, so
    turning it on would send the float16 models routed here to the fused float16 kernel."""
    cpu_float16._STATE.update(enabled=True)  # a known start
    tf.config.optimizer.set_experimental_options({"remapping": True})
    assert cpu_float16.route_around_fused_matmul("mixed_float16", WITH_GPU) is False
    assert tf.config.optimizer.get_experimental_options()["remapping"] is True
    for hardware in (CPU_ONLY, SAPPHIRE_RAPIDS):  # every CPU: the fused kernel is slow on one
        assert cpu_float16.route_around_fused_matmul("mixed_float16", hardware) is True
        assert tf.config.optimizer.get_experimental_options()["remapping"] is False
    model = _mlp()
    assert cpu_float16.fast_float16_layers(model, CPU_ONLY) == [model.layers[1].name]
    cpu_float16.disable()
    assert tf.config.optimizer.get_experimental_options()["remapping"] is False
    assert cpu_float16.status(hardware=CPU_ONLY)["remapper_off"] is True
    assert "call" in vars(model.layers[1])  # the routed layer keeps its route
    assert cpu_float16.fast_float16_layers(_mlp(), CPU_ONLY) == []  # no new routes
    cpu_float16.enable()
    assert tf.config.optimizer.get_experimental_options()["remapping"] is False


@pytest.fixture
def settings_unset():
    """Grappler's options and Keras's global policy unset, as in a fresh process; after the
    test, as they were."""
    options, policy, state = optimizer_options(), global_policy(), dict(cpu_float16._STATE)
    restore_optimizer_options({})
    restore_global_policy(None)
    cpu_float16._STATE.update(enabled=True)
    yield
    restore_optimizer_options(options)
    restore_global_policy(policy)
    cpu_float16._STATE.update(state)


def test_status_disable_and_enable_set_nothing_that_was_unset(settings_unset):
    assert cpu_float16.status(hardware=CPU_ONLY) == {
        "enabled": True,
        "applies": False,  # an unset global policy is float32's
        "remapper_off": False,
        "routes": ["float32 convolution", "float32 product", "float32 attention"],
    }
    cpu_float16.disable()
    assert cpu_float16.status(hardware=CPU_ONLY)["enabled"] is False
    cpu_float16.enable()
    assert optimizer_options() == {}
    assert global_policy() is None


def test_status_applies_to_the_model_asked_about(settings_unset):
    model = _mlp()  # float16 layers
    restore_global_policy(None)  # unset again (policy_scope sets it back to float32)
    assert cpu_float16.status(hardware=CPU_ONLY)["applies"] is False
    assert cpu_float16.status(model, CPU_ONLY)["applies"] is True
    assert cpu_float16.status(model.layers[-1], CPU_ONLY)["applies"] is False  # float32 head
    assert cpu_float16.status("mixed_float16", CPU_ONLY)["applies"] is True
    assert cpu_float16.status(model, WITH_GPU)["applies"] is False
    assert global_policy() is None


@pytest.mark.parametrize(
    "hardware, routes",
    [
        (CPU_ONLY, ["float32 convolution", "float32 product", "float32 attention"]),
        (EPYC, ["float32 convolution", "float32 product", "float32 attention"]),
        # AVX512_FP16: a plain float16 MatMul runs at float32's speed, so Dense stays float16
        (SAPPHIRE_RAPIDS, ["float32 convolution", "float32 attention"]),
        (WITH_GPU, []),
    ],
)
def test_the_routes_follow_the_kernels_each_cpu_has(hardware, routes):
    assert [r.name for r in cpu_float16.routes_on(hardware)] == routes
    assert cpu_float16.status(hardware=hardware)["routes"] == routes
    model = _transformer_bits()
    expected = {
        "float32 product": ["attention_output", "ffn", "key", "query", "value"],
        "float32 attention": ["mha"],
    }
    served = sorted(name for r in routes for name in expected.get(r, []))
    assert sorted(cpu_float16.float16_product_layers(model, hardware)) == served
    assert sorted(cpu_float16.fast_float16_layers(model, hardware)) == served
    assert list(cpu_float16.float16_product_layers(model, hardware).values()) == [True] * len(
        served
    )


def _cnn(policy):
    with tfmixprec.policy_scope(policy):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((8, 8, 3))
        h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inputs)
        h = keras.layers.Conv1D(4, 2)(keras.layers.Reshape((64, 8))(h))
        h = keras.layers.GlobalAveragePooling1D()(h)
        outputs = keras.layers.Dense(3, dtype="float32")(h)
        return keras.Model(inputs, outputs)


def test_float16_convolutions_convolve_in_float32_on_cpus_only():
    model = _cnn("mixed_float16")
    assert cpu_float16.fast_float16_layers(model, WITH_GPU) == []
    assert "convolution_op" not in vars(model.layers[1])
    changed = cpu_float16.fast_float16_layers(model, CPU_ONLY)
    assert changed == [model.layers[1].name, model.layers[3].name]
    assert cpu_float16.fast_float16_layers(model, CPU_ONLY) == changed  # idempotent
    outputs = model.layers[1](tf.ones((1, 8, 8, 3)))
    assert outputs.dtype == tf.float16  # the layer's output dtype is unchanged
    assert cpu_float16.fast_float16_layers(_cnn("mixed_bfloat16"), CPU_ONLY) == []


def _train(model, steps=3):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    opt = tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=256.0)
    step = tfmixprec.make_train_step(model, keras.losses.MeanSquaredError(), opt)
    for _ in range(steps):
        step(x, y)
    return [w.numpy() for w in model.trainable_weights]


def test_float32_convolutions_give_the_same_updates_within_float16_rounding(remapper_restored):
    cpu_float16.disable()  # the reference: float16 convolutions
    plain_model = _cnn("mixed_float16")
    plain = _train(plain_model)
    assert "convolution_op" not in vars(plain_model.layers[1])
    cpu_float16.enable()
    fast_model = _cnn("mixed_float16")
    fast = _train(fast_model)  # make_train_step routes around the slow kernels
    assert "convolution_op" in vars(fast_model.layers[1])
    for a, b in zip(plain, fast):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)
    assert any(not np.array_equal(a, b) for a, b in zip(plain, fast))  # really other kernels


def _mlp():
    with tfmixprec.policy_scope("mixed_float16"):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((16,))
        h = keras.layers.Dense(32, activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.Dense(4, dtype="float32")(h))


def test_routing_a_fitted_model_traces_its_functions_again(remapper_restored):
    """`fast_float16_layers` after `fit`, `evaluate` and `predict`: the traced functions are
    built again, so the next step runs the float32 products (before, `fit` kept the traced
    float16 kernels while the call said the layers were routed)."""
    model = _mlp()
    model.compile(optimizer=tfmixprec.LossScaleOptimizer(keras.optimizers.SGD()), loss="mse")
    x, y = np.zeros((4, 16), "float32"), np.zeros((4, 4), "float32")
    model.fit(x, y, verbose=0)
    model.evaluate(x, y, verbose=0)
    model.predict(x, verbose=0)
    kinds = ("train", "test", "predict")
    before = [getattr(model, f"{kind}_function") for kind in kinds]
    assert cpu_float16.fast_float16_layers(model, CPU_ONLY) == [model.layers[1].name]
    after = [getattr(model, f"{kind}_function") for kind in kinds]
    assert all(new is not old for new, old in zip(after, before))
    assert cpu_float16.fast_float16_layers(model, CPU_ONLY) == [model.layers[1].name]
    assert [getattr(model, f"{kind}_function") for kind in kinds] == after  # nothing new


def test_a_remapper_turned_on_by_hand_is_turned_off_by_the_next_float16_policy(
    remapper_restored,
):
    """The option is read, not remembered: after a user turns the remapper back on (the
    guide's advice once no float16 model runs), a float16 policy turns it off again, and
    `status()` reports what is set."""
    cpu_float16._STATE.update(enabled=True)
    assert cpu_float16.route_around_fused_matmul("mixed_float16", CPU_ONLY) is True
    tf.config.optimizer.set_experimental_options({"remapping": True})
    assert cpu_float16.status(hardware=CPU_ONLY)["remapper_off"] is False
    assert cpu_float16.remapper_off() is False
    assert cpu_float16.route_around_fused_matmul("mixed_float16", CPU_ONLY) is True
    assert tf.config.optimizer.get_experimental_options()["remapping"] is False
    assert cpu_float16.status(hardware=CPU_ONLY)["remapper_off"] is True


def test_remapper_off_gives_the_same_dense_updates(remapper_restored):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 16)).astype("float32")
    y = rng.normal(size=(8, 4)).astype("float32")
    results = []
    for remapping in (True, False):
        tf.config.optimizer.set_experimental_options({"remapping": remapping})
        model = _mlp()
        opt = keras.optimizers.SGD(0.05)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        results.append([w.numpy() for w in model.trainable_weights])
    for fused, unfused in zip(*results):
        np.testing.assert_allclose(fused, unfused, rtol=2e-3, atol=2e-3)


def test_saved_model_keeps_no_trace_of_the_workaround(tmp_path):
    model = _cnn("mixed_float16")
    cpu_float16.fast_float16_layers(model, CPU_ONLY)
    path = tmp_path / "cnn.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert "convolution_op" not in vars(loaded.layers[1])
    x = np.ones((2, 8, 8, 3), "float32")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=2e-3)


class _OwnCallDense(keras.layers.Dense):
    def call(self, inputs):
        return super().call(inputs) * 2


def _transformer_bits():
    """Dense, EinsumDense (inside MultiHeadAttention), a Dense subclass with its own call."""
    with tfmixprec.policy_scope("mixed_float16"):
        keras.utils.set_random_seed(7)
        inputs = keras.Input((6, 16))
        h = keras.layers.MultiHeadAttention(2, 8, name="mha")(inputs, inputs)
        h = keras.layers.Dense(32, activation="relu", name="ffn")(h)
        h = _OwnCallDense(16, name="own_call")(h)
        h = keras.layers.GlobalAveragePooling1D()(h)
        return keras.Model(inputs, keras.layers.Dense(4, dtype="float32", name="head")(h))


def test_float16_dense_and_einsum_dense_compute_their_product_in_float32():
    model = _transformer_bits()
    assert cpu_float16.fast_float16_layers(model, WITH_GPU) == []
    changed = cpu_float16.fast_float16_layers(model, CPU_ONLY)
    # The four EinsumDense of the attention, its score and value products, and the float16
    # Dense; not the subclass with its own call, not the float32 head.
    assert sorted(changed) == ["attention_output", "ffn", "key", "mha", "query", "value"]
    ffn = model.get_layer("ffn")
    assert "call" in vars(ffn) and "call" not in vars(model.get_layer("own_call"))
    assert ffn(tf.ones((1, 6, 16))).dtype == tf.float16


def _train_transformer_bits(hardware=None, steps=3):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 6, 16)).astype("float32")
    y = rng.normal(size=(8, 4)).astype("float32")
    model = _transformer_bits()
    if hardware is not None:
        cpu_float16.fast_float16_layers(model, hardware)
    opt = tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=256.0)
    step = tfmixprec.make_train_step(model, keras.losses.MeanSquaredError(), opt)
    for _ in range(steps):
        step(x, y)
    return model, [w.numpy() for w in model.trainable_weights]


def test_float32_products_give_the_same_updates_within_float16_rounding(remapper_restored):
    cpu_float16.disable()
    plain_model, plain = _train_transformer_bits()
    assert "call" not in vars(plain_model.get_layer("ffn"))
    cpu_float16.enable()
    fast_model, fast = _train_transformer_bits(CPU_ONLY)  # every route, whatever this CPU
    assert "call" in vars(fast_model.get_layer("ffn"))
    for a, b in zip(plain, fast):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)
    assert any(not np.array_equal(a, b) for a, b in zip(plain, fast))


@pytest.mark.parametrize("fast", [False, True])
def test_a_float16_overflow_still_overflows_with_float32_products(fast):
    """The forward product and the kernel's gradient overflow float16 with or without the
    workaround, so the loss scale behaves on a CPU as it would on a GPU."""
    with tfmixprec.policy_scope("mixed_float16"):
        layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
        layer.build((None, 2))
    if fast:
        assert cpu_float16.fast_float16_layers(layer, CPU_ONLY) == [layer.name]
    assert not np.isfinite(layer(tf.fill((1, 2), 40000.0)).numpy()).any()  # 80000 > 65504
    x = tf.fill((2, 2), 300.0)
    with tf.GradientTape() as tape:
        outputs = layer(x)
        loss = tf.reduce_sum(tf.cast(outputs, tf.float32)) * 200.0  # d/dkernel: 2*300*200
    (grad,) = tape.gradient(loss, layer.trainable_variables)
    assert grad.dtype == tf.float32
    assert not np.isfinite(grad.numpy()).any()


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8)
        self.head = keras.layers.Dense(2, dtype="float32")

    def call(self, x):
        return self.head(self.hidden(x))


def test_finding_output_layers_keeps_the_float32_product():
    with tfmixprec.policy_scope("mixed_float16"):
        model = _Subclassed()
        model.build((None, 4))
    assert cpu_float16.fast_float16_layers(model, CPU_ONLY) == [model.hidden.name]
    # Finding a subclassed model's output layers replaces and restores each layer's call.
    assert [output.layer for output in observe(model).outputs] == [model.head]
    assert vars(model.hidden)["call"].__func__ is float32_product_call
    assert "call" not in vars(model.head)


def _realistic_cnn(policy):
    with tfmixprec.policy_scope(policy):
        keras.utils.set_random_seed(11)
        inputs = keras.Input((32, 32, 3))
        h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
        h = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(h)
        h = keras.layers.MaxPooling2D()(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        h = keras.layers.Dense(128, activation="relu")(h)
        outputs = keras.layers.Dense(10, activation="softmax", dtype="float32")(h)
        return tfmixprec.MixedPrecisionModel(inputs, outputs)


def test_a_realistic_float16_cnn_trains_on_a_cpu_like_float32():
    """GPU-sized layers (32x32x3 images, 32/64 filters) train in float16 through `fit` on a
    CPU and track float32 from the same weights: the routed kernels make this a test that
    takes seconds (the float16 filter gradient alone would take tens of seconds per step)."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(64, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(64,)).astype("int32")
    trained = {}
    for policy in ("float32", "mixed_float16"):
        model = _realistic_cnn(policy)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
        history = model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
        trained[policy] = (history.history, [w.numpy() for w in model.trainable_weights])
    (h32, w32), (h16, w16) = trained["float32"], trained["mixed_float16"]
    hardware = detect_hardware()
    if not hardware.gpus:  # the two convolutions, and the hidden Dense without AVX512_FP16
        routed = [True] * (2 if hardware.cpu_float16 else 3)
        assert list(cpu_float16.float16_product_layers(model).values()) == routed
    assert h16["overflow_steps"][-1] == 0.0  # no step skipped: the same 4 updates
    np.testing.assert_allclose(h16["loss"], h32["loss"], rtol=2e-3)
    for a, b in zip(w32, w16):
        np.testing.assert_allclose(a, b, atol=2e-3)


_CONVOLUTIONS = {
    "Conv1D": (lambda: keras.layers.Conv1D(8, 3, padding="causal", dilation_rate=2), (12, 4)),
    "Conv2D": (lambda: keras.layers.Conv2D(8, 3), (6, 6, 4)),
    "Conv1DTranspose": (lambda: keras.layers.Conv1DTranspose(8, 3, strides=2), (6, 4)),
    "Conv2DTranspose": (lambda: keras.layers.Conv2DTranspose(8, 3, strides=2), (5, 5, 4)),
    "DepthwiseConv2D": (lambda: keras.layers.DepthwiseConv2D(3, depth_multiplier=2), (6, 6, 4)),
    "SeparableConv1D": (lambda: keras.layers.SeparableConv1D(8, 3), (12, 4)),
    "SeparableConv2D": (lambda: keras.layers.SeparableConv2D(8, 3), (6, 6, 4)),
}


def _float16_convolutions(layer, x):
    """The convolution ops (forward and gradients) whose dtype is float16 in the traced
    forward and backward pass of `layer` on `x`: the kernels that really run."""

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(layer(x), tf.float32))
        return tape.gradient(loss, layer.trainable_variables)

    graph = step.get_concrete_function(tf.TensorSpec(x.shape, tf.float32)).graph
    kinds = ("Conv", "Depthwise")
    return sorted(
        op.type
        for op in graph.get_operations()
        if op.type.startswith(kinds) and op.get_attr("T") == tf.float16
    )


@pytest.mark.parametrize("kind", list(_CONVOLUTIONS))
def test_every_convolution_kind_is_routed_by_the_kernel_that_runs(kind):
    """Routed, no float16 convolution kernel runs, forward or backward (Conv1D was reported
    routed but ran its float16 kernel; the transposed ones were neither), and the output is
    the layer's own within float16 rounding."""
    make, shape = _CONVOLUTIONS[kind]
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        layer = make()
    x = np.random.default_rng(0).normal(size=(2, *shape)).astype("float32")
    before = np.asarray(layer(x), "float32")
    assert _float16_convolutions(layer, x)  # TensorFlow's float16 kernels, unrouted
    assert cpu_float16.fast_float16_layers(layer, CPU_ONLY) == [layer.name]
    assert _float16_convolutions(layer, x) == []
    after = np.asarray(layer(x), "float32")
    np.testing.assert_allclose(after, before, rtol=4 * 2.0**-10, atol=4 * 2.0**-10)


def _attention_model(dropout=0.1, causal=False):
    with tfmixprec.policy_scope("mixed_float16"):
        keras.utils.set_random_seed(7)
        tokens = keras.Input((6, 16))
        attention = keras.layers.MultiHeadAttention(2, key_dim=8, dropout=dropout, name="attention")
        # dropout: Keras's explicit path (GPT-2, BERT take it); none: dot_product_attention
        h = attention(tokens, tokens, use_causal_mask=causal)
        h = keras.layers.GlobalAveragePooling1D()(h)
        return keras.Model(tokens, keras.layers.Dense(3, dtype="float32", name="out")(h))


def test_float16_attention_computes_its_products_in_float32():
    """Attention's score and value products: in float16 they run Eigen's einsum on a CPU;
    routed, in float32 from float16 projections, the output cast back to float16."""
    plain, routed = _attention_model(), _attention_model()
    routed.set_weights(plain.get_weights())
    assert "attention" in cpu_float16.fast_float16_layers(routed, CPU_ONLY)
    assert cpu_float16.float16_product_layers(routed, CPU_ONLY)["attention"] is True
    assert "_compute_attention" in vars(routed.get_layer("attention"))
    assert "_compute_attention" not in vars(plain.get_layer("attention"))
    x = np.random.default_rng(0).normal(size=(4, 6, 16)).astype("float32")
    layer_out = routed.get_layer("attention")(x, x)
    assert layer_out.dtype == tf.float16  # the layer's output dtype is unchanged
    a, b = plain(x).numpy(), routed(x).numpy()
    # float16 scores and weighted values rounded once less: within a few float16 roundoffs.
    np.testing.assert_allclose(b, a, rtol=0, atol=8 * 2.0**-11 * np.max(np.abs(a)))
    assert not np.array_equal(a, b)  # really other products


@pytest.mark.parametrize("dropout, causal", [(0.1, False), (0.0, False), (0.0, True)])
def test_a_float16_attention_overflow_still_overflows_when_routed(dropout, causal):
    """Scores past 65504 are `inf`, routed or not: at the softmax's float16 cast on Keras's
    explicit path; `dot_product_attention`'s path (no softmax layer) is left in float16."""
    plain, routed = _attention_model(dropout, causal), _attention_model(dropout, causal)
    weights = plain.get_layer("attention").get_weights()
    weights[:4] = [np.ones_like(w) for w in weights[:4]]  # query and key: sums of the input
    plain.get_layer("attention").set_weights(weights)
    routed.set_weights(plain.get_weights())
    cpu_float16.fast_float16_layers(routed, CPU_ONLY)
    x = np.full((1, 6, 16), 100.0, "float32")  # each score 8 * 1601^2 / sqrt(8): past 65504
    assert not np.isfinite(plain(x).numpy()).all()
    assert not np.isfinite(routed(x).numpy()).all()


def test_an_instance_s_own_call_keeps_it():
    """Issue 47 item 13: a route re-implements Dense's call, so a layer whose instance holds
    its own `call` (as a subclass that overrides it) is not routed and keeps computing it."""
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((4,))
        own = keras.layers.Dense(4, name="own")
        plain = keras.layers.Dense(4, name="plain")
        model = keras.Model(inputs, plain(own(inputs)))
    original = own.call
    own.call = lambda x, *args, **kwargs: original(x, *args, **kwargs) * 0.001
    x = np.ones((2, 4), "float32")
    before = own(x).numpy()
    routed = cpu_float16.fast_float16_layers(model, hardware=CPU_ONLY)
    assert routed == ["plain"]
    assert route_of(own) is None and route_of(plain) == "float32 product"
    np.testing.assert_array_equal(own(x).numpy(), before)  # still the user's call
