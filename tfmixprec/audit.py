"""Static checks of a model for mixed precision: dtypes, float32 outputs, Tensor Core sizes."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import keras

from tfmixprec import cpu_float16
from tfmixprec._layers import check_built_model, is_container, iter_layers, output_layers
from tfmixprec._text import markdown_table
from tfmixprec.hardware import HardwareInfo, detect_hardware
from tfmixprec.policy import LOW_PRECISION, _check_policy_name, choose_policy, float32_reason

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
            rows = [(f.severity, f.layer or "-", f.message, f.fix) for f in self.findings]
            lines += markdown_table(("severity", "layer", "problem", "fix"), rows)
            lines.append("")
        rows = [(x.layer, x.class_name, x.compute_dtype, x.variable_dtype) for x in self.layers]
        lines += markdown_table(("layer", "class", "compute", "variables"), rows)
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


@dataclasses.dataclass(frozen=True)
class _AuditContext:
    """What a check reads besides its layer or model.

    Args:
        model_policy: String. The name of the model's own policy.
        policy: String or None. The policy audited instead of the model's own (`audit`'s
            `policy=`), or None.
        layers: Tuple of layers. The model's layers, nested ones included, no `InputLayer`.
        output_ids: Frozenset of ints. The `id()`s of the layers that produce model outputs.
        hardware: `HardwareInfo` or None. The machine for machine findings; None when auditing
            under another policy (no machine findings then).
    """

    model_policy: str
    policy: str | None
    layers: tuple[Any, ...]
    output_ids: frozenset[int]
    hardware: HardwareInfo | None

    @property
    def leaves(self) -> list[Any]:
        """The layers that compute (nested models left out): the ones layer checks see."""
        return [layer for layer in self.layers if not is_container(layer)]

    @property
    def cpu_only(self) -> bool:
        """True when auditing on this machine and it has no GPU or TPU."""
        return self.hardware is not None and not (self.hardware.gpus or self.hardware.tpus)

    def policy_of(self, layer: Any) -> keras.DTypePolicy:
        """The policy audited for `layer`: `policy` where it follows the model's own."""
        if self.policy is not None and layer.dtype_policy.name == self.model_policy:
            return keras.DTypePolicy(self.policy)
        return layer.dtype_policy

    def compute_dtype(self, layer: Any) -> str:
        """The compute dtype audited for `layer`."""
        return self.policy_of(layer).compute_dtype


_FLOAT32_FIX = "Call tfmixprec.float32_outputs(model), or give this layer dtype='float32'."
_LOSS_SCALE_FIX = "Compile with tfmixprec.LossScaleOptimizer(your_optimizer)."


# Layer checks: `check(layer, context) -> list[Finding]`, run on every leaf layer.


def _low_precision_softmax(layer: Any, context: _AuditContext) -> list[Finding]:
    compute = context.compute_dtype(layer)
    reason = float32_reason(layer)
    if compute not in LOW_PRECISION or reason is None:
        return []
    message = f"{reason} computed in {compute}: it saturates and loses small probabilities."
    return [Finding("error", "low-precision-softmax", layer.name, message, _FLOAT32_FIX)]


def _low_precision_output(layer: Any, context: _AuditContext) -> list[Finding]:
    compute = context.compute_dtype(layer)
    if compute not in LOW_PRECISION or id(layer) not in context.output_ids:
        return []
    if float32_reason(layer) is not None:
        return []  # reported once, as low-precision-softmax
    message = f"produces a model output in {compute}; the loss should see float32."
    return [Finding("error", "low-precision-output", layer.name, message, _FLOAT32_FIX)]


def _tensor_core_alignment(layer: Any, context: _AuditContext) -> list[Finding]:
    compute = context.compute_dtype(layer)
    if compute not in LOW_PRECISION:
        return []
    return [
        Finding(
            "warning",
            "tensor-core-alignment",
            layer.name,
            f"{what} is {size}, not a multiple of {ALIGNMENT}: Tensor Cores "
            f"run {compute} matmuls fastest on multiples of {ALIGNMENT}.",
            f"Pad {what} to {_padded(size)}.",
        )
        for what, size in _sizes_to_align(layer)
        if size % ALIGNMENT
    ]


def _low_precision_variable(layer: Any, context: _AuditContext) -> list[Finding]:
    return [
        Finding(
            "error",
            "low-precision-variable",
            layer.name,
            f"variable {variable.path or variable.name!r} is stored in "
            f"{variable.dtype}; master weights must stay float32.",
            "Build the layer under a mixed_* policy (float32 variables, "
            "low-precision compute) instead of dtype='float16'/'bfloat16'.",
        )
        for variable in layer.weights
        if variable.dtype in LOW_PRECISION
    ]


# Model checks: `check(model, context) -> list[Finding]`, run once.


def _loss_scaling(model: keras.Model, context: _AuditContext) -> list[Finding]:
    """`not-compiled` (info) or `no-loss-scaling` (error) for a model computing in float16."""
    if not any(context.compute_dtype(layer) == "float16" for layer in context.leaves):
        return []
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        message = (
            "the model computes in float16 and is not compiled yet; float16 needs loss scaling."
        )
        return [Finding("info", "not-compiled", None, message, _LOSS_SCALE_FIX)]
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return []
    message = (
        f"the model computes in float16 but its optimizer {type(optimizer).__name__} does not "
        "scale the loss: small gradients flush to zero."
    )
    return [Finding("error", "no-loss-scaling", None, message, _LOSS_SCALE_FIX)]


def _cpu_float16_kernels(model: keras.Model, context: _AuditContext) -> list[Finding]:
    """Float16 layers that run TensorFlow's slow float16 CPU kernels on this machine."""
    if not context.cpu_only:
        return []
    slow = [name for name, done in cpu_float16.float16_product_layers(model).items() if not done]
    if not slow:
        return []
    shown = ", ".join(repr(name) for name in slow[:3]) + (", ..." if len(slow) > 3 else "")
    message = (
        f"on this machine (no GPU), {len(slow)} float16 layer(s) ({shown}) run "
        "TensorFlow's slow float16 CPU kernels: the convolution filter gradient "
        "(up to ~600x float32) and, without AVX512_FP16, float16 matmuls (1.1-3x)."
    )
    fix = (
        "Train through tfmixprec (MixedPrecisionModel.compile or make_train_step do it), "
        "or call tfmixprec.cpu_float16.fast_float16_layers(model): their products then "
        "run in float32, within float16 rounding."
    )
    return [Finding("info", "cpu-float16-kernels", None, message, fix)]


def _xla_bfloat16_cpu(model: keras.Model, context: _AuditContext) -> list[Finding]:
    """A bfloat16 model compiled with XLA on a machine without a GPU."""
    if not context.cpu_only or model.dtype_policy.compute_dtype != "bfloat16":
        return []
    if not (getattr(model, "compiled", False) and model.jit_compile):
        return []
    message = (
        "compiled with jit_compile=True under bfloat16 on a CPU: XLA's CPU backend "
        "does not use AMX/AVX512_BF16, so bfloat16 steps can be slower than float32."
    )
    fix = "Compile with jit_compile=False (Keras's default on CPUs)."
    return [Finding("warning", "xla-bfloat16-cpu", None, message, fix)]


_Check = Callable[[Any, _AuditContext], list[Finding]]

# Every check `audit` runs, one row each: ("layer", check) runs `check(layer, context)` on each
# leaf layer in the model's order, ("model", check) runs `check(model, context)` once after them.
# The report lists errors, then warnings, then info; within a severity, in this order.
CHECKS: tuple[tuple[str, _Check], ...] = (
    ("layer", _low_precision_softmax),  # and low-precision-output: one or the other
    ("layer", _low_precision_output),
    ("layer", _tensor_core_alignment),
    ("layer", _low_precision_variable),
    ("model", _loss_scaling),  # not-compiled / no-loss-scaling
    ("model", _cpu_float16_kernels),
    ("model", _xla_bfloat16_cpu),
)


def _context(
    model: keras.Model, policy: str | None, hardware: HardwareInfo | None
) -> _AuditContext:
    """Checks `audit`'s arguments and gathers what the checks read."""
    if policy is not None:
        policy = _check_policy_name(policy)
        if policy == "auto":
            policy = choose_policy().name
    check_built_model(model, "audit")
    machine = None
    if policy is None:  # the model as it is, on this machine
        machine = detect_hardware() if hardware is None else hardware
    layers = iter_layers(model)
    return _AuditContext(
        model_policy=model.dtype_policy.name,
        policy=policy,
        layers=tuple(lyr for lyr in layers if not isinstance(lyr, keras.layers.InputLayer)),
        output_ids=frozenset(id(layer) for layer in output_layers(model)),
        hardware=machine,
    )


def _run_checks(model: keras.Model, context: _AuditContext) -> list[Finding]:
    findings: list[Finding] = []
    for layer in context.leaves:
        for scope, check in CHECKS:
            if scope == "layer":
                findings += check(layer, context)
    for scope, check in CHECKS:
        if scope == "model":
            findings += check(model, context)
    return sorted(findings, key=lambda finding: SEVERITIES.index(finding.severity))


def _layer_dtypes(layer: Any, context: _AuditContext) -> LayerDtypes:
    policy = context.policy_of(layer)
    return LayerDtypes(
        layer=layer.name,
        class_name=type(layer).__name__,
        policy=policy.name,
        compute_dtype=policy.compute_dtype,
        variable_dtype=policy.variable_dtype,
    )


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
    context = _context(model, policy, hardware)
    return AuditReport(
        model=model.name,
        policy=context.policy or context.model_policy,
        findings=_run_checks(model, context),
        layers=[_layer_dtypes(layer, context) for layer in context.layers],
    )
