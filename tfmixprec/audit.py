"""Static checks of a model for mixed precision: dtypes, float32 outputs, Tensor Core sizes."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import keras

from tfmixprec import cpu_float16
from tfmixprec.hardware import HardwareInfo, detect_hardware
from tfmixprec.policy import (
    LOW_PRECISION,
    check_built_model,
    check_policy_name,
    choose_policy,
    float32_reason,
    iter_layers,
    output_layers,
)

__all__ = ["Finding", "LayerDtypes", "AuditReport", "audit"]

SEVERITIES = ("error", "warning", "info")
ALIGNMENT = 8  # NVIDIA: multiples of 8 for float16 on Tensor Cores


@dataclasses.dataclass(frozen=True)
class Finding:
    """One problem found by `audit`.

    Args:
        severity: String. `"error"`, `"warning"` or `"info"`.
        code: String. A short stable identifier, e.g. `"low-precision-output"`.
        layer: String or None. The layer's name (None for model-wide findings).
        message: String. What is wrong.
        fix: String. What to do about it.
    """

    severity: str
    code: str
    layer: str | None
    message: str
    fix: str


@dataclasses.dataclass(frozen=True)
class LayerDtypes:
    """A layer's compute and variable dtypes (as audited)."""

    layer: str
    class_name: str
    policy: str
    compute_dtype: str
    variable_dtype: str


@dataclasses.dataclass
class AuditReport:
    """The result of `audit(model)`: findings and per-layer dtypes.

    `str(report)` is a readable table; `to_dict()`, `to_json()` and `to_markdown()` convert it.
    """

    model: str
    policy: str
    findings: list[Finding]
    layers: list[LayerDtypes]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        """True when there is no error (warnings and info allowed)."""
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "policy": self.policy,
            "ok": self.ok,
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "layers": [dataclasses.asdict(layer) for layer in self.layers],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def _summary(self) -> str:
        counts = {s: sum(f.severity == s for f in self.findings) for s in SEVERITIES}
        return ", ".join(f"{counts[s]} {s}{'s' if counts[s] != 1 else ''}" for s in SEVERITIES)

    def to_markdown(self) -> str:
        lines = [
            f"## Mixed-precision audit of `{self.model}` (policy `{self.policy}`)",
            "",
            self._summary(),
            "",
        ]
        if self.findings:
            lines += ["| severity | layer | problem | fix |", "|---|---|---|---|"]
            for f in self.findings:
                lines.append(f"| {f.severity} | {f.layer or '-'} | {f.message} | {f.fix} |")
            lines.append("")
        lines += ["| layer | class | compute | variables |", "|---|---|---|---|"]
        for layer in self.layers:
            lines.append(
                f"| {layer.layer} | {layer.class_name} | {layer.compute_dtype} | "
                f"{layer.variable_dtype} |"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        rows = [("layer", "class", "compute", "variables")] + [
            (lyr.layer, lyr.class_name, lyr.compute_dtype, lyr.variable_dtype)
            for lyr in self.layers
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [f"Mixed-precision audit of '{self.model}' (policy {self.policy})", ""]
        for index, row in enumerate(rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
            if index == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append("")
        if self.findings:
            for f in self.findings:
                where = f" [{f.layer}]" if f.layer else ""
                lines.append(f"{f.severity.upper():7} {f.code}{where}: {f.message}")
                lines.append(f"        fix: {f.fix}")
        else:
            lines.append("No findings: the model is ready for mixed precision.")
        lines.append("")
        lines.append(f"Summary: {self._summary()}")
        return "\n".join(lines)


def _padded(n: int) -> int:
    return int(math.ceil(n / ALIGNMENT) * ALIGNMENT)


def _sizes_to_align(layer: Any) -> list[tuple[str, int]]:
    """The sizes of `layer` that Tensor Cores want as multiples of 8."""
    sizes: list[tuple[str, int]] = []
    if isinstance(layer, keras.layers.Dense):
        sizes.append(("units", layer.units))
        sizes.append(("input features", int(layer.kernel.shape[0])))
    elif isinstance(layer, keras.layers.Embedding):
        sizes.append(("embedding dimension (output_dim)", layer.output_dim))
        sizes.append(("vocabulary size (input_dim)", layer.input_dim))
    elif isinstance(layer, keras.layers.MultiHeadAttention):
        sizes.append(("head size (key_dim)", layer.key_dim))
        if layer.value_dim and layer.value_dim != layer.key_dim:
            sizes.append(("value head size (value_dim)", layer.value_dim))
    elif hasattr(layer, "filters") and hasattr(layer, "kernel_size") and hasattr(layer, "kernel"):
        sizes.append(("filters", layer.filters))
        kernel = layer.kernel.shape
        transpose = "Transpose" in type(layer).__name__
        groups = getattr(layer, "groups", 1) or 1
        in_channels = int(kernel[-1]) if transpose else int(kernel[-2]) * groups
        sizes.append(("input channels", in_channels))
    return sizes


def _this_machine_findings(model: keras.Model, hardware: HardwareInfo) -> list[Finding]:
    """What is slow for this model on this machine (a CPU without a GPU), and the fix."""
    if hardware.gpus or hardware.tpus:
        return []
    findings = []
    slow = [name for name, done in cpu_float16.float16_product_layers(model).items() if not done]
    if slow:
        shown = ", ".join(repr(name) for name in slow[:3]) + (", ..." if len(slow) > 3 else "")
        findings.append(
            Finding(
                "info",
                "cpu-float16-kernels",
                None,
                f"on this machine (no GPU), {len(slow)} float16 layer(s) ({shown}) run "
                "TensorFlow's slow float16 CPU kernels: the convolution filter gradient "
                "(up to ~600x float32) and, without AVX512_FP16, float16 matmuls (1.1-3x).",
                "Train through tfmixprec (MixedPrecisionModel.compile or make_train_step do it), "
                "or call tfmixprec.cpu_float16.fast_float16_layers(model): their products then "
                "run in float32, within float16 rounding.",
            )
        )
    compute = model.dtype_policy.compute_dtype
    if compute == "bfloat16" and getattr(model, "compiled", False) and model.jit_compile:
        findings.append(
            Finding(
                "warning",
                "xla-bfloat16-cpu",
                None,
                "compiled with jit_compile=True under bfloat16 on a CPU: XLA's CPU backend "
                "does not use AMX/AVX512_BF16, so bfloat16 steps can be slower than float32.",
                "Compile with jit_compile=False (Keras's default on CPUs).",
            )
        )
    return findings


def audit(
    model: keras.Model, policy: str | None = None, hardware: HardwareInfo | None = None
) -> AuditReport:
    """Checks a built model for mixed-precision problems.

    Flags: softmax/sigmoid/log-softmax layers and model outputs computed in float16 or
    bfloat16 (error); Dense/Conv/Embedding/attention sizes that are not multiples of 8 in
    float16/bfloat16 layers (warning, with the padded size); a float16 model compiled without
    a LossScaleOptimizer (error; info if not compiled); variables stored in float16/bfloat16
    (error: master weights must stay float32).

    Args:
        model: `keras.Model`. A built model.
        policy: String. Audit as if the model had been built under this policy (`"auto"`
            allowed): layers that follow the model's own policy are assumed to follow this
            one; layers with a policy of their own keep it. `None` audits the model as it is,
            on this machine (it also says what is slow for it here, e.g. float16 on a CPU).
        hardware: `HardwareInfo`. The machine for those findings; detected when `None`.

    Returns:
        An `AuditReport`.

    Raises:
        TypeError: If `model` is not a `keras.Model`.
        ValueError: If the model is not built, or `policy` is unknown.

    Example:

    >>> report = tfmixprec.audit(model)
    >>> print(report)
    """
    if policy is not None:
        policy = check_policy_name(policy)
        if policy == "auto":
            policy = choose_policy().name
    check_built_model(model, "audit")
    model_policy = model.dtype_policy.name
    audited_policy = policy or model_policy

    def effective(layer: Any) -> keras.DTypePolicy:
        if policy is not None and layer.dtype_policy.name == model_policy:
            return keras.DTypePolicy(policy)
        return layer.dtype_policy

    findings: list[Finding] = []
    rows: list[LayerDtypes] = []
    layers = [
        layer for layer in iter_layers(model) if not isinstance(layer, keras.layers.InputLayer)
    ]
    outputs = {id(layer) for layer in output_layers(model)}
    any_float16 = False

    for layer in layers:
        is_container = bool(getattr(layer, "layers", None))
        layer_policy = effective(layer)
        compute = layer_policy.compute_dtype
        rows.append(
            LayerDtypes(
                layer=layer.name,
                class_name=type(layer).__name__,
                policy=layer_policy.name,
                compute_dtype=compute,
                variable_dtype=layer_policy.variable_dtype,
            )
        )
        if is_container:
            continue
        low = compute in LOW_PRECISION
        any_float16 = any_float16 or compute == "float16"
        reason = float32_reason(layer)
        if low and reason is not None:
            findings.append(
                Finding(
                    "error",
                    "low-precision-softmax",
                    layer.name,
                    f"{reason} computed in {compute}: it saturates and loses small probabilities.",
                    "Call tfmixprec.float32_outputs(model), or give this layer dtype='float32'.",
                )
            )
        elif low and id(layer) in outputs:
            findings.append(
                Finding(
                    "error",
                    "low-precision-output",
                    layer.name,
                    f"produces a model output in {compute}; the loss should see float32.",
                    "Call tfmixprec.float32_outputs(model), or give this layer dtype='float32'.",
                )
            )
        if low:
            for what, size in _sizes_to_align(layer):
                if size % ALIGNMENT:
                    findings.append(
                        Finding(
                            "warning",
                            "tensor-core-alignment",
                            layer.name,
                            f"{what} is {size}, not a multiple of {ALIGNMENT}: Tensor Cores "
                            f"run {compute} matmuls fastest on multiples of {ALIGNMENT}.",
                            f"Pad {what} to {_padded(size)}.",
                        )
                    )
        for variable in layer.weights:
            if variable.dtype in LOW_PRECISION:
                findings.append(
                    Finding(
                        "error",
                        "low-precision-variable",
                        layer.name,
                        f"variable {variable.path or variable.name!r} is stored in "
                        f"{variable.dtype}; master weights must stay float32.",
                        "Build the layer under a mixed_* policy (float32 variables, "
                        "low-precision compute) instead of dtype='float16'/'bfloat16'.",
                    )
                )

    if any_float16:
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            findings.append(
                Finding(
                    "info",
                    "not-compiled",
                    None,
                    "the model computes in float16 and is not compiled yet; float16 needs "
                    "loss scaling.",
                    "Compile with tfmixprec.LossScaleOptimizer(your_optimizer).",
                )
            )
        elif not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            findings.append(
                Finding(
                    "error",
                    "no-loss-scaling",
                    None,
                    f"the model computes in float16 but its optimizer "
                    f"{type(optimizer).__name__} does not scale the loss: small gradients "
                    "flush to zero.",
                    "Compile with tfmixprec.LossScaleOptimizer(your_optimizer).",
                )
            )
    if policy is None:
        findings.extend(
            _this_machine_findings(model, detect_hardware() if hardware is None else hardware)
        )
    order = {s: i for i, s in enumerate(SEVERITIES)}
    findings.sort(key=lambda f: order[f.severity])
    return AuditReport(model=model.name, policy=audited_policy, findings=findings, layers=rows)
