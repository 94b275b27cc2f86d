"""Tests of `tfmixprec.audit`: each problem on a model built to have it, none on a clean one."""

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.common import global_state
from tensorflow.python.eager import context as tf_context

import tfmixprec
from tfmixprec._common.observe import observe
from tfmixprec.precision import cpu_float16, float8_recipe
from tfmixprec.precision.hardware import GPUInfo, HardwareInfo
from tfmixprec.tools import cli

# The model's own findings, the same on any machine; the machine's are tested on their own.
A100 = HardwareInfo(gpus=(GPUInfo("NVIDIA A100", (8, 0)),))
CPU_ONLY = HardwareInfo(cpu_name="Test CPU")
SAPPHIRE_RAPIDS = HardwareInfo(
    cpu_name="Xeon", cpu_flags=frozenset({"avx512_bf16", "avx512_fp16", "amx_bf16"})
)


def _python(args, cwd=None, timeout=300):
    """Runs `python ARGS` in a process of its own (the audit's process-wide switches stay
    there), TensorFlow quiet; returns the finished process."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )


def _codes(report):
    return [(f.severity, f.code, f.layer) for f in report.findings]


def _float16_stack(name):
    """16 -> 32 -> 8 under mixed_float16, with a float32 softmax: right for float16."""
    tfmixprec.set_policy("mixed_float16")
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="hidden"),
            keras.layers.Dense(8, name="logits"),
            keras.layers.Softmax(name="probs", dtype="float32"),
        ],
        name=name,
    )


def _clean_model():
    model = _float16_stack("clean")
    model.compile(optimizer=tfmixprec.LossScaleOptimizer(keras.optimizers.Adam()), loss="mse")
    return model


def test_clean_model_has_no_findings():
    report = tfmixprec.audit(_clean_model(), hardware=A100)
    assert report.findings == []
    assert report.ok
    assert "No findings: the model is ready for mixed precision." in str(report)
    assert [(r.layer, r.compute_dtype, r.variable_dtype) for r in report.layers] == [
        ("hidden", "float16", "float32"),
        ("logits", "float16", "float32"),
        ("probs", "float32", "float32"),
    ]


def test_outputs_and_alignment_findings():
    tfmixprec.set_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((130,)),
            keras.layers.Dense(300, activation="relu", name="odd"),
            keras.layers.Dense(10, activation="softmax", name="attn"),
            keras.layers.Dense(8, name="out"),
        ]
    )
    report = tfmixprec.audit(model, hardware=A100)
    # The softmax inside the model feeds a float16 layer: not flagged. The output is. The
    # 10-wide products are too small for their alignment to matter (LARGE_PRODUCT).
    assert _codes(report) == [
        ("error", "low-precision-output", "out"),
        ("warning", "tensor-core-alignment", "odd"),
        ("warning", "tensor-core-alignment", "odd"),
        ("info", "not-compiled", None),
    ]
    assert [(f.message, f.fix) for f in report.warnings] == [
        (
            "units is 300, not a multiple of 8: on a GPU, Tensor Cores run float16 matmuls "
            "fastest on multiples of 8; padding it to 304 adds 1.3% to the product's work.",
            "Pad units to 304.",
        ),
        (
            "input features is 130, not a multiple of 8: on a GPU, Tensor Cores run float16 "
            "matmuls fastest on multiples of 8; padding it to 136 adds 4.6% to the product's "
            "work.",
            "Pad input features to 136.",
        ),
    ]
    assert not report.ok
    text = str(report)
    assert "ERROR   low-precision-output [out]: produces a model output in float16" in text
    assert "Summary: 1 error, 2 warnings, 1 info" in text
    # After the fix the errors are gone.
    assert [c.layer for c in tfmixprec.float32_outputs(model)] == ["out"]
    assert [f.code for f in tfmixprec.audit(model).errors] == []


@pytest.mark.parametrize(
    "features, units, fixes",
    [
        # The smaller of N and K from 128 (LARGE_PRODUCT): each misaligned one is reported.
        (128, 129, ["Pad units to 136."]),
        (129, 128, ["Pad input features to 136."]),
        (129, 1001, ["Pad units to 1008.", "Pad input features to 136."]),
        # Under 128, the product is memory-bound on a GPU: nothing, however large the other.
        (127, 129, []),
        (129, 127, []),
        (20, 1001, []),
        (1000, 10, []),  # a 10-class head: padded to 16, 60% more work for nothing
    ],
)
def test_alignment_is_reported_for_products_large_enough(features, units, fixes):
    tfmixprec.set_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(units, name="d")])
    findings = [f for f in tfmixprec.audit(model, hardware=A100).findings if f.layer == "d"]
    aligned = [f for f in findings if f.code == "tensor-core-alignment"]
    assert [f.fix for f in aligned] == fixes
    assert {f.severity for f in aligned} <= {"warning"}


def test_alignment_on_a_machine_without_a_gpu_is_an_info_about_gpu_runs():
    """The reporter's case: on a CPU-only machine the finding concerns GPU runs (info); the
    same model audited for a GPU, or under a policy (the machine it trains on unknown), warns."""
    tfmixprec.set_policy("mixed_bfloat16")
    model = keras.Sequential(
        [
            keras.Input((256,)),
            keras.layers.Dense(250, name="hidden"),
            keras.layers.Dense(10, dtype="float32", name="probs"),
        ]
    )
    (on_cpu,) = tfmixprec.audit(model, hardware=CPU_ONLY).findings
    assert (on_cpu.severity, on_cpu.code, on_cpu.layer) == (
        "info",
        "tensor-core-alignment",
        "hidden",
    )
    assert on_cpu.message == (
        "units is 250, not a multiple of 8: on a GPU, Tensor Cores run bfloat16 matmuls "
        "fastest on multiples of 8; padding it to 256 adds 2.4% to the product's work. This "
        "machine has no GPU: only GPU runs gain."
    )
    (on_gpu,) = tfmixprec.audit(model, hardware=A100).findings
    assert on_gpu.severity == "warning" and on_cpu.message.startswith(on_gpu.message)
    under_policy = tfmixprec.audit(model, policy="mixed_bfloat16").findings
    assert [(f.severity, f.code) for f in under_policy] == [("warning", "tensor-core-alignment")]
    # A float32 model on that machine: what the recommended policy would find, as an info.
    tfmixprec.set_policy("float32")
    plain = keras.Sequential([keras.Input((256,)), keras.layers.Dense(250, name="hidden")])
    bf16_cpu = HardwareInfo(cpu_name="Test CPU", cpu_flags=frozenset({"avx512_bf16"}))
    (finding,) = tfmixprec.audit(plain, hardware=bf16_cpu).findings
    assert finding.code == "float32-model"
    assert "tensor-core-alignment [hidden] (info)" in finding.message


def test_a_softmax_output_is_its_own_error():
    tfmixprec.set_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="softmax")])
    (finding,) = tfmixprec.audit(model, hardware=A100).errors
    assert (finding.code, finding.message) == (
        "low-precision-softmax",
        "softmax activation computed in bfloat16 produces a model output: it saturates and "
        "loses small probabilities, whose log the loss takes.",
    )


def test_outputs_are_judged_by_the_dtype_a_real_call_returns():
    """KerasHub's causal LMs return float32 logits from a float16 `ReversibleEmbedding`
    (Keras infers float16 symbolically); a layer that casts its own output is judged the
    same way."""
    tfmixprec.set_policy("mixed_float16")
    tokens = keras.Input((5,), dtype="int32")
    embedding = keras.layers.ReversibleEmbedding(64, 16, reverse_dtype="float32", name="tied")
    hidden = keras.layers.Dense(16, name="hidden")(embedding(tokens))
    model = keras.Model(tokens, embedding(hidden, reverse=True))
    assert model.outputs[0].dtype == "float16"
    assert _codes(tfmixprec.audit(model, hardware=A100)) == [("info", "not-compiled", None)]
    # Computed in float16, the reverse projection is a matmul of N = vocabulary, K = width.
    # (Without reverse_dtype it computes in float32 too: Keras does not autocast an
    # Embedding's variables, so float16 inputs meet a float32 kernel.)
    embedding = keras.layers.ReversibleEmbedding(1001, 128, reverse_dtype="float16", name="tied")
    model = keras.Model(tokens, embedding(keras.layers.Dense(128)(embedding(tokens)), reverse=True))
    report = tfmixprec.audit(model, hardware=A100)
    assert _codes(report) == [
        ("error", "low-precision-output", "tied"),
        ("warning", "tensor-core-alignment", "tied"),
        ("info", "not-compiled", None),
    ]
    assert (
        report.warnings[0].fix
        == "Pad vocabulary size (input_dim) of the reverse projection to 1008."
    )


def test_an_output_made_outside_any_layer():
    class Scaled(keras.Model):
        def __init__(self):
            super().__init__()
            self.out = keras.layers.Dense(8, dtype="float32", name="out")
            self.hidden = keras.layers.Dense(8, name="hidden")

        def call(self, x):
            return self.hidden(self.out(x)) * 2.0  # float16: the Dense after the output

    tfmixprec.set_policy("mixed_float16")
    model = Scaled()
    model(keras.ops.zeros((2, 8)))
    (finding,) = tfmixprec.audit(model, hardware=A100).errors
    assert (finding.code, finding.layer) == ("low-precision-output", None)
    assert finding.message.startswith("1 model output(s) in float16 made outside any layer")
    assert tfmixprec.float32_outputs(model) == []  # no layer's dtype can fix it


def test_conv_embedding_attention_alignment():
    tfmixprec.set_policy("mixed_bfloat16")
    image = keras.Input((8, 8, 60))
    conv = keras.layers.Conv2D(130, 3, name="conv")(image)  # K = 60 x 3 x 3 = 540
    small = keras.layers.Conv2D(6, 3, name="small")(image)  # N = 6: too small to matter
    tokens = keras.Input((5,), dtype="int32")
    embedded = keras.layers.Embedding(1001, 200, name="embed")(tokens)
    attended = keras.layers.MultiHeadAttention(2, key_dim=132, name="mha")(embedded, embedded)
    flat = keras.layers.Concatenate()(
        [keras.layers.Flatten()(conv), keras.layers.Flatten()(small)]
        + [keras.layers.Flatten()(attended)]
    )
    out = keras.layers.Dense(8, dtype="float32", name="out")(flat)
    model = keras.Model([image, tokens], out)
    report = tfmixprec.audit(model, hardware=A100)
    messages = {(f.layer, f.fix) for f in report.warnings}
    assert messages == {
        ("conv", "Pad filters to 136."),
        ("conv", "Pad input channels to 64."),
        # The attention's projections (N = 2 heads x 132 = 264) are multiples of 8.
        ("mha", "Pad head size (key_dim) to 136."),
    }
    # bfloat16 needs no loss scaling and the output is float32. The embedding lookup is a
    # gather: no matmul sizes.
    assert report.errors == []


def _image_stem(channels, between):
    """Images of `channels` channels through the layers `between()` makes, then a convolution
    at stride 2 ("stem") and one at stride 1 ("body"), all under mixed_float16."""
    tfmixprec.set_policy("mixed_float16")
    image = keras.Input((16, 16, channels))
    x = image
    for layer in between():
        x = layer(x)
    # Large enough to be reported: N = 128 filters, K = 3 channels x 7 x 7 = 147.
    x = keras.layers.Conv2D(128, 7, strides=2, name="stem")(x)
    x = keras.layers.Conv2D(16, 3, name="body")(x)
    out = keras.layers.Dense(8, dtype="float32", name="out")(keras.layers.Flatten()(x))
    return keras.Model(image, out)


@pytest.mark.parametrize(
    "channels, between, fix",
    [
        # Keras's EfficientNetV2 stem: the image reaches it through a Rescaling and a
        # Normalization, which keep its channels.
        (
            3,
            lambda: [
                keras.layers.Rescaling(1 / 255),
                keras.layers.Normalization(mean=[0.5, 0.5, 0.5], variance=[0.25, 0.25, 0.25]),
            ],
            4,
        ),
        (
            3,
            lambda: [
                keras.layers.Resizing(14, 14),
                keras.layers.ZeroPadding2D(1),
                keras.layers.BatchNormalization(),
                keras.layers.Activation("relu"),
            ],
            4,
        ),
        (4, lambda: [keras.layers.RandomFlip(), keras.layers.CenterCrop(12, 12)], None),
        # A convolution of 3 filters on the image makes new features: the stem is not first,
        # and its 3 channels padded to 8 would cost 167% more work: not reported.
        (3, lambda: [keras.layers.Conv2D(3, 1, name="mix")], None),
    ],
    ids=["rescaling-normalization", "resizing-padding-norm-relu", "flip-crop", "convolution"],
)
def test_an_images_first_convolution_behind_layers_that_keep_its_channels(channels, between, fix):
    report = tfmixprec.audit(_image_stem(channels, between), hardware=A100)
    stem = [(f.message, f.fix) for f in report.warnings if f.layer == "stem"]
    if fix is None:
        assert stem == []
    else:
        assert stem == [
            (
                "input channels (a first convolution's, at stride >= 2) is 3, not a multiple "
                "of 4: on a GPU, Tensor Cores run float16 convolutions fastest on multiples "
                "of 4; padding it to 4 adds 33.3% to the product's work.",
                "Pad input channels (a first convolution's, at stride >= 2) to 4.",
            )
        ]


def test_efficientnetv2_has_no_product_large_enough_for_alignment():
    """keras.applications' EfficientNetV2B0: its stem (3 channels at stride 2, 3x3, 32
    filters: K = 27) and its squeeze-and-excitation convolutions (16 or 32 wide) are products
    too small for their alignment to matter (LARGE_PRODUCT): its softmax output is the one
    finding beside the compile."""
    tfmixprec.set_policy("mixed_float16")
    model = keras.applications.EfficientNetV2B0(weights=None, input_shape=(32, 32, 3), classes=8)
    report = tfmixprec.audit(model, hardware=A100)
    assert [(f.severity, f.code, f.layer) for f in report.findings] == [
        ("error", "low-precision-softmax", "predictions"),
        ("info", "not-compiled", None),
    ]


def test_einsum_sizes_are_the_lowered_matmul_sizes():
    """Grouped-query attention projections: the heads they keep are batch dimensions of the
    matmul, so 2 heads of 64 make N = 128 (Llama), 1 head of 128 N = 128 (Gemma)."""
    tfmixprec.set_policy("mixed_float16")
    x = keras.Input((5, 256))
    key = keras.layers.EinsumDense("bkm,mvh->bkvh", (5, 2, 64), name="key")(x)
    one = keras.layers.EinsumDense("bkm,mvh->bkvh", (5, 1, 128), name="one")(x)
    merged = keras.layers.EinsumDense("bquh,uhm->bqm", (5, 256), name="merged")(key)
    odd = keras.layers.EinsumDense("bkm,mvh->bkvh", (5, 2, 65), name="odd")(x)
    out = keras.layers.Concatenate()([keras.layers.Flatten()(t) for t in (merged, one, odd)])
    model = keras.Model(x, keras.layers.Dense(8, dtype="float32", name="out")(out))
    findings = tfmixprec.audit(model, hardware=A100).warnings
    assert [(f.layer, f.message.split(":")[0], f.fix) for f in findings] == [
        (
            "odd",
            "output size (equation dimensions 'vh', 2x65 = 130) is 130, not a multiple of 8",
            "Pad output size (equation dimensions 'vh', 2x65 = 130) to 136.",
        )
    ]


def test_float16_model_with_plain_optimizer():
    tfmixprec.set_policy("mixed_float16")
    hidden = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(8, dtype="float32")]
    )
    hidden.compile(optimizer=keras.optimizers.Adam(), loss="mse", auto_scale_loss=False)
    report = tfmixprec.audit(hidden, hardware=A100)
    assert _codes(report) == [("error", "no-loss-scaling", None)]
    assert "optimizer Adam does not scale the loss" in report.errors[0].message
    hidden.compile(optimizer="adam", loss="mse")  # Keras wraps in its own LSO: accepted
    assert tfmixprec.audit(hidden, hardware=A100).findings == []


def test_on_a_cpu_says_which_float16_layers_run_slow_kernels_until_routed():
    model = _clean_model()
    (finding,) = tfmixprec.audit(model, hardware=CPU_ONLY).findings
    assert (finding.severity, finding.code) == ("info", "cpu-float16-kernels")
    assert finding.message == (
        "on this machine (no GPU), 2 float16 layer(s) ('hidden', 'logits') run TensorFlow "
        "float16 CPU kernels that are slow on this CPU: "
        f"{tfmixprec.cpu_float16.PRODUCTS.why} (benchmarks/RESULTS.md, 16)."
    )
    assert "tfmixprec.cpu_float16.fast_float16_layers(model)" in finding.fix
    assert tfmixprec.audit(model, hardware=A100).findings == []  # a GPU has no such kernels
    # With AVX512_FP16 a float16 Dense runs at float32's speed: nothing to route.
    assert tfmixprec.audit(model, hardware=SAPPHIRE_RAPIDS).findings == []
    tfmixprec.cpu_float16.fast_float16_layers(model, CPU_ONLY)
    assert tfmixprec.audit(model, hardware=CPU_ONLY).findings == []


def test_on_a_cpu_with_avx512_fp16_gives_the_reason_true_there():
    tfmixprec.set_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(4, 3, name="conv"),
            keras.layers.Flatten(),
            keras.layers.Dense(8, name="hidden"),
            keras.layers.Dense(2, dtype="float32", name="out"),
        ]
    )
    model.compile(optimizer=tfmixprec.LossScaleOptimizer(keras.optimizers.Adam()), loss="mse")
    kernels = "cpu-float16-kernels"
    findings = tfmixprec.audit(model, hardware=SAPPHIRE_RAPIDS).findings
    (finding,) = [f for f in findings if f.code == kernels]
    assert "1 float16 layer(s) ('conv') run" in finding.message
    assert tfmixprec.cpu_float16.CONVOLUTIONS.why in finding.message
    assert "without AVX512_FP16" not in finding.message  # not this CPU's reason
    (finding,) = [
        f for f in tfmixprec.audit(model, hardware=CPU_ONLY).findings if f.code == kernels
    ]
    assert "2 float16 layer(s) ('conv', 'hidden') run" in finding.message
    assert tfmixprec.cpu_float16.PRODUCTS.why in finding.message


def test_cpu_float16_kernels_judges_each_layer_not_its_name():
    """Nested layers share names (each KerasHub block has its `query`): with one of two
    `query` layers routed, the other is still reported, and once both are, none is."""
    tfmixprec.set_policy("mixed_float16")

    def block(name):
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="query")], name=name)

    first, second = block("first"), block("second")
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(2, dtype="float32", name="out")(second(first(inputs)))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=tfmixprec.LossScaleOptimizer(keras.optimizers.SGD()), loss="mse")
    tfmixprec.cpu_float16.fast_float16_layers(first, CPU_ONLY)
    kernels = "cpu-float16-kernels"
    (finding,) = [
        f for f in tfmixprec.audit(model, hardware=CPU_ONLY).findings if f.code == kernels
    ]
    assert "1 float16 layer(s) ('query') run" in finding.message
    tfmixprec.cpu_float16.fast_float16_layers(second, CPU_ONLY)
    codes = [f.code for f in tfmixprec.audit(model, hardware=CPU_ONLY).findings]
    assert kernels not in codes


def test_warns_of_xla_with_bfloat16_on_a_cpu():
    tfmixprec.set_policy("mixed_bfloat16")
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(8, dtype="float32")]
    )
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    (finding,) = tfmixprec.audit(model, hardware=CPU_ONLY).findings
    assert (finding.severity, finding.code) == ("warning", "xla-bfloat16-cpu")
    assert finding.fix == "Compile with jit_compile=False (Keras's default on CPUs)."
    assert tfmixprec.audit(model, hardware=A100).findings == []
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    assert tfmixprec.audit(model, hardware=CPU_ONLY).findings == []


def test_float16_variables():
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8, dtype="float16", name="half")]
    )
    report = tfmixprec.audit(model)
    codes = [(f.code, f.layer) for f in report.errors]
    assert ("low-precision-variable", "half") in codes
    variable_errors = [f for f in report.errors if f.code == "low-precision-variable"]
    assert len(variable_errors) == 2  # kernel and bias
    assert "stored in float16; master weights must stay float32" in variable_errors[0].message


def test_policy_override_audits_float32_model_for_mixed():
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8, name="a"), keras.layers.Dense(4, name="b")]
    )
    assert [f.code for f in tfmixprec.audit(model).findings] == ["float32-model"]
    report = tfmixprec.audit(model, policy="mixed_float16")
    assert report.policy == "mixed_float16"
    assert ("error", "low-precision-output", "b") in _codes(report)
    assert [r.compute_dtype for r in report.layers] == ["float16", "float16"]
    assert keras.config.dtype_policy().name == "float32"  # nothing changed
    assert model.layers[0].dtype_policy.name == "float32"


def test_report_conversions():
    tfmixprec.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3, name="out")], name="m")
    report = tfmixprec.audit(model)
    data = report.to_dict()
    assert data["model"] == "m" and data["ok"] is False
    assert data["findings"][0]["code"] == "low-precision-output"
    assert json.loads(report.to_json()) == data
    markdown = report.to_markdown()
    assert markdown.startswith("## Mixed-precision audit of `m` (policy `mixed_float16`)")
    assert "| error | out | produces a model output in float16" in markdown
    assert "| out | Dense | float16 | float32 |" in markdown


def test_audit_bad_input():
    with pytest.raises(TypeError, match=r"audit expects a keras.Model.*builtins.int"):
        tfmixprec.audit(3)
    unbuilt = keras.Sequential([keras.layers.Dense(3)], name="later")
    with pytest.raises(ValueError, match=r"Model 'later' is not built"):
        tfmixprec.audit(unbuilt)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match=r"Did you mean 'mixed_float16'"):
        tfmixprec.audit(model, policy="mixed_float61")


def test_a_layer_check_added_to_the_table_runs_on_every_leaf_layer(monkeypatch):
    # `tfmixprec.audit` is the function; the module holds the table.
    audit_module = importlib.import_module("tfmixprec.audit")

    def has_bias(layer, context):
        if not getattr(layer, "use_bias", False):
            return []
        message = f"has a bias in {context.compute_dtype(layer)}"
        return [tfmixprec.Finding("info", "has-bias", layer.name, message, "None needed.")]

    monkeypatch.setattr(audit_module, "CHECKS", audit_module.CHECKS + (("layer", has_bias),))
    inner = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="inner")])
    model = keras.Sequential([keras.Input((8,)), inner, keras.layers.Dense(8, name="outer")])
    report = tfmixprec.audit(model, hardware=A100)
    assert [(f.code, f.layer, f.message) for f in report.findings][:2] == [
        ("has-bias", "inner", "has a bias in float32"),
        ("has-bias", "outer", "has a bias in float32"),
    ]
    assert [f.code for f in report.findings][2:] == ["float32-model"]


# float8 layers: judged as `float8_layers` would leave them out, on the observed call.

H100 = HardwareInfo(gpus=(GPUInfo("NVIDIA H100", (9, 0)),))  # float8 Tensor Cores
FLOAT8_PAGE = (
    ' See the tfmixprec guide "float8" (docs/guides/float8.md in the tfmixprec repository).'
)
FLOAT8_FIX = (
    "Quantize the model with tfmixprec.float8_layers(model) instead of "
    "model.quantize('float8'): it leaves this layer out of float8."
)


def _float8_mlp(units=32, activation="relu", **middle):
    """16 -> 32 -> units -> 8 under mixed_bfloat16, the output layer in float32."""
    tfmixprec.set_policy("mixed_bfloat16")
    return keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="first"),
            keras.layers.Dense(units, activation=activation, name="middle", **middle),
            keras.layers.Dense(8, dtype="float32", name="out"),
        ],
        name="float8_mlp",
    )


def _float8_codes(report):
    return [c for c in _codes(report) if c[1].startswith("float8")]


@pytest.mark.filterwarnings("ignore:Layer InputLayer does not have a `quantize` method")
def test_model_quantize_float8_quantizes_the_output_and_first_layers():
    model = _float8_mlp()
    assert _float8_codes(tfmixprec.audit(model, hardware=CPU_ONLY)) == []  # no float8 yet
    model.quantize("float8")
    assert model.get_layer("out").dtype_policy.name == "float8_from_float32"
    batch = np.linspace(-1, 1, 32, dtype="float32").reshape(2, 16)
    before = model(batch).numpy()
    report = tfmixprec.audit(model, hardware=H100)
    assert _codes(report) == [
        ("error", "float8-output-layer", "out"),
        ("warning", "float8-first-layer", "first"),
    ]
    output, first = report.findings
    assert output.message == (
        "quantized to float8 (float8_from_float32), it makes a model output: the loss sees "
        "values computed from e4m3 inputs and kernel (3 mantissa bits)." + FLOAT8_PAGE
    )
    assert first.message == (
        "quantized to float8 (float8_from_mixed_bfloat16) as the model's first matmul layer, "
        "which Transformer Engine's recipe keeps out of float8: it quantizes the model's "
        "inputs to e4m3 (3 mantissa bits)." + FLOAT8_PAGE
    )
    assert output.fix == first.fix == FLOAT8_FIX
    # The audit saw the float8 layers' own calls, and left them as they were.
    for layer in model.layers:
        assert "call" not in vars(layer) and "quantized_call" not in vars(layer)
    np.testing.assert_array_equal(model(batch).numpy(), before)


def test_float8_layers_leaves_only_the_machine_info():
    model = _float8_mlp()
    assert [c.layer for c in tfmixprec.float8_layers(model)] == ["middle"]
    assert tfmixprec.audit(model, hardware=H100).findings == []
    (finding,) = tfmixprec.audit(model, hardware=CPU_ONLY).findings
    assert (finding.severity, finding.code, finding.layer) == ("info", "float8-no-gain", None)
    assert finding.message == (
        "1 float8 layer(s) ('middle') run here as emulated quantize-dequantize, slower than "
        "bfloat16 alone: no GPU with float8 Tensor Cores (compute capability 8.9 or later), "
        "so float8 is useful here for checking numerics." + FLOAT8_PAGE
    )
    assert _float8_codes(tfmixprec.audit(model, hardware=A100)) == [  # Ampere: no float8
        ("info", "float8-no-gain", None)
    ]
    assert [f for f in tfmixprec.audit(model).findings if f.severity != "info"] == []


def test_a_float8_layer_with_sizes_not_multiples_of_16():
    model = _float8_mlp(units=24)  # a multiple of 8: no tensor-core-alignment warning
    model.get_layer("middle").quantize("float8")
    (finding,) = tfmixprec.audit(model, hardware=H100).findings
    assert (finding.severity, finding.code, finding.layer) == (
        "warning",
        "float8-misaligned",
        "middle",
    )
    assert finding.message == (
        "units (24) is not a multiple of 16: float8 Tensor Cores need both matmul dimensions "
        "(input features 32, units 24) to be." + FLOAT8_PAGE
    )
    assert finding.fix == (
        "Pad units to 32, or leave the layer out of float8 (tfmixprec.float8_layers does)."
    )


def test_the_audit_follows_the_float8_recipe_it_reads(monkeypatch):
    """The audit's float8 findings read `float8.RECIPE`: aligned to 8 with no excluded role,
    neither the 24-unit layer nor `model.quantize`'s output and first layers are found for
    their sizes or roles."""
    model = _float8_mlp(units=24)
    model.quantize("float8")
    found = _float8_codes(tfmixprec.audit(model, hardware=H100))
    assert [code for _, code, _ in found] == [
        "float8-output-layer",
        "float8-first-layer",
        "float8-misaligned",
    ]
    monkeypatch.setattr(
        float8_recipe, "RECIPE", tfmixprec.Float8Recipe(alignment=8, excluded_roles=())
    )
    # `out` computes in float32: with its role no longer a reason, the next reason is found.
    assert _float8_codes(tfmixprec.audit(model, hardware=H100)) == [
        ("warning", "float8-no-gain", "out")
    ]


def test_a_float8_layer_computing_in_float32_gains_nothing():
    model = _float8_mlp(dtype="float32")
    model.get_layer("middle").quantize("float8")
    (finding,) = tfmixprec.audit(model, hardware=H100).findings
    assert (finding.severity, finding.code, finding.layer) == (
        "warning",
        "float8-no-gain",
        "middle",
    )
    assert finding.message == (
        "quantized to float8 (float8_from_float32) but computes in float32: the "
        "quantize-dequantize around a float32 matmul costs time and precision and gains "
        "nothing." + FLOAT8_PAGE
    )
    assert finding.fix == (
        "Quantize only layers that compute in bfloat16 or float16: build under a mixed policy "
        "and call tfmixprec.float8_layers(model), which leaves float32 layers out."
    )
    assert _float8_codes(tfmixprec.audit(model, hardware=CPU_ONLY)) == [
        ("warning", "float8-no-gain", "middle"),
        ("info", "float8-no-gain", None),
    ]


def test_a_softmax_like_float8_layer_inside_the_model_is_a_warning():
    model = _float8_mlp(activation="sigmoid")
    model.get_layer("middle").quantize("float8")
    (finding,) = tfmixprec.audit(model, hardware=H100).findings
    assert (finding.severity, finding.code, finding.layer) == (
        "warning",
        "float8-output-layer",
        "middle",
    )
    assert finding.message == (
        "quantized to float8 (float8_from_mixed_bfloat16), its sigmoid activation reads "
        "logits computed from e4m3 inputs and kernel (3 mantissa bits)." + FLOAT8_PAGE
    )


@pytest.mark.filterwarnings("ignore::UserWarning:keras.src.models.model")  # layers it skips
def test_float8_on_models_you_did_not_write():
    """KerasHub's GPT-2 through float8_layers: only the machine's info. Its logits are the
    token embedding's reverse call, so Keras's own model.quantize quantizes the same six
    projections. ViT's model.quantize quantizes its classifier head."""
    tfmixprec.set_policy("mixed_bfloat16")
    gpt2 = tfmixprec.zoo.build("gpt2", size="tiny").model
    assert len(tfmixprec.float8_layers(gpt2)) == 6
    assert _float8_codes(tfmixprec.audit(gpt2, hardware=H100)) == []
    (finding,) = [f for f in tfmixprec.audit(gpt2, hardware=CPU_ONLY).findings if "8" in f.code]
    assert (finding.severity, finding.code) == ("info", "float8-no-gain")
    assert finding.message.startswith("6 float8 layer(s) ('query', 'key', 'value', ...) run")
    vit = tfmixprec.zoo.build("vit", size="tiny").model
    vit.quantize("float8")
    report = tfmixprec.audit(vit, hardware=H100)
    assert _float8_codes(report) == [("error", "float8-output-layer", "predictions")]
    assert report.errors[-1].fix == FLOAT8_FIX


# Saved files: audited as they were saved, the same as the model in memory.


def _float16_classifier(**compile_kwargs):
    model = _float16_stack("classifier")
    model.compile(optimizer="sgd", loss="mse", **compile_kwargs)
    keras.config.set_dtype_policy("float32")  # as in a process that loads the file
    return model


@pytest.mark.parametrize("scaled", [True, False])
def test_a_saved_model_audits_as_the_model_in_memory(tmp_path, scaled, recwarn):
    model = _float16_classifier(**({} if scaled else {"auto_scale_loss": False}))
    model.save(tmp_path / "m.keras")
    in_memory = tfmixprec.audit(model, hardware=A100)
    from_file = tfmixprec.audit(str(tmp_path / "m.keras"), hardware=A100)
    assert from_file.findings == in_memory.findings
    assert from_file.layers == in_memory.layers
    assert from_file.policy == in_memory.policy == "mixed_float16"
    expected = [] if scaled else [("error", "no-loss-scaling", None)]
    assert _codes(from_file) == expected
    assert keras.config.dtype_policy().name == "float32"  # the global policy is back
    assert not [w for w in recwarn if "Skipping variable loading" in str(w.message)]


KERAS_WRAPS = (
    "the model was compiled under float32 with Adam; compiled the same way under "
    "mixed_float16, Keras's compile wraps it in its own LossScaleOptimizer "
    "(auto_scale_loss=True, compile's default), so the loss is scaled."
)


def test_a_float32_file_audited_under_mixed_float16_is_scaled_by_keras(tmp_path):
    """The reporter's case: a float32 model compiled with Adam, saved, audited with
    --policy mixed_float16. Built under that policy and compiled so, Keras wraps Adam in its
    own LossScaleOptimizer: an info, not an error (its float16 output stays an error). The
    same model under mixed_bfloat16 needs no loss scaling at all."""
    tfmixprec.set_policy("float32")
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32), keras.layers.Dense(8, name="out")]
    )
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.zeros((4, 16)), np.zeros((4, 8)), verbose=0)  # the file keeps Adam's state
    model.save(tmp_path / "m.keras")
    for audited in (model, str(tmp_path / "m.keras")):
        report = tfmixprec.audit(audited, policy="mixed_float16")
        assert _codes(report) == [
            ("error", "low-precision-output", "out"),
            ("info", "keras-loss-scaling", None),
        ]
        assert report.findings[1].message == KERAS_WRAPS
        report = tfmixprec.audit(audited, policy="mixed_bfloat16")
        assert _codes(report) == [("error", "low-precision-output", "out")]
    # What the info says is what happens: built under the policy and compiled the same way.
    tfmixprec.set_policy("mixed_float16")
    rebuilt = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32), keras.layers.Dense(8, dtype="float32")]
    )
    rebuilt.compile(optimizer="adam", loss="mse")
    assert isinstance(rebuilt.optimizer, keras.optimizers.LossScaleOptimizer)
    # tfmixprec's MixedPrecisionModel has its own LossScaleOptimizer under any policy.
    tfmixprec.set_policy("float32")
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32)(inputs)
    ours = tfmixprec.MixedPrecisionModel(inputs, keras.layers.Dense(8, dtype="float32")(hidden))
    ours.compile(optimizer="adam", loss="mse")
    assert tfmixprec.audit(ours, policy="mixed_float16").findings == []


def test_a_file_that_runs_float16_without_loss_scaling_still_errs(tmp_path):
    """A model compiled under mixed_float16 with auto_scale_loss=False keeps its plain
    optimizer under that policy: the error stands, as it is and under --policy mixed_float16,
    from the file and on the command line (exit 1)."""
    model = _float16_classifier(auto_scale_loss=False)
    model.save(tmp_path / "m.keras")
    for audited in (model, str(tmp_path / "m.keras")):
        for policy in (None, "mixed_float16"):
            report = tfmixprec.audit(audited, policy=policy, hardware=A100)
            assert _codes(report) == [("error", "no-loss-scaling", None)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["audit", str(tmp_path / "m.keras"), "--policy", "mixed_float16"])
    assert code == 1 and "ERROR   no-loss-scaling:" in out.getvalue()


def test_an_explicit_float32_layer_stays_float32_under_any_policy(tmp_path):
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(8, name="a"),
            keras.layers.Dense(8, name="b"),
            keras.layers.Dense(8, activation="softmax", dtype="float32", name="probs"),
        ]
    )
    model.save(tmp_path / "m.keras")
    for audited in (model, tmp_path / "m.keras"):
        report = tfmixprec.audit(audited, policy="mixed_float16")
        assert _codes(report) == [("info", "not-compiled", None)]
        assert [x.compute_dtype for x in report.layers] == ["float16", "float16", "float32"]


def test_a_float32_model_says_what_the_recommended_policy_would_find():
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8, name="a"), keras.layers.Dense(3, name="b")]
    )
    (finding,) = tfmixprec.audit(model, hardware=A100).findings
    assert (finding.severity, finding.code, finding.layer) == ("info", "float32-model", None)
    assert finding.message == (
        "the model computes in float32 only: no mixed precision yet. Under mixed_bfloat16, the "
        "policy recommended for this machine, the audit finds 1 error: "
        "low-precision-output [b] (error)."
    )
    assert finding.fix.startswith(
        "Audit it under that policy for the details (tfmixprec.audit(model, "
        "policy='mixed_bfloat16'), or tfmixprec audit FILE --policy mixed_bfloat16)"
    )
    (finding,) = tfmixprec.audit(model, hardware=CPU_ONLY).findings
    assert finding.message.startswith(
        "the model computes in float32 only, the policy recommended for this machine: no GPU"
    )
    text = str(tfmixprec.audit(model, policy="float32"))
    assert "No findings: the model computes in float32 (policy float32)." in text
    assert "ready for mixed precision" not in text


def _attention_model(dropout=0.0, scores=False):
    tfmixprec.set_policy("mixed_bfloat16")
    tokens = keras.Input((5, 16))
    attention = keras.layers.MultiHeadAttention(2, 8, dropout=dropout, name="mha")
    out = attention(tokens, tokens, return_attention_scores=scores)
    out = out[0] if scores else out
    return keras.Model(tokens, keras.layers.Dense(8, dtype="float32", name="out")(out))


@pytest.mark.parametrize(
    "kwargs, softmax_runs",
    [({}, False), ({"dropout": 0.1}, True), ({"scores": True}, True)],
)
def test_an_attention_softmax_is_not_flagged_where_it_runs_or_not(kwargs, softmax_runs):
    """Keras runs an attention's own Softmax layer, in bfloat16 here, with dropout or
    return_attention_scores=True, else a fused float32 softmax; either way the probabilities
    reach the attention product in bfloat16 (benchmarks/softmax_precision.py: the same
    accuracy), so neither is flagged."""
    model = _attention_model(**kwargs)
    observed = observe(model)
    ran = [c for c in observed.calls if isinstance(c.layer, keras.layers.Softmax)]
    assert [c.output_dtypes for c in ran] == ([("bfloat16",)] if softmax_runs else [])
    assert tfmixprec.audit(model, hardware=A100).findings == []


def test_attention_in_a_subclassed_model():
    class Block(keras.Model):
        def __init__(self):
            super().__init__()
            self.attention = keras.layers.MultiHeadAttention(2, 8)
            self.out = keras.layers.Dense(8, dtype="float32")

        def call(self, x):
            return self.out(self.attention(x, x))

    tfmixprec.set_policy("mixed_bfloat16")
    model = Block()
    model(keras.ops.zeros((1, 5, 16)))
    assert tfmixprec.audit(model, hardware=A100).findings == []


def test_separable_conv_and_einsum_dense_alignment():
    tfmixprec.set_policy("mixed_float16")
    image = keras.Input((4, 4, 65))
    # The pointwise product: K = 65 x 2 = 130 channels, N = 130 filters.
    conv = keras.layers.SeparableConv2D(130, 3, depth_multiplier=2, name="sep")(image)
    flat = keras.layers.Flatten()(conv)
    dense = keras.layers.EinsumDense("ab,bc->ac", output_shape=201, name="einsum")(flat)
    model = keras.Model(image, keras.layers.Dense(8, dtype="float32", name="out")(dense))
    fixes = [(f.layer, f.fix) for f in tfmixprec.audit(model, hardware=A100).warnings]
    assert fixes == [
        ("sep", "Pad filters to 136."),
        ("sep", "Pad pointwise input channels to 136."),
        ("einsum", "Pad output size (equation dimension 'c') to 208."),
    ]


def test_a_subclassed_model_with_dict_inputs():
    class TwoInputs(keras.Model):
        def __init__(self):
            super().__init__()
            self.a = keras.layers.Dense(8, name="a")
            self.b = keras.layers.Dense(8, name="b")
            self.out = keras.layers.Dense(8, name="out")

        def call(self, inputs):
            return self.out(self.a(inputs["x"]) + self.b(inputs["y"]))

    tfmixprec.set_policy("mixed_float16")
    model = TwoInputs()
    model({"x": keras.ops.zeros((2, 3)), "y": keras.ops.zeros((2, 5))})
    report = tfmixprec.audit(model, hardware=A100)
    assert _codes(report)[0] == ("error", "low-precision-output", "out")


def test_files_that_cannot_be_audited(tmp_path):
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "saved_model.pb").write_bytes(b"")
    with pytest.raises(ValueError, match=r"saved' is a TensorFlow SavedModel directory, not a"):
        tfmixprec.audit(tmp_path / "saved")
    with pytest.raises(ValueError, match=r"is a directory, not a model file"):
        tfmixprec.audit(tmp_path)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)])
    model.save_weights(tmp_path / "m.weights.h5")
    with pytest.raises(ValueError, match=r"is an HDF5 file without a model \(weights only"):
        tfmixprec.audit(tmp_path / "m.weights.h5")
    with pytest.raises(TypeError, match=r"audit expects a keras.Model.*builtins.int"):
        tfmixprec.audit(3)


def test_a_legacy_h5_model_is_audited(tmp_path):
    model = _float16_classifier()
    model.save(tmp_path / "m.h5")
    report = tfmixprec.audit(tmp_path / "m.h5", hardware=A100)
    assert report.policy == "mixed_float16"
    assert report.findings == tfmixprec.audit(model, hardware=A100).findings == []


def _lambda_file(tmp_path):
    marker = tmp_path / "ran"
    tokens = keras.Input((4,))
    # A lambda with the path inside its bytecode (Keras cannot load a lambda's defaults).
    payload = eval(f"lambda x: (open({str(marker)!r}, 'w').close(), x)[1]")
    out = keras.layers.Lambda(payload, name="payload")(tokens)
    keras.Model(tokens, out).save(tmp_path / "code.keras")
    marker.unlink()  # building the model called it
    return marker


def test_a_file_with_code_is_refused_and_its_code_never_runs(tmp_path):
    marker = _lambda_file(tmp_path)
    with pytest.raises(ValueError) as caught:
        tfmixprec.audit(tmp_path / "code.keras")
    assert str(caught.value) == (
        f"{str(tmp_path / 'code.keras')!r} holds code: layer 'payload' (Lambda) is a Python "
        "lambda stored as bytecode, which runs when the model is loaded or called. tfmixprec "
        "audit never runs code from a model file. If you trust the file, audit it in Python: "
        "tfmixprec.audit(keras.models.load_model(path, safe_mode=False))."
    )
    assert not marker.exists()
    keras.models.load_model(tmp_path / "code.keras", safe_mode=False)  # the file is real
    assert marker.exists()


def test_a_file_naming_outside_code_is_refused(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="d")])
    model.save(tmp_path / "m.keras")
    with zipfile.ZipFile(tmp_path / "m.keras") as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    config = json.loads(members["config.json"])
    config["config"]["layers"][1]["module"] = "evil.layers"
    config["config"]["layers"][1]["class_name"] = "Payload"
    members["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(tmp_path / "evil.keras", "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    with pytest.raises(
        ValueError,
        match=r"needs code from outside Keras and tfmixprec: layer "
        r"'d' \(Payload\) is class 'Payload' from module 'evil.layers'",
    ):
        tfmixprec.audit(tmp_path / "evil.keras")


def test_a_model_that_cannot_take_zeros_is_read_from_its_graph():
    """Calling it on a batch of zeros (unknown sizes 2) fails: its outputs' dtypes are the
    symbolic ones, and the audit says so."""
    tfmixprec.set_policy("mixed_float16")
    inputs = keras.Input((None,))
    grouped = keras.layers.Reshape((-1, 8))(inputs)  # 2 values cannot make rows of 8
    model = keras.Model(inputs, keras.layers.Dense(8, name="out")(grouped))
    report = tfmixprec.audit(model, hardware=A100)
    assert _codes(report) == [
        ("error", "low-precision-output", "out"),
        ("info", "unobserved", None),
        ("info", "not-compiled", None),
    ]
    assert report.findings[1].message.startswith("calling the model on a batch of zeros failed")


def test_audits_in_two_threads_leave_the_model_as_it_was():
    """One observing call (and one policy swap) at a time: a second thread would otherwise
    save the first one's watcher or swapped policy as the layer's own and put it back."""

    tfmixprec.set_policy("mixed_float16")
    inputs = keras.Input((16,))
    hidden = inputs
    for k in range(4):
        hidden = keras.layers.Dense(16, name=f"d{k}")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax", name="out")(hidden))
    layers = [model, *model._flatten_layers(include_self=False, recursive=True)]
    policies = [layer.dtype_policy for layer in layers]
    barrier, errors = threading.Barrier(2), []

    def work(**kwargs):
        try:
            barrier.wait()
            for _ in range(10):
                tfmixprec.audit(model, hardware=A100, **kwargs)
        except Exception as err:  # pragma: no cover - reported below
            errors.append(repr(err))

    threads = [
        threading.Thread(target=work),
        threading.Thread(target=work, kwargs={"policy": "mixed_bfloat16"}),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert [layer.name for layer in layers if "call" in vars(layer)] == []
    assert all(layer.dtype_policy is own for layer, own in zip(layers, policies))


def test_audit_puts_the_model_state_back():
    """The observing call on zeros runs a stateful LSTM and add_loss layers: their states and
    losses are as they were afterwards."""
    tfmixprec.set_policy("mixed_float16")
    inputs = keras.Input(batch_shape=(2, 3, 4))
    lstm = keras.layers.LSTM(5, stateful=True, name="lstm")
    regularized = keras.layers.ActivityRegularization(l1=1.0)(lstm(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, dtype="float32")(regularized))
    model(np.ones((2, 3, 4), "float32"))  # state carried from a first chunk
    states, losses = [s.numpy().copy() for s in lstm.states], [float(x) for x in model.losses]
    tfmixprec.audit(model, hardware=A100)
    tfmixprec.float32_outputs(model)
    assert all((a == s.numpy()).all() for a, s in zip(states, lstm.states))
    assert [float(x) for x in model.losses] == losses


def test_lowered_sizes_of_attention_projections_and_grouped_convolutions():
    tfmixprec.set_policy("mixed_float16")
    tokens = keras.Input((5, 260))
    mha = keras.layers.MultiHeadAttention(4, 64, output_shape=256, name="mha")
    attended = mha(tokens, tokens)
    image = keras.Input((4, 4, 520))
    grouped = keras.layers.Conv2D(520, 1, groups=4, name="grouped")(image)
    inner = keras.layers.Conv2D(130, 1, name="inner")(image)
    deep = keras.layers.Conv2D(128, 3, strides=2, name="deep")(inner)
    flat = keras.layers.Concatenate()(
        [keras.layers.Flatten()(t) for t in (attended, grouped, deep)]
    )
    model = keras.Model([tokens, image], keras.layers.Dense(8, dtype="float32")(flat))
    fixes = {(f.layer, f.fix) for f in tfmixprec.audit(model, hardware=A100).warnings}
    # The projections read width 260 (K) and make 4 heads of 64 (N = 256); each group of the
    # grouped convolution has 130 channels in and 130 out; a stride-2 convolution inside the
    # network wants 8 channels.
    for name in ("query", "key", "value"):
        assert (name, "Pad input features (equation dimension 'c') to 264.") in fixes
    assert ("grouped", "Pad filters per group to 136.") in fixes
    assert ("grouped", "Pad input channels per group to 136.") in fixes
    assert ("deep", "Pad input channels to 136.") in fixes
    assert ("inner", "Pad filters to 136.") in fixes
    assert len(fixes) == 7


def test_a_hypothetical_policy_where_the_model_cannot_take_zeros():
    """The symbolic fallback judges the outputs of layers that follow the audited policy."""
    inputs = keras.Input((None,))
    grouped = keras.layers.Reshape((-1, 8))(inputs)
    model = keras.Model(inputs, keras.layers.Dense(8, name="out")(grouped))  # float32
    report = tfmixprec.audit(model, policy="mixed_float16")
    assert _codes(report)[:2] == [
        ("error", "low-precision-output", "out"),
        ("info", "unobserved", None),
    ]


def test_an_unbuilt_sublayer_and_auto_under_given_hardware():
    class Spare(keras.Model):
        def __init__(self):
            super().__init__()
            self.used = keras.layers.Dense(8, dtype="float32")
            self.unused = keras.layers.Dense(8)  # never called: never built

        def call(self, x):
            return self.used(x)

    tfmixprec.set_policy("mixed_float16")
    model = Spare()
    model(keras.ops.zeros((2, 4)))
    assert tfmixprec.audit(model, hardware=A100).errors == []
    v100 = HardwareInfo(gpus=(GPUInfo("Tesla V100", (7, 0)),))
    assert tfmixprec.audit(model, policy="auto", hardware=v100).policy == "mixed_float16"


@pytest.fixture
def fresh_settings():
    """A function that makes this process's settings as a fresh process has them: grappler's
    remapping option and Keras's global policy unset, tfmixprec's CPU float16 switches at
    their start; everything as it was after the test."""
    options = tf_context.context()._optimizer_experimental_options
    policy = global_state.get_global_attribute("dtype_policy")
    saved = (dict(options), dict(cpu_float16._STATE), policy)

    def unset():
        options.pop("remapping", None)
        tf.config.optimizer.set_experimental_options({})  # functions re-read the options
        cpu_float16._STATE.update(enabled=True)
        global_state.set_global_attribute("dtype_policy", None)

    yield unset
    options.clear()
    options.update(saved[0])
    tf.config.optimizer.set_experimental_options({})
    cpu_float16._STATE.update(saved[1])
    global_state.set_global_attribute("dtype_policy", saved[2])


def _config_changed(path, out, change):
    """A copy of the .keras file `path` at `out`, its config.json changed by `change(config)`."""
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    config = json.loads(members["config.json"])
    change(config)
    members["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def test_auditing_a_file_leaves_every_setting_as_it_found_it(tmp_path, fresh_settings):
    """Compiling a saved float16 MixedPrecisionModel goes through tfmixprec's compile, which
    turns grappler's remapper off on a CPU, and loading it sets Keras's global policy for a
    while: after `tfmixprec audit FILE` in this process, done or failed once the remapper was
    off (a compile argument Keras does not take), every option is as it was, an unset one
    unset."""
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        outputs = keras.layers.Dense(4, dtype="float32")(keras.layers.Dense(8)(inputs))
        model = tfmixprec.MixedPrecisionModel(inputs, outputs)
        model.compile(optimizer="sgd", loss="mse")
    model.save(tmp_path / "model.keras")
    _config_changed(
        tmp_path / "model.keras",
        tmp_path / "fails.keras",
        lambda config: config["compile_config"].update(unknown_argument=1),
    )
    fresh_settings()
    before, switches = tf.config.optimizer.get_experimental_options(), cpu_float16.status()
    assert global_state.get_global_attribute("dtype_policy") is None  # status() set nothing
    assert "remapping" not in before
    for name, code in [("model.keras", 0), ("fails.keras", 2)]:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert cli.main(["audit", str(tmp_path / name)]) == code
        assert tf.config.optimizer.get_experimental_options() == before
        assert global_state.get_global_attribute("dtype_policy") is None
        assert cpu_float16.status() == switches


def test_a_legacy_h5_file_with_code_in_its_training_config_is_refused(tmp_path):
    """A loss stored as a lambda's bytecode in an .h5 file's training_config: refused, also in
    a process that enabled unsafe deserialization for its own files (its own process here:
    Keras's switch is process-wide)."""
    import h5py

    _float16_classifier().save(tmp_path / "m.h5")
    lambda_config = {"class_name": "__lambda__", "config": {"code": "4wAAAA==", "defaults": None}}
    with h5py.File(tmp_path / "m.h5", "r+") as file:
        training = json.loads(file.attrs["training_config"])
        training["loss"] = lambda_config
        file.attrs["training_config"] = json.dumps(training)
    code = (
        "import keras, tfmixprec\n"
        "keras.config.enable_unsafe_deserialization()\n"
        f"try:\n    tfmixprec.audit({str(tmp_path / 'm.h5')!r})\n"
        "except ValueError as err:\n    print(err)\n"
    )
    done = _python(["-c", code])
    refused = "m.h5' holds code: an entry of its training config (loss, metrics) is a Python lambda"
    assert refused in done.stdout, done.stdout + done.stderr[-2000:]


def _shadowed_module_file(path, package):
    """A small .keras file whose last layer names a module of `package` (`{package}.layers`),
    and a folder `package/` next to it that writes `ran-{package}` when imported."""
    folder = path.parent
    (folder / package).mkdir()
    marker = folder / f"ran-{package}"
    (folder / package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="d")])
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    config = json.loads(members["config.json"])
    config["config"]["layers"][-1]["module"] = f"{package}.layers"
    members["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return marker


def test_a_folder_shadowing_a_trusted_package_is_never_imported(tmp_path):
    """A file names a module of a package Keras imports itself (keras_cv, keras_hub); a folder
    of that name next to the model, where the audit runs, is not that package: refused, and
    its code never runs (keras_hub is installed here, keras_cv is not). One process audits
    both packages' files, each with its folder beside it (a marker file each)."""
    packages = ("keras_cv", "keras_hub")
    markers = {p: _shadowed_module_file(tmp_path / f"m-{p}.keras", p) for p in packages}
    code = (
        "import tfmixprec\n"
        f"for package in {packages!r}:\n"
        "    try:\n        tfmixprec.audit(f'm-{package}.keras')\n"
        "    except ValueError as err:\n        print(package, err)\n"
    )
    done = _python(["-c", code], cwd=tmp_path)
    said = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    for package in packages:
        expected = f"is module '{package}.layers' (importing '{package}' would run"
        assert expected in said.get(package, ""), (package, done.stdout + done.stderr[-2000:])
        assert not markers[package].exists(), package


def _zip_with(path, members):
    """A .keras-like archive, each member streamed in from `(name, chunk, times)`."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, chunk, times in members:
            with archive.open(name, "w", force_zip64=True) as member:
                for _ in range(times):
                    member.write(chunk)


def test_bombs_are_refused_before_anything_is_read(tmp_path):
    """A config.json that declares 128 MiB, and a weights member that declares 300 MiB and
    stores under 1: refused from the archive's directory, before a byte is decompressed."""
    _zip_with(tmp_path / "config.keras", [("config.json", b" " * (1 << 20), 128)])
    with pytest.raises(ValueError, match=r"declares a config.json of 128.0 MiB; a model's"):
        tfmixprec.audit(tmp_path / "config.keras")
    _zip_with(
        tmp_path / "weights.keras",
        [("config.json", b"{}", 1), ("model.weights.h5", b"\0" * (1 << 20), 300)],
    )
    with pytest.raises(ValueError, match=r"'model.weights.h5', which declares 300.0 MiB but"):
        tfmixprec.audit(tmp_path / "weights.keras")


def _kib(size):
    return f"{size / 1024:.1f} KiB"


def _held_kib(path):
    """What a small .keras file holds of its weights, as the refusal says it (KiB)."""
    with zipfile.ZipFile(path) as archive:
        return _kib(archive.getinfo("model.weights.h5").compress_size)


def _wide(units):
    return lambda config: config["config"]["layers"][1]["config"].update(units=units)


def test_a_file_declaring_weights_it_does_not_hold_is_refused(tmp_path):
    """A small file whose config declares a Dense of 2^24 units on 6 inputs: 448 MiB of
    weights that loading would allocate, past the 256 MiB the audit allocates for a file
    beyond what it holds. Refused before anything is built (.keras and legacy .h5), in one
    line on the command line."""
    import h5py

    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="d")])
    model.save(tmp_path / "m.keras")
    model.save(tmp_path / "m.h5")
    _config_changed(tmp_path / "m.keras", tmp_path / "wide.keras", _wide(1 << 24))
    with h5py.File(tmp_path / "m.h5", "r+") as file:
        config = json.loads(file.attrs["model_config"])
        _wide(1 << 24)(config)
        file.attrs["model_config"] = json.dumps(config)
    held = {"wide.keras": _held_kib(tmp_path / "m.keras")}
    held["m.h5"] = _kib((tmp_path / "m.h5").stat().st_size)  # the weights are in the file
    said = {}
    for name in ["wide.keras", "m.h5"]:
        with pytest.raises(ValueError) as caught:
            tfmixprec.audit(tmp_path / name)
        said[name] = str(caught.value)
        assert said[name] == (
            f"{str(tmp_path / name)!r} declares 448.0 MiB of weights (the largest: the kernel of "
            f"layer 'd', shape (6, 16777216) float32, 384.0 MiB) but holds {held[name]}: "
            "loading it would allocate the rest, past the 256.0 MiB the audit allocates for a "
            "file beyond the bytes it holds. If you trust the file, audit it in Python: "
            "tfmixprec.audit(keras.models.load_model(path))."
        )
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli.main(["audit", str(tmp_path / "wide.keras")]) == 2
    assert err.getvalue() == f"tfmixprec audit: error: {said['wide.keras']}\n"


def test_a_file_holding_its_weights_is_audited_whatever_their_size(tmp_path, monkeypatch):
    """The budget is for what a file declares beyond the bytes it holds: with the budget set to
    1 KiB, a file Keras wrote (2 KiB of weights, stored) is audited, and the same config with
    a weights member of nothing is refused."""
    from tfmixprec.checks import model_file

    monkeypatch.setattr(model_file, "DECLARED_BUDGET", 1024)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="d")])
    model.save(tmp_path / "m.keras")  # 16 x 32 + 32 float32: 2.1 KiB
    assert tfmixprec.audit(tmp_path / "m.keras").layers[0].layer == "d"
    with zipfile.ZipFile(tmp_path / "m.keras") as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    with zipfile.ZipFile(tmp_path / "empty.keras", "w") as archive:
        for name, data in members.items():
            archive.writestr(name, b"" if name == "model.weights.h5" else data)
    with pytest.raises(ValueError, match=r"declares 2.1 KiB of weights .* but holds 0.0 KiB"):
        tfmixprec.audit(tmp_path / "empty.keras")


_SYMBOLIC = (
    "so its outputs' dtypes are Keras's symbolic ones, which a real call can contradict (a "
    "layer may return float32 under a float16 policy)."
)


def test_a_file_whose_call_on_zeros_passes_the_budget_is_audited_without_it(tmp_path):
    """The issue's file: no weights, a declared 6000 x 6000 input. Its call on zeros would hold
    the batch (275 MiB) and the softmax's output: the audit reads the model's graph instead,
    and says so; the command exits with the findings' code."""
    model = keras.Sequential([keras.Input((6000, 6000)), keras.layers.Softmax(name="probs")])
    model.save(tmp_path / "m.keras")
    report = tfmixprec.audit(tmp_path / "m.keras", hardware=A100)
    assert _codes(report) == [("info", "unobserved", None), ("info", "float32-model", None)]
    assert report.findings[0].message == (
        "the audit did not call the model on a batch of zeros: for its declared inputs "
        "(None, 6000, 6000) float32, that call would hold 549.3 MiB of tensors (the batch and "
        "its layers' outputs, unknown sizes 2), past the 256.0 MiB the audit spends on a "
        f"file's call, {_SYMBOLIC}"
    )
    assert report.findings[0].fix == (
        "Check the outputs' dtypes on a real batch: model(batch).dtype. For a file you trust, "
        "audit the model in Python, where the call has no budget: "
        "tfmixprec.audit(keras.models.load_model(path))."
    )
    # Under the recommended policy too, no call: the softmax output in bfloat16 is read from
    # the graph.
    assert "the audit finds 1 error, 1 info: low-precision-softmax [probs] (error), " in (
        report.findings[1].message
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["audit", str(tmp_path / "m.keras")]) == 0
    assert "INFO    unobserved: the audit did not call the model on a batch of zeros" in (
        out.getvalue()
    )


@pytest.mark.parametrize("features, called", [(1 << 24, True), ((1 << 24) + (1 << 16), False)])
def test_the_call_budget_counts_the_batch_and_each_layers_outputs(tmp_path, features, called):
    """A ReLU of 2^24 float32 features: its batch of zeros (2 rows) and its output hold
    exactly 256 MiB, the budget, and the model is called; 2^16 features more (257 MiB), not."""
    model = keras.Sequential([keras.Input((features,)), keras.layers.ReLU(name="relu")])
    model.save(tmp_path / "m.keras")
    report = tfmixprec.audit(tmp_path / "m.keras", hardware=A100)
    assert [f.code for f in report.findings] == ["unobserved"] * (not called) + ["float32-model"]
    if not called:
        assert report.findings[0].message.startswith(
            "the audit did not call the model on a batch of zeros: for its declared inputs "
            "(None, 16842752) float32, that call would hold 257.0 MiB of tensors"
        )


# How far one file may grow the fuzzing process's peak memory, and the whole run over its
# baseline (the peak after auditing the seed and a 6 x 6 softmax). Measured on an AMD EPYC: a
# bomb at most 0.5 MiB, the 400 mutated files 13 MiB in all, over a baseline of 720 MiB; a
# bomb the audit did not bound grows it by its declared size (the 6000 x 6000 softmax by about
# 1000 MiB). The margins are for another CPU's kernels and allocator, far below any bomb.
BOMB_GROWTH_MIB, RUN_GROWTH_MIB = 64, 128


def test_fuzzed_files_end_in_a_documented_exit_code(tmp_path):
    """400 mutated .keras and .h5 files (bit flips, truncations, re-zipped with members
    dropped, doubled, renamed or added, configs mutated to name code and odd values) and
    declared-shape bombs (configs of small files that declare huge inputs, units, filters,
    kernels, vocabularies or upsampling) through `tfmixprec audit FILE`, in one process whose
    folder holds packages named like trusted ones: each ends with exit 0, 1 or 2 within
    seconds, nothing escapes the command, nothing is imported, each bomb is refused for its
    weights or audited without its call, and the process's memory stays within a measured
    margin of its baseline."""
    worker = Path(__file__).resolve().parents[1] / "workers" / "fuzz_audit.py"
    args = [str(worker), "--out", str(tmp_path), "--files", "400", "--seed", "0"]
    done = _python(args, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads((tmp_path / "fuzz.json").read_text())
    files = found["baseline"] + found["bombs"] + found["results"]
    assert [(r["file"], r["escaped"]) for r in files if r["escaped"]] == []
    assert {r["code"] for r in files} <= {0, 1, 2}
    assert found["ran"] == []  # no marker: no planted package was imported
    assert max(r["seconds"] for r in files) < 30
    assert [(r["file"], r["code"]) for r in found["baseline"]] == [
        ("seed.keras", 1),  # its float16 softmax output
        ("softmax-6x6.keras", 0),
    ]
    for bomb in found["bombs"]:  # refused in one line for its weights, or not called
        error = bomb["error"]
        if bomb["expected"] == "refuse":
            assert bomb["code"] == 2 and error.count("\n") == 1, bomb
            assert error.startswith("tfmixprec audit: error: '"), bomb
            assert "MiB of weights (the largest: " in error, bomb
        else:
            assert bomb["code"] in (0, 1) and bomb["uncalled"], bomb
    assert [bomb["expected"] for bomb in found["bombs"]].count("skip the call") == 4
    grown = {r["file"]: round(r["grew_mib"]) for r in found["bombs"]}
    assert max(grown.values()) <= BOMB_GROWTH_MIB, grown
    assert found["peak_mib"] - found["baseline_mib"] <= RUN_GROWTH_MIB
