"""Static checks of a model for mixed precision: dtypes, float32 outputs, Tensor Core sizes."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import keras

from tfmixprec import cpu_float16
from tfmixprec._keras_compat import recorded_call_kwargs
from tfmixprec._layers import check_built_model, is_container, iter_layers, output_layers
from tfmixprec._model_file import load_model_file
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
        elif any(layer.compute_dtype in LOW_PRECISION for layer in self.layers):
            lines.append("No findings: the model is ready for mixed precision.")
        else:
            lines.append(f"No findings: the model computes in float32 (policy {self.policy}).")
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
    elif isinstance(layer, keras.layers.EinsumDense):
        sizes += _einsum_sizes(layer)
    elif hasattr(layer, "pointwise_kernel"):  # SeparableConv1D/2D: a 1x1 convolution last
        sizes.append(("filters", layer.filters))
        sizes.append(("pointwise input channels", int(layer.pointwise_kernel.shape[-2])))
    elif hasattr(layer, "filters") and hasattr(layer, "kernel_size") and hasattr(layer, "kernel"):
        sizes.append(("filters", layer.filters))
        kernel = layer.kernel.shape
        transpose = "Transpose" in type(layer).__name__
        groups = getattr(layer, "groups", 1) or 1
        in_channels = int(kernel[-1]) if transpose else int(kernel[-2]) * groups
        sizes.append(("input channels", in_channels))
    return sizes


def _einsum_sizes(layer: Any) -> list[tuple[str, int]]:
    """An `EinsumDense`'s matmul sizes: its kernel's contracted and output dimensions (those
    in every operand, e.g. attention heads, are batch dimensions of the product)."""
    inputs, rest = layer.equation.replace("...", "").split(",")
    kernel, output = rest.split("->")
    sizes = []
    for letter, size in zip(kernel, layer.kernel.shape):
        if letter in inputs and letter not in output:
            sizes.append((f"input features (equation dimension {letter!r})", int(size)))
        elif letter in output and letter not in inputs:
            sizes.append((f"output size (equation dimension {letter!r})", int(size)))
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
        followers: Frozenset of ints. The `id()`s of the policy objects that follow the
            model's own policy (a layer built with `dtype=` has a policy object of its own).
        attention: Dict. `id(softmax layer) -> (attention layer, when it runs)` for the
            `Softmax` inside each `MultiHeadAttention` (see `_attention_softmax_use`).
        in_attention: Frozenset of ints. The `id()`s of the layers inside a
            `MultiHeadAttention` (the attention layer reports their sizes itself).
    """

    model_policy: str
    policy: str | None
    layers: tuple[Any, ...]
    output_ids: frozenset[int]
    hardware: HardwareInfo | None
    followers: frozenset[int] = frozenset()
    attention: dict[int, tuple[Any, str | None]] = dataclasses.field(default_factory=dict)
    in_attention: frozenset[int] = frozenset()

    @property
    def leaves(self) -> list[Any]:
        """The layers that compute (nested models left out): the ones layer checks see."""
        return [layer for layer in self.layers if not is_container(layer)]

    @property
    def cpu_only(self) -> bool:
        """True when auditing on this machine and it has no GPU or TPU."""
        return self.hardware is not None and not (self.hardware.gpus or self.hardware.tpus)

    def policy_of(self, layer: Any) -> keras.DTypePolicy:
        """The policy audited for `layer`: `policy` where it follows the model's own (a layer
        built with a `dtype=` of its own keeps it under any policy)."""
        if self.policy is not None and id(layer.dtype_policy) in self.followers:
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
    if id(layer) in context.attention:
        return _attention_softmax(layer, compute, *context.attention[id(layer)])
    message = f"{reason} computed in {compute}: it saturates and loses small probabilities."
    return [Finding("error", "low-precision-softmax", layer.name, message, _FLOAT32_FIX)]


_UNKNOWN_CALLS = "unknown"


def _attention_softmax_use(attention: Any) -> str | None:
    """Why Keras computes `attention`'s softmax with its own `Softmax` layer, or None when it
    never does (`_UNKNOWN_CALLS` when the model's code does not show how it is called).

    Keras's `MultiHeadAttention._compute_attention` (TensorFlow backend) uses the fused
    `ops.dot_product_attention`, which casts the scores to float32 and computes the softmax
    in float32, unless the layer has dropout, attends over more than one axis, or is called
    with `return_attention_scores=True`: then its `Softmax` layer runs, in the layer's dtype.
    """
    if attention.dropout > 0:
        return f"dropout={attention.dropout}"
    axes = attention.attention_axes
    if axes is not None and len(axes) > 1:
        return f"attention over axes {tuple(axes)}"
    calls = recorded_call_kwargs(attention)
    if calls is None:
        return _UNKNOWN_CALLS
    if any(kwargs.get("return_attention_scores") for kwargs in calls):
        return "it is called with return_attention_scores=True"
    return None


def _attention_softmax(layer: Any, compute: str, attention: Any, use: str | None) -> list[Finding]:
    """The finding for the `Softmax` inside a `MultiHeadAttention`: an error where it runs."""
    name = f"MultiHeadAttention {attention.name!r}"
    if use is None:
        return []  # the fused path: softmax in float32
    if use != _UNKNOWN_CALLS:
        message = (
            f"{name} computes its attention softmax with this layer ({use}), in {compute}: "
            "it saturates and loses small probabilities."
        )
        return [Finding("error", "low-precision-softmax", layer.name, message, _FLOAT32_FIX)]
    message = (
        f"{name} computes its softmax in float32 on Keras's fused path (no dropout, one "
        f"attention axis); only a call with return_attention_scores=True runs this {compute} "
        "Softmax layer instead, and a subclassed model's calls cannot be seen here."
    )
    fix = "None needed; if the model calls it with return_attention_scores=True: " + (
        _FLOAT32_FIX[0].lower() + _FLOAT32_FIX[1:]
    )
    return [Finding("info", "attention-softmax", layer.name, message, fix)]


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
    if compute not in LOW_PRECISION or id(layer) in context.in_attention:
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


def _float32_model(model: keras.Model, context: _AuditContext) -> list[Finding]:
    """`float32-model` (info): the model, as it is, computes in float32 only; what the audit
    finds under the policy recommended for this machine (`choose_policy`)."""
    leaves = context.leaves
    if context.hardware is None or not leaves:
        return []
    if any(context.compute_dtype(layer) in LOW_PRECISION for layer in leaves):
        return []
    choice = choose_policy(context.hardware)
    if choice.name == "float32":
        message = (
            "the model computes in float32 only, the policy recommended for this machine: "
            f"{choice.reason}"
        )
        fix = (
            "None needed here. For a GPU, audit it under the policy to use there: "
            "policy='mixed_float16' or 'mixed_bfloat16' (tfmixprec audit FILE --policy ...)."
        )
        return [Finding("info", "float32-model", None, message, fix)]
    found = _run_checks(model, dataclasses.replace(context, policy=choice.name, hardware=None))
    shown = [f"{f.code} [{f.layer or 'model'}] ({f.severity})" for f in found]
    what = "nothing to change" if not found else f"{_count(found)}: " + ", ".join(shown[:5])
    message = (
        f"the model computes in float32 only: no mixed precision yet. Under {choice.name}, "
        f"the policy recommended for this machine, the audit finds {what}"
        f"{', ...' if len(shown) > 5 else ''}."
    )
    fix = (
        f"Audit it under that policy for the details (tfmixprec.audit(model, "
        f"policy={choice.name!r}), or tfmixprec audit FILE --policy {choice.name}), then build "
        f"it under tfmixprec.set_policy({choice.name!r})."
    )
    return [Finding("info", "float32-model", None, message, fix)]


def _count(findings: Sequence[Finding]) -> str:
    """`"1 error, 2 warnings"`: the severities present, in order."""
    counts = [(s, sum(f.severity == s for f in findings)) for s in SEVERITIES]
    return ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts if n)


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
    ("model", _float32_model),  # float32-model: what the recommended policy would find
)


def _followers(model: keras.Model, layers: Sequence[Any]) -> frozenset[int]:
    """The `id()`s of the policy objects that follow the model's own policy.

    A layer built without `dtype=` holds the very policy object that was global when it was
    built, the model's own; one built with `dtype=` holds an object of its own. Where no layer
    holds the model's object (a model loaded by `keras.models.load_model`: every layer gets
    its own), layers whose policy has the model's policy's name count as following it.
    """
    own = model.dtype_policy
    if any(layer.dtype_policy is own for layer in layers):
        return frozenset([id(own)])
    return frozenset(id(lyr.dtype_policy) for lyr in layers if lyr.dtype_policy.name == own.name)


def _attention_parts(layers: Sequence[Any]) -> tuple[dict[int, tuple[Any, str | None]], set[int]]:
    """For each `MultiHeadAttention`: its `Softmax` (and when it runs), and its inner layers."""
    softmaxes: dict[int, tuple[Any, str | None]] = {}
    inner: set[int] = set()
    for attention in layers:
        if not isinstance(attention, keras.layers.MultiHeadAttention):
            continue
        use = _attention_softmax_use(attention)
        for part in iter_layers(attention):
            inner.add(id(part))
            if isinstance(part, keras.layers.Softmax):
                softmaxes[id(part)] = (attention, use)
    return softmaxes, inner


def _context(
    model: keras.Model,
    policy: str | None,
    hardware: HardwareInfo | None,
    followers: frozenset[int] | None = None,
) -> _AuditContext:
    """Checks `audit`'s arguments and gathers what the checks read (`followers`: see
    `_followers`; a saved model's are read from its file)."""
    if policy is not None:
        policy = _check_policy_name(policy)
        if policy == "auto":
            policy = choose_policy().name
    check_built_model(model, "audit")
    machine = None
    if policy is None:  # the model as it is, on this machine
        machine = detect_hardware() if hardware is None else hardware
    layers = [lyr for lyr in iter_layers(model) if not isinstance(lyr, keras.layers.InputLayer)]
    softmaxes, inner = _attention_parts(layers)
    return _AuditContext(
        model_policy=model.dtype_policy.name,
        policy=policy,
        layers=tuple(layers),
        output_ids=frozenset(id(layer) for layer in output_layers(model)),
        hardware=machine,
        followers=_followers(model, layers) if followers is None else followers,
        attention=softmaxes,
        in_attention=frozenset(inner),
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
    model: keras.Model | str | os.PathLike,
    policy: str | None = None,
    hardware: HardwareInfo | None = None,
) -> AuditReport:
    """Checks a built model for mixed-precision problems.

    Flags: softmax/sigmoid/log-softmax layers and model outputs computed in float16 or
    bfloat16 (error); Dense/Conv/Embedding/attention sizes that are not multiples of 8 in
    float16/bfloat16 layers (warning, with the padded size); a float16 model compiled without
    a LossScaleOptimizer (error; info if not compiled); variables stored in float16/bfloat16
    (error: master weights must stay float32). A `MultiHeadAttention`'s own `Softmax` counts
    only where Keras runs it (dropout, several attention axes, `return_attention_scores=True`);
    its fused path computes the softmax in float32. A model that computes in float32 only gets
    a `float32-model` info: what the audit finds under `choose_policy()`'s recommendation.

    Args:
        model: `keras.Model` (a built model), or the path of a saved `.keras` (or legacy
            `.h5`) file. A file is read as it was saved: loaded under its model's own policy,
            compiled as Keras compiled it (its saved optimizer says whether Keras wrapped it
            in a `LossScaleOptimizer`), and never with code from the file: a file that holds
            code (a `Lambda` layer's bytecode) or needs classes from outside Keras and
            tfmixprec is refused.
        policy: String. Audit as if the model had been built under this policy (`"auto"`
            allowed): layers that follow the model's own policy are assumed to follow this
            one; layers with a policy of their own keep it. `None` audits the model as it is,
            on this machine (it also says what is slow for it here, e.g. float16 on a CPU).
        hardware: `HardwareInfo`. The machine for those findings; detected when `None`.

    Returns:
        An `AuditReport`.

    Raises:
        TypeError: If `model` is not a `keras.Model` or a path.
        ValueError: If the model is not built, `policy` is unknown, or the file cannot be
            audited (missing, a directory, not a model, holds code, does not load).

    Example:

    >>> report = tfmixprec.audit(model)
    >>> print(report)
    """
    followers = None
    if isinstance(model, (str, os.PathLike)):
        model, followers = load_model_file(model)
    context = _context(model, policy, hardware, followers)
    return AuditReport(
        model=model.name,
        policy=context.policy or context.model_policy,
        findings=_run_checks(model, context),
        layers=[_layer_dtypes(layer, context) for layer in context.layers],
    )
