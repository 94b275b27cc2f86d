"""Tests of `tfmixprec.cpu_float16`: float16 on a CPU routed around the two slow kernels.

The workarounds change which kernels run, not what is computed: training with and without
them gives the same updates (within float16 rounding), and on a GPU they never apply.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec import cpu_float16
from tfmixprec.hardware import GPUInfo, HardwareInfo

CPU_ONLY = HardwareInfo(cpu_name="Test CPU")
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


def test_remapper_turned_off_once_and_restored_by_disable(remapper_restored):
    cpu_float16.disable()  # a known start: remapper as configured, nothing remembered
    tf.config.optimizer.set_experimental_options({"remapping": True})
    cpu_float16.enable()
    assert cpu_float16.route_around_fused_matmul("mixed_float16", WITH_GPU) is False
    assert tf.config.optimizer.get_experimental_options()["remapping"] is True
    assert cpu_float16.route_around_fused_matmul("mixed_float16", CPU_ONLY) is True
    assert tf.config.optimizer.get_experimental_options()["remapping"] is False
    cpu_float16.disable()
    assert tf.config.optimizer.get_experimental_options()["remapping"] is True


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
    assert cpu_float16.fast_float16_convolutions(model, WITH_GPU) == []
    assert "convolution_op" not in vars(model.layers[1])
    changed = cpu_float16.fast_float16_convolutions(model, CPU_ONLY)
    assert changed == [model.layers[1].name, model.layers[3].name]
    assert cpu_float16.fast_float16_convolutions(model, CPU_ONLY) == changed  # idempotent
    outputs = model.layers[1](tf.ones((1, 8, 8, 3)))
    assert outputs.dtype == tf.float16  # the layer's output dtype is unchanged
    assert cpu_float16.fast_float16_convolutions(_cnn("mixed_bfloat16"), CPU_ONLY) == []


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
    cpu_float16.fast_float16_convolutions(model, CPU_ONLY)
    path = tmp_path / "cnn.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert "convolution_op" not in vars(loaded.layers[1])
    x = np.ones((2, 8, 8, 3), "float32")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=2e-3)
