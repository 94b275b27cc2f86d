"""float8: which layers `float8_layers` quantizes, the in-step counts, their readers."""

import dataclasses
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec._keras.patches import patches_of
from tfmixprec.precision import float8, float8_recipe

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def _recipe_model():
    """Every reason `float8_layers` has to leave a layer out, once."""
    inputs = keras.Input((32,), name="x")
    h = keras.layers.Dense(64, activation="relu", name="first")(inputs)
    h = keras.layers.Dense(64, activation="relu", name="middle")(h)
    h = keras.layers.Dense(24, name="narrow")(h)  # 64 x 24
    h = keras.layers.Dense(64, name="after_narrow")(h)  # 24 x 64
    h = keras.layers.Dense(64, name="kept_float32", dtype="float32")(h)
    h = keras.layers.Dense(64, name="gate", activation="sigmoid")(h)
    h = keras.layers.Dense(64, name="last_hidden")(h)
    outputs = keras.layers.Dense(16, name="logits")(h)
    return keras.Model(inputs, outputs)


RECIPE = {
    "first": "the model's first layer (its first matmul)",
    "middle": None,
    "narrow": "matmul dimensions 64 x 24 are not multiples of 16",
    "after_narrow": "matmul dimensions 24 x 64 are not multiples of 16",
    "kept_float32": "computes in float32 (the policy leaves it out)",
    "gate": "a softmax-like layer (sigmoid activation)",
    "last_hidden": None,
    "logits": "makes a model output",
}


def test_float8_layers_follows_the_recipe():
    tfmixprec.set_policy("mixed_bfloat16")
    model = _recipe_model()
    assert {layer.name: why for layer, why in float8.float8_plan(model)} == RECIPE
    changes = tfmixprec.float8_layers(model)
    assert changes == [
        tfmixprec.Float8Change("middle", "mixed_bfloat16", "float8_from_mixed_bfloat16", (64, 64)),
        tfmixprec.Float8Change(
            "last_hidden", "mixed_bfloat16", "float8_from_mixed_bfloat16", (64, 64)
        ),
    ]
    quantized = [layer.name for layer in model.layers if float8.is_float8(layer)]
    assert quantized == ["middle", "last_hidden"]
    assert tfmixprec.float8_layers(model) == []  # a second call changes nothing


def test_exclude_by_name_or_path():
    tfmixprec.set_policy("mixed_float16")
    model = _recipe_model()
    path = model.get_layer("last_hidden").path
    assert [c.layer for c in tfmixprec.float8_layers(model, exclude=[path])] == ["middle"]
    assert [c.new for c in tfmixprec.float8_layers(_recipe_model(), exclude=("middle",))] == [
        "float8_from_mixed_float16"
    ]


def _policies(model):
    return [layer.dtype_policy.name for layer in model.layers]


@pytest.mark.parametrize(
    "exclude, error, match",
    [
        ("middle", TypeError, r"exclude must be a list of layer names. Received: exclude='middle'"),
        (["middle", "nope"], ValueError, r"does not have: \['nope'\]. Use the names in"),
    ],
)
def test_bad_exclude_changes_nothing(exclude, error, match):
    tfmixprec.set_policy("mixed_bfloat16")
    model = _recipe_model()
    before = _policies(model)
    with pytest.raises(error, match=match):
        tfmixprec.float8_layers(model, exclude=exclude)
    assert _policies(model) == before and len(model.weights) == 16


def test_refuses_a_float32_model_and_a_trained_one():
    model = _recipe_model()
    with pytest.raises(ValueError, match=r"model 'functional\S*' computes in float32"):
        tfmixprec.float8_layers(model)
    tfmixprec.set_policy("mixed_bfloat16")
    model = _recipe_model()
    model.compile("sgd", "mse")
    model.fit(np.zeros((4, 32)), np.zeros((4, 16)), verbose=0)
    before = _policies(model)
    with pytest.raises(ValueError, match="optimizer is already built .* before the first fit"):
        tfmixprec.float8_layers(model)
    assert _policies(model) == before
    with pytest.raises(ValueError, match="not built"):
        tfmixprec.float8_layers(keras.Sequential([keras.layers.Dense(16)]))


def test_refuses_a_distributed_model_outside_its_scope(two_cpu_strategy):
    tfmixprec.set_policy("mixed_bfloat16")
    with two_cpu_strategy.scope():
        model = _recipe_model()
    with pytest.raises(ValueError, match=r"inside the same strategy.scope\(\)"):
        tfmixprec.float8_layers(model)
    with two_cpu_strategy.scope():
        assert len(tfmixprec.float8_layers(model)) == 2
    assert isinstance(model.get_layer("middle").inputs_scale.value, tf.distribute.DistributedValues)


def test_zoo_models_quantize_their_blocks_only():
    pytest.importorskip("keras_hub")  # the minimum-versions run has no KerasHub
    tfmixprec.set_policy("mixed_bfloat16")
    gpt2 = tfmixprec.zoo.build("gpt2", size="tiny").model
    names = [c.layer for c in tfmixprec.float8_layers(gpt2)]
    # Every projection of the block; the token embedding is the first layer and the logits
    # are its reverse call, neither a Dense.
    assert sorted(names) == sorted(
        [
            "query",
            "key",
            "value",
            "attention_output",
            "feedforward_intermediate_dense",
            "feedforward_output_dense",
        ]
    )
    vit = tfmixprec.zoo.build("vit", size="tiny").model
    plan = {layer.path: why for layer, why in float8.float8_plan(vit)}
    assert plan.pop("predictions") == "makes a model output"
    assert len(plan) == 6 and set(plan.values()) == {None}  # the patch convolution is first


def test_float16_cpu_route_is_taken_off_a_quantized_layer():
    tfmixprec.set_policy("mixed_float16")
    model = tfmixprec.MixedPrecisionFunctional(*_io(_recipe_model()))
    model.compile(tfmixprec.LossScaleOptimizer(keras.optimizers.SGD()), "mse")
    middle = model.get_layer("middle")
    # Routed as on a CPU without AVX512_FP16 (with it, no `Dense` takes the route): the
    # check runs on every CPU.
    tfmixprec.cpu_float16.fast_float16_layers(model, tfmixprec.HardwareInfo(cpu_name="Test CPU"))
    assert "call" in vars(middle)
    tfmixprec.float8_layers(model)
    assert "call" not in vars(middle) and float8.is_float8(middle)


def _io(model):
    return model.inputs, model.outputs


# --- quantization_counts: exact on constructed tensors -------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_counts_e4m3(dtype):
    # With scale 2: 1000 and -900 pass 448 * 2; 2**-12 is below half of e4m3's smallest
    # subnormal (2**-9) times 2, so it rounds to 0; 2**-8 does not.
    x = tf.constant([0.0, 2.0**-12, 2.0**-8, 1.0, 800.0, 1000.0, -900.0, 0.0], dtype)
    counts = float8.quantization_counts(x, 2.0, E4M3).numpy().tolist()
    assert counts == [8, 2, 3, 1]


def test_counts_e5m2_and_scale():
    # e5m2: largest 57344, smallest subnormal 2**-16 (half of it ties to 0). With scale 2**-10
    # the largest is 56: 57 saturates, 55 does not.
    scale = 2.0**-10
    x = tf.constant([55.0, 57.0, 2.0**-27, 2.0**-26, -(2.0**-28), 3.0, 0.0], "float32")
    counts = float8.quantization_counts(x, scale, E5M2).numpy().tolist()
    assert counts == [7, 1, 3, 2]
    zeros = float8.quantization_counts(tf.zeros([5, 3]), 1.0, E5M2)
    assert zeros.numpy().tolist() == [15, 0, 15, 0]


def test_counts_bad_format():
    with pytest.raises(ValueError, match=r"fmt must be one of .* Received: fmt='e4m3'"):
        float8.quantization_counts(tf.ones([2]), 1.0, "e4m3")


# --- the in-step counts ------------------------------------------------------------------


def _data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(0, 1, (n, 32)).astype("float32"), rng.integers(0, 16, n)


def _quantized_mlp():
    inputs = keras.Input((32,))
    h = keras.layers.Dense(64, activation="relu", name="first")(inputs)
    h = keras.layers.Dense(64, activation="gelu", name="middle")(h)
    outputs = keras.layers.Dense(16, name="logits")(h)
    model = keras.Model(inputs, outputs)
    tfmixprec.float8_layers(model)
    return model


def _expected_counts(model, x, y):
    """What one training step on (x, y) quantizes in `middle`, computed here outside the step:
    its inputs and kernel at their scales, and the gradient of the loss at its pre-activation
    (Keras quantizes the gradient right after the product; the bias passes it on)."""
    middle = model.get_layer("middle")
    first = keras.Model(model.inputs, model.get_layer("first").output)(x)
    pre = keras.ops.matmul(first, keras.ops.cast(middle._kernel, "bfloat16")) + keras.ops.cast(
        middle.bias, "bfloat16"
    )
    with tf.GradientTape() as tape:
        tape.watch(pre)
        h = middle.activation(pre)
        logits = model.get_layer("logits")(h)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, logits)
    grad = tape.gradient(loss, pre)
    return {
        "inputs": float8.quantization_counts(first, middle.inputs_scale, E4M3).numpy().tolist(),
        # The kernel as the step reads it: in float32, or in the compute dtype where Keras
        # autocasts the read inside the layer's call (Keras 3.12).
        "kernel": [
            float8.quantization_counts(kernel, middle.kernel_scale, E4M3).numpy().tolist()
            for kernel in (
                tf.convert_to_tensor(middle._kernel),
                keras.ops.cast(middle._kernel, middle.compute_dtype),
            )
        ],
        "outputs_grad": grad.shape.num_elements(),
    }


def _counts(model):
    (stats,) = tfmixprec.float8_stats(model)
    return {name: t for name, t in stats.tensors().items()}


def test_one_step_counts_what_it_quantizes():
    tfmixprec.set_policy("mixed_bfloat16")
    model = _quantized_mlp()
    x, y = _data()
    expected = _expected_counts(model, x, y)
    assert _counts(model)["inputs"].values == 0  # nothing counted before a step
    model.compile(keras.optimizers.SGD(0.0), keras.losses.SparseCategoricalCrossentropy(True))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    counts = _counts(model)
    t = counts["inputs"]
    assert [t.values, t.saturated, t.zero, t.flushed] == expected["inputs"]
    t = counts["kernel"]
    assert [t.values, t.saturated, t.zero, t.flushed] in expected["kernel"]
    assert counts["outputs_grad"].values == expected["outputs_grad"] == 32 * 64
    assert counts["inputs"].scale == 1.0  # the first step used the starting scale...
    assert counts["inputs"].amax > 0  # ...and recorded this one's amax for the next


def _fit_counts(model, x, y, **compile_kwargs):
    model.compile(
        keras.optimizers.SGD(0.0),
        keras.losses.SparseCategoricalCrossentropy(True),
        **compile_kwargs,
    )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    counts = _counts(model)
    return {n: (t.values, t.saturated, t.zero) for n, t in counts.items()}


def test_counts_agree_in_one_or_two_functions_and_across_two_replicas(two_cpu_strategy):
    # Keras's float8 layers do not train eagerly on TensorFlow (run_eagerly=True fails
    # inside Keras's own custom gradient), so the contract is tested traced.
    tfmixprec.set_policy("mixed_bfloat16")
    x, y = _data()
    keras.utils.set_random_seed(1)
    traced = _fit_counts(_quantized_mlp(), x, y)
    keras.utils.set_random_seed(1)
    model = _quantized_mlp()
    step = tfmixprec.make_train_step(model, _loss, keras.optimizers.SGD(0.0))
    again = tf.function(lambda x, y: step(x, y))  # the step inside a second function
    for i in range(2):
        again(x[16 * i : 16 * (i + 1)], y[16 * i : 16 * (i + 1)])
    two = {n: (t.values, t.saturated, t.zero) for n, t in _counts(model).items()}
    keras.utils.set_random_seed(1)
    with two_cpu_strategy.scope():
        replicas = _fit_counts(_quantized_mlp(), x, y)
    assert traced["inputs"][0] == two["inputs"][0] == replicas["inputs"][0] == 32 * 64
    assert traced["outputs_grad"][0] == replicas["outputs_grad"][0] == 32 * 64
    assert traced["kernel"] == two["kernel"]  # each replica quantizes the whole kernel:
    assert replicas["kernel"][0] == 2 * traced["kernel"][0]  # counted once per replica
    assert traced["inputs"] == two["inputs"] == replicas["inputs"]


def _loss(y, logits):
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def test_model_quantize_is_watched_from_the_start_of_fit():
    tfmixprec.set_policy("mixed_bfloat16")
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(64, name="a"), keras.layers.Dense(16, name="b")]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras: InputLayer has no quantize
        model.quantize("float8")
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(True))
    x, y = _data()
    model.fit(x, y, batch_size=16, verbose=0)  # traced before any monitor
    monitor = tfmixprec.Float8Monitor(update_freq=1)
    model.fit(x, y, batch_size=16, verbose=0, callbacks=[monitor])
    assert [step for step, _ in monitor.history] == [1, 2]
    assert [[s.layer for s in layers] for _, layers in monitor.history] == [["a", "b"]] * 2
    assert all(s.inputs.values == 16 * 32 for _, layers in monitor.history for s in layers[:1])


def test_monitor_reads_intervals_and_says_a_frozen_history_once():
    tfmixprec.set_policy("mixed_bfloat16")
    inputs = keras.Input((32,))
    h = keras.layers.Dense(64, name="first")(inputs)
    dead = keras.layers.Dense(64, name="dead")(h)  # its output never reaches the loss
    unused = keras.layers.Dense(16, name="unused")(dead)
    h = keras.layers.Dense(64, name="live")(h)
    outputs = keras.layers.Dense(16, name="logits")(h)
    model = keras.Model(inputs, [outputs, unused])
    tfmixprec.float8_layers(model)
    model.compile("sgd", [keras.losses.SparseCategoricalCrossentropy(True), None])
    warnings.filterwarnings("ignore", "Gradients do not exist")  # Keras's, for `dead`
    x, y = _data()
    monitor = tfmixprec.Float8Monitor()
    with pytest.warns(UserWarning, match="'dead': its outputs_grad amax history is still all zer"):
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[monitor])
    (_, first), (_, second) = monitor.history
    first, second = ({s.layer: s for s in read} for read in (first, second))
    assert sorted(first) == ["dead", "live"]
    assert first["live"].inputs.values == second["live"].inputs.values == 2 * 16 * 64
    # Keras updates all three histories through the gradient, which never reaches `dead`.
    assert [t.history_moved for t in first["dead"].tensors().values()] == [False] * 3
    assert [t.history_moved for t in first["live"].tensors().values()] == [True] * 3
    assert first["dead"].outputs_grad.values == 0 and first["dead"].outputs_grad.scale == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per model
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[tfmixprec.Float8Monitor()])


@pytest.mark.parametrize("bad", [0, "batch", 1.5, True])
def test_monitor_bad_update_freq(bad):
    with pytest.raises(ValueError, match=r'update_freq must be "epoch" or an integer >= 1'):
        tfmixprec.Float8Monitor(update_freq=bad)


def test_monitor_config_round_trip():
    monitor = tfmixprec.Float8Monitor(update_freq=5)
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(monitor))
    assert again.get_config() == {"update_freq": 5}


def test_saved_file_loads_and_trains(tmp_path):
    tfmixprec.set_policy("mixed_bfloat16")
    model = _quantized_mlp()
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(True))
    model.optimizer.build(model.trainable_variables)  # before fit: the step traced once
    x, y = _data()
    model.fit(x, y, batch_size=16, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert [layer.dtype_policy.name for layer in loaded.layers[1:]] == [
        "mixed_bfloat16",
        "float8_from_mixed_bfloat16",
        "mixed_bfloat16",
    ]
    middle, again = model.get_layer("middle"), loaded.get_layer("middle")
    assert float(again.inputs_scale.numpy()) == float(middle.inputs_scale.numpy()) != 1.0
    monitor = tfmixprec.Float8Monitor()
    loaded.fit(x, y, batch_size=16, verbose=0, callbacks=[monitor])
    assert monitor.history[0][1][0].inputs.values == 32 * 64


def _zoo_loss(name, float8_too, steps=60):
    """The mean training loss of `steps` steps of a tiny zoo model under mixed_bfloat16 (Adam
    1e-3), with `float8_layers` or without; and the loss of the first step. Its optimizer's
    variables are made before `fit` (after `float8_layers`), as Keras makes them under a
    distribution strategy (left to `fit`, TensorFlow traces the step twice); the same losses."""
    tfmixprec.set_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    entry = tfmixprec.zoo.build(name, size="tiny")
    if float8_too:
        assert len(tfmixprec.float8_layers(entry.model)) == 6
    entry.model.compile(keras.optimizers.Adam(1e-3), entry.loss, weighted_metrics=[])
    entry.model.optimizer.build(entry.model.trainable_variables)
    x, y, w = entry.data(steps)
    first = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: first.append(logs["loss"]) if not batch else None
    )
    history = entry.model.fit(
        x,
        y,
        sample_weight=w,
        batch_size=entry.batch_size,
        verbose=0,
        shuffle=False,
        callbacks=[record],
    )
    return history.history["loss"][-1], first[0]


def test_float8_zoo_models_train_like_bfloat16():
    pytest.importorskip("keras_hub")  # the minimum-versions run has no KerasHub
    # GPT-2: within 2% of bfloat16's loss after 60 steps (measured: 0.02%).
    bf16, _ = _zoo_loss("gpt2", False)
    f8, _ = _zoo_loss("gpt2", True)
    assert abs(f8 / bf16 - 1) <= 0.02, (f8, bf16)
    # ViT's tiny task drives its loss near 0 (0.04 from 1.1), where 3 mantissa bits move the
    # last digits: there plain float16 already ends 7% from bfloat16, float8 3%. Within 2% of
    # the loss training started from, the curves are the same.
    bf16, start = _zoo_loss("vit", False)
    f8, _ = _zoo_loss("vit", True)
    assert abs(f8 - bf16) <= 0.02 * start, (f8, bf16, start)
    assert f8 < 0.1 * start


def test_layers_of_the_same_name_are_told_apart():
    """A KerasHub GPT-2 of two blocks has a `query` (and so on) in each: the reports name them
    by path, and each read's counts are that layer's own."""
    keras_hub = pytest.importorskip("keras_hub")
    tfmixprec.set_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=64,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=8,
        dropout=0.0,
    )
    inputs = keras.Input((8,), dtype="int32")
    hidden = backbone({"token_ids": inputs, "padding_mask": keras.ops.ones_like(inputs)})
    model = keras.Model(inputs, keras.layers.Dense(16, name="head")(hidden))
    changes = [c.layer for c in tfmixprec.float8_layers(model)]
    assert len(changes) == len(set(changes)) == 12
    assert "transformer_layer_1/self_attention/query" in [
        c.split("gpt2_backbone/")[-1] for c in changes
    ]
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)  # before fit: the step traced once
    x = np.random.default_rng(0).integers(0, 64, (16, 8))
    monitor = tfmixprec.Float8Monitor(update_freq=1)
    totals = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: totals.append(tfmixprec.float8_stats(model))
    )
    model.fit(x, x % 16, batch_size=4, verbose=0, callbacks=[monitor, record])
    for (_, read), now, before in zip(monitor.history[1:], totals[1:], totals):
        assert [s.layer for s in read] == changes
        assert read == [a.since(b) for a, b in zip(now, before)]
        assert all(t.values == 0 or t.zero >= 0 for s in read for t in s.tensors().values())


def test_a_lora_layer_stays_out():
    tfmixprec.set_policy("mixed_bfloat16")
    model = _recipe_model()
    model.get_layer("middle").enable_lora(4)
    plan = {layer.name: why for layer, why in float8.float8_plan(model)}
    assert plan["middle"] == "LoRA is enabled (Keras's float8 layers do not support LoRA)"
    assert [c.layer for c in tfmixprec.float8_layers(model)] == ["last_hidden"]


class NoTraining(keras.Model):
    """A subclassed model whose `call` does not pass `training` on to its layers."""

    def __init__(self):
        super().__init__()
        self.first = keras.layers.Dense(64, name="first")
        self.middle = keras.layers.Dense(64, name="middle")
        self.out = keras.layers.Dense(16, name="logits")

    def call(self, x):
        return self.out(self.middle(self.first(x)))


def test_layers_never_called_in_training_are_said():
    tfmixprec.set_policy("mixed_bfloat16")
    model = NoTraining()
    model.build((None, 32))
    assert [c.layer for c in tfmixprec.float8_layers(model)] == ["middle"]
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(True))
    x, y = _data()
    warnings.filterwarnings("ignore", "Gradients do not exist")  # Keras's, for the scales
    frozen = r"'middle': its inputs amax history is still all zeros .*\(no training call"
    with pytest.warns(UserWarning, match=frozen):
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[tfmixprec.Float8Monitor()])


def test_the_recipe_is_one_frozen_value():
    recipe = float8_recipe.RECIPE
    assert tfmixprec.float8.RECIPE is recipe  # 0.4.0's module path shows it too
    assert recipe == tfmixprec.Float8Recipe()
    assert (recipe.alignment, recipe.excluded_roles) == (16, ("output", "softmax", "first"))
    assert [(t.name, t.format, t.maximum) for t in recipe.tensors] == [
        ("inputs", E4M3, 448.0),
        ("kernel", E4M3, 448.0),
        ("outputs_grad", E5M2, 57344.0),
    ]
    assert (recipe.tensor("kernel").scale, recipe.tensor("kernel").amax_history) == (
        "kernel_scale",
        "kernel_amax_history",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.alignment = 8


def test_the_plan_follows_the_recipe_it_reads(monkeypatch):
    """A recipe aligned to 8 that keeps no role out: the plan takes the layers the default
    recipe leaves out for their sizes and roles, and only those."""
    monkeypatch.setattr(
        float8_recipe, "RECIPE", tfmixprec.Float8Recipe(alignment=8, excluded_roles=())
    )
    tfmixprec.set_policy("mixed_bfloat16")
    plan = {layer.name: why for layer, why in float8.float8_plan(_recipe_model())}
    assert plan == {name: None for name in RECIPE} | {"kept_float32": RECIPE["kept_float32"]}


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"alignment": 0}, ValueError, "alignment must be a positive int. Received: alignment=0"),
        ({"alignment": 16.0}, TypeError, "Received: alignment=16.0"),
        ({"alignment": True}, TypeError, "Received: alignment=True"),
        ({"excluded_roles": ("output", "last")}, ValueError, r"unknown roles \['last'\]"),
        (
            {"tensors": (tfmixprec.Float8Tensor("inputs", "s", "h", "float8_e4m3"),)},
            ValueError,
            r"unknown float8 formats \['float8_e4m3'\]",
        ),
    ],
)
def test_a_bad_recipe_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        tfmixprec.Float8Recipe(**kwargs)


def test_a_recipe_names_its_tensors():
    with pytest.raises(ValueError, match=r"\['inputs', 'kernel', 'outputs_grad'\], not 'bias'"):
        float8_recipe.RECIPE.tensor("bias")


def test_an_empty_count_has_no_share():
    """One statistics type with one empty count: `float8_stats` before any step gives nan
    (as a replay's tensor that no gradient reached does), and the tables print `-`."""
    tfmixprec.set_policy("mixed_bfloat16")
    empty = _counts(_quantized_mlp())["inputs"]
    assert isinstance(empty, tfmixprec.Float8TensorStats) and empty.values == 0
    shares = (empty.saturated_fraction, empty.underflow_fraction, empty.flushed_fraction)
    assert all(np.isnan(share) for share in shares)
    assert [float8_recipe.percent(share) for share in (shares[0], 0.125)] == ["-", "12.50%"]
    assert tfmixprec.Float8Quantized is tfmixprec.Float8TensorStats  # 0.4.0's name


@pytest.mark.filterwarnings("ignore:Layer InputLayer does not have a `quantize` method")
def test_the_counters_are_patches_and_unwatching_leaves_the_layer_as_keras_made_it():
    """The counter variables and the watched forward are patches of the registry (made by
    "float8 counters"); `unwatch_float8` takes both out: the layer holds exactly what it held
    before, its weights are Keras's, and a step after it counts nothing."""
    tfmixprec.set_policy("mixed_bfloat16")
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(64, name="a"), keras.layers.Dense(16, name="b")],
        name="f8",
    )
    model.quantize("float8")
    model.compile(keras.optimizers.SGD(0.0), keras.losses.SparseCategoricalCrossentropy(True))
    x, y = _data()
    model.fit(x, y, batch_size=16, verbose=0)  # built and traced before any watch
    layer = model.get_layer("a")
    before, weights = dict(vars(layer)), [v.path for v in layer.weights]
    assert float8.watch_float8(model) == ["f8/a", "f8/b"]
    entry = "_float8_call" if hasattr(keras.layers.Dense, "_float8_call") else "quantized_call"
    assert [(p.attribute, p.who) for p in patches_of(layer)] == [
        (entry, "float8 counters"),
        ("_tfmixprec_float8_counts", "float8 counters"),
    ]
    assert [v.path for v in layer.weights] == weights  # the counters are not Keras weights
    model.fit(x, y, batch_size=16, verbose=0)
    assert _counts_of(model) == [16 * 32 * 2, 64 * 16 * 2]  # a's and b's inputs, two steps
    assert float8.unwatch_float8(model) == ["f8/a", "f8/b"]
    assert vars(layer).keys() == before.keys()
    assert all(vars(layer)[name] is value for name, value in before.items())
    assert patches_of(layer) == [] and float8.unwatch_float8(model) == []
    model.fit(x, y, batch_size=16, verbose=0)  # traced again, with Keras's own forward
    assert _counts_of(model) == [0, 0]
    assert float8.watch_float8(model) == ["f8/a", "f8/b"]  # new counters
    assert _counts_of(model) == [0, 0]


def _counts_of(model):
    return [s.inputs.values for s in tfmixprec.float8_stats(model)]
