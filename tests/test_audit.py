"""Tests of `tfmixprec.audit`: each problem on a model built to have it, none on a clean one."""

import importlib
import json

import keras
import pytest

import tfmixprec
from tfmixprec.hardware import GPUInfo, HardwareInfo

# The model's own findings, the same on any machine; the machine's are tested on their own.
A100 = HardwareInfo(gpus=(GPUInfo("NVIDIA A100", (8, 0)),))
CPU_ONLY = HardwareInfo(cpu_name="Test CPU")


def _codes(report):
    return [(f.severity, f.code, f.layer) for f in report.findings]


def _clean_model():
    tfmixprec.set_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="hidden"),
            keras.layers.Dense(8, name="logits"),
            keras.layers.Softmax(name="probs", dtype="float32"),
        ],
        name="clean",
    )
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


def test_softmax_output_and_alignment_findings():
    tfmixprec.set_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(30, activation="relu", name="odd"),
            keras.layers.Dense(8, activation="softmax", name="attn"),
            keras.layers.Dense(8, name="out"),
        ]
    )
    report = tfmixprec.audit(model, hardware=A100)
    assert _codes(report) == [
        ("error", "low-precision-softmax", "attn"),
        ("error", "low-precision-output", "out"),
        ("warning", "tensor-core-alignment", "odd"),
        ("warning", "tensor-core-alignment", "odd"),
        ("warning", "tensor-core-alignment", "attn"),
        ("info", "not-compiled", None),
    ]
    fixes = [f.fix for f in report.warnings]
    assert fixes == ["Pad units to 32.", "Pad input features to 16.", "Pad input features to 32."]
    assert not report.ok
    text = str(report)
    assert "ERROR   low-precision-softmax [attn]: softmax activation computed in float16" in text
    assert "Summary: 2 errors, 3 warnings, 1 info" in text
    # After the fix the errors are gone.
    tfmixprec.float32_outputs(model)
    assert [f.code for f in tfmixprec.audit(model).errors] == []


def test_conv_embedding_attention_alignment():
    tfmixprec.set_policy("mixed_bfloat16")
    image = keras.Input((8, 8, 3))
    conv = keras.layers.Conv2D(6, 3, name="conv")(image)
    tokens = keras.Input((5,), dtype="int32")
    embedded = keras.layers.Embedding(1001, 50, name="embed")(tokens)
    attended = keras.layers.MultiHeadAttention(2, key_dim=12, name="mha")(embedded, embedded)
    flat = keras.layers.Concatenate()(
        [keras.layers.Flatten()(conv), keras.layers.Flatten()(attended)]
    )
    out = keras.layers.Dense(8, dtype="float32", name="out")(flat)
    model = keras.Model([image, tokens], out)
    report = tfmixprec.audit(model)
    messages = {(f.layer, f.fix) for f in report.warnings}
    assert ("conv", "Pad filters to 8.") in messages
    assert ("conv", "Pad input channels to 8.") in messages
    assert ("embed", "Pad embedding dimension (output_dim) to 56.") in messages
    assert ("embed", "Pad vocabulary size (input_dim) to 1008.") in messages
    assert ("mha", "Pad head size (key_dim) to 16.") in messages
    # bfloat16 needs no loss scaling and the output is float32, but the attention layer's
    # own Softmax follows the layer's bfloat16 policy: flagged.
    assert [(f.code, f.layer.startswith("softmax")) for f in report.errors] == [
        ("low-precision-softmax", True)
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
    assert "2 float16 layer(s) ('hidden', 'logits') run TensorFlow's slow" in finding.message
    assert "tfmixprec.cpu_float16.fast_float16_layers(model)" in finding.fix
    assert tfmixprec.audit(model, hardware=A100).findings == []  # a GPU has no such kernels
    tfmixprec.cpu_float16.fast_float16_layers(model, CPU_ONLY)
    assert tfmixprec.audit(model, hardware=CPU_ONLY).findings == []


def test_warns_of_xla_with_bfloat16_on_a_cpu():
    tfmixprec.set_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, dtype="float32")])
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
    assert tfmixprec.audit(model).findings == []
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
    assert [(f.code, f.layer, f.message) for f in report.findings] == [
        ("has-bias", "inner", "has a bias in float32"),
        ("has-bias", "outer", "has a bias in float32"),
    ]
