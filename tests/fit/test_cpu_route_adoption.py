"""A KerasHub task compiled the ordinary way gets tfmixprec's CPU routes: through one call,
`cpu_bfloat16.fast_bfloat16_layers(model)`, or when `fit` sets a tfmixprec callback's model.

`set_policy("mixed_bfloat16")`, build, `compile(optimizer="adam", loss=...)` and `fit`, as a
newcomer does: the logits route is taken, the train function is traced once more and no
more, the outputs agree with the unrouted model's within bfloat16 rounding, and the weights
and the saved file are unchanged. The machine is described, not detected (the routes run on
any CPU: bfloat16 kernels are emulated where the CPU has none).
"""

import json
import zipfile

import keras
import numpy as np
import pytest

import tfmixprec
from tfmixprec._keras.fit import traced_train_functions
from tfmixprec.precision import cpu_bfloat16, cpu_float16
from tfmixprec.precision.cpu_route import route_of
from tfmixprec.precision.hardware import HardwareInfo
from tfmixprec.tools import zoo

pytest.importorskip("keras_hub")

AVX512_BF16 = HardwareInfo(cpu_name="Test EPYC", cpu_flags=frozenset({"avx512_bf16"}))
NO_BF16 = HardwareInfo(cpu_name="Test CPU")
BF16_EPS = 2.0**-8  # bfloat16's unit roundoff


def _described(monkeypatch, hardware):
    monkeypatch.setattr(cpu_bfloat16, "detect_hardware", lambda: hardware)


def _gpt2():
    """A tiny KerasHub GPT-2, compiled the ordinary way under the global policy."""
    tfmixprec.set_policy("mixed_bfloat16")
    entry = zoo.build("gpt2", size="tiny")  # the same weights every time (the zoo's seed)
    entry.model.compile(optimizer="adam", loss=entry.loss)
    return entry


def _fit(entry, callbacks=()):
    x, y, weights = entry.data(2)
    entry.model.fit(
        x, y, sample_weight=weights, batch_size=4, epochs=1, verbose=0, callbacks=list(callbacks)
    )
    return entry.model.train_function, len(traced_train_functions(entry.model))


def _batch(entry):
    x, _, _ = entry.data(1)
    return x


def _route_line(model):
    return (
        f"tfmixprec: LossScaleMonitor routed 1 layer(s) of model {model.name!r} around slow "
        "bfloat16 CPU kernels: token_embedding (bfloat16 logits). Their outputs, variables and "
        "saved file are unchanged; the values agree within bfloat16 rounding. "
        "tfmixprec.cpu_bfloat16.disable() before fit leaves a model unrouted."
    )


def test_a_callback_routes_an_ordinary_gpt2_and_fit_traces_once_more(monkeypatch, capsys):
    _described(monkeypatch, AVX512_BF16)
    entry = _gpt2()
    model = entry.model
    unrouted, _ = _fit(entry)  # plain Keras first: traced without the route
    assert route_of(model.get_layer("token_embedding")) is None
    capsys.readouterr()
    routed, traces = _fit(entry, [tfmixprec.LossScaleMonitor()])
    assert route_of(model.get_layer("token_embedding")) == "bfloat16 logits"
    assert routed is not unrouted and traces == 1  # traced again, once
    assert _route_line(model) in capsys.readouterr().out.splitlines()
    again, traces = _fit(entry, [tfmixprec.LossScaleMonitor()])
    assert again is routed and traces == 1  # nothing new: the same trace runs
    assert _route_line(model) not in capsys.readouterr().out  # said once per model
    assert cpu_bfloat16.bfloat16_route_layers(model) == {
        "token_embedding": ("bfloat16 logits", True)
    }


def _saved_config(model, path):
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        return json.loads(archive.read("config.json"))


def test_the_routed_gpt2_agrees_with_plain_keras_and_saves_keras_own_file(monkeypatch, tmp_path):
    _described(monkeypatch, AVX512_BF16)
    entry, plain = _gpt2(), _gpt2().model
    model = entry.model
    config, variables = model.get_config(), [(v.path, v.dtype) for v in model.weights]
    saved = _saved_config(model, tmp_path / "unrouted.keras")
    _fit(entry, [tfmixprec.LossScaleMonitor()])
    assert route_of(model.get_layer("token_embedding")) == "bfloat16 logits"
    plain.set_weights(model.get_weights())
    batch = _batch(entry)
    expected, got = np.asarray(plain(batch)), np.asarray(model(batch))
    assert got.dtype == expected.dtype == np.float32  # the logits' dtype is Keras's
    # Only the reverse projection changed dtype: the table rounded to bfloat16 (a roundoff
    # per product) and the logits rounded once more (another).
    assert np.max(np.abs(got - expected)) <= 2 * BF16_EPS * np.max(np.abs(expected))
    assert not np.array_equal(got, expected)
    assert [(v.path, v.dtype) for v in model.weights] == variables
    assert model.get_config() == config
    assert _saved_config(model, tmp_path / "routed.keras") == saved  # Keras's own file
    loaded = keras.models.load_model(tmp_path / "routed.keras")
    for a, b in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert route_of(loaded.get_layer("token_embedding")) is None  # a plain Keras model


def test_one_call_routes_a_gpt2_that_already_ran_fit(monkeypatch):
    _described(monkeypatch, AVX512_BF16)
    entry = _gpt2()
    model = entry.model
    unrouted, _ = _fit(entry)
    assert cpu_bfloat16.fast_bfloat16_layers(model) == ["token_embedding"]
    routed, traces = _fit(entry)
    assert routed is not unrouted and traces == 1  # Keras traced it again, once
    assert cpu_bfloat16.fast_bfloat16_layers(model) == ["token_embedding"]  # taken already
    again, traces = _fit(entry)
    assert again is routed and traces == 1


def test_nothing_routed_or_traced_again_without_bfloat16_instructions(monkeypatch, capsys):
    _described(monkeypatch, NO_BF16)
    entry = _gpt2()
    first, _ = _fit(entry, [tfmixprec.LossScaleMonitor()])
    second, traces = _fit(entry, [tfmixprec.LossScaleMonitor()])
    assert second is first and traces == 1
    assert cpu_bfloat16.bfloat16_route_layers(entry.model) == {}
    assert "routed" not in capsys.readouterr().out


def _float16_net(name):
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden), name=name)


def test_a_float16_model_takes_the_float16_routes_of_this_machine(capsys):
    """Keras's own float16 model gets what `cpu_float16.fast_float16_layers` gives it on this
    machine (its layers and the remapper switch are that module's): the same layers, said
    once, where it routes any."""
    tfmixprec.set_policy("mixed_float16")
    with cpu_float16.process_state_kept():
        twin = _float16_net("twin")
        expected = cpu_float16.fast_float16_layers(twin)
        model = _float16_net("net")
        model.compile(optimizer="sgd", loss="mse")
        x = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
        y = np.zeros((16, 2), "float32")
        functions = []
        for _ in range(2):
            model.fit(x, y, batch_size=8, verbose=0, callbacks=[tfmixprec.LossScaleMonitor()])
            functions.append(model.train_function)
        routed = [layer.name for layer in model.layers if route_of(layer) is not None]
        assert routed == expected
        said = [line for line in capsys.readouterr().out.splitlines() if " routed " in line]
        assert len(said) == (1 if expected else 0)
        assert functions[1] is functions[0]  # the second fit ran the same trace
        assert len(traced_train_functions(model)) == 1
