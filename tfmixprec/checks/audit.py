"""Static checks of a model for mixed precision: the table of checks (`CHECKS`, one function per
finding code, each in the module of its family: `audit_outputs`, `audit_alignment`,
`audit_float8`, `audit_training`) and the runner (`audit`), which returns an `AuditReport`
(`audit_report`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import keras

from tfmixprec._keras.settings import settings_kept
from tfmixprec.checks.audit_alignment import ALIGNMENT as ALIGNMENT
from tfmixprec.checks.audit_alignment import IMAGE_CHANNELS as IMAGE_CHANNELS
from tfmixprec.checks.audit_alignment import IMAGE_INPUT as IMAGE_INPUT
from tfmixprec.checks.audit_alignment import LARGE_PRODUCT as LARGE_PRODUCT
from tfmixprec.checks.audit_alignment import PADDING_COST as PADDING_COST
from tfmixprec.checks.audit_alignment import tensor_core_alignment
from tfmixprec.checks.audit_context import AuditContext, gather_context
from tfmixprec.checks.audit_float8 import (
    float8_first_layer,
    float8_misaligned,
    float8_no_gain,
    float8_output_layer,
)
from tfmixprec.checks.audit_outputs import (
    dtype_clash,
    low_precision_output,
    low_precision_variable,
    nonfinite_output,
    on_purpose_info,
    output_outside_layers,
    unobserved_info,
)
from tfmixprec.checks.audit_report import SEVERITIES
from tfmixprec.checks.audit_report import AuditReport as AuditReport
from tfmixprec.checks.audit_report import Finding as Finding
from tfmixprec.checks.audit_report import LayerDtypes as LayerDtypes
from tfmixprec.checks.audit_training import (
    cpu_bfloat16_kernels,
    cpu_float16_kernels,
    loss_scaling,
    xla_bfloat16_cpu,
)
from tfmixprec.checks.model_file import load_model_file
from tfmixprec.precision import cpu_float16
from tfmixprec.precision.hardware import HardwareInfo
from tfmixprec.precision.policy import (
    LOW_PRECISION,
    choose_policy,
)

__all__ = ["audit"]  # and, from 0.4.0 on, Finding, LayerDtypes and AuditReport (audit_report)


def _float32_model(model: keras.Model, context: AuditContext) -> list[Finding]:
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
    skipped = None if context.observation.called else context.observation.error
    recommended = gather_context(model, choice.name, None, context.followers, skipped)
    found = _run_checks(model, dataclasses.replace(recommended, no_gpu=context.no_gpu))
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


_Check = Callable[[Any, AuditContext], list[Finding]]


# Every check `audit` runs, one row each: ("layer", check) runs `check(layer, context)` on each
# leaf layer in the model's order, ("model", check) runs `check(model, context)` once after them.
# The report lists errors, then warnings, then info; within a severity, in this order.
CHECKS: tuple[tuple[str, _Check], ...] = (
    ("layer", low_precision_output),  # or low-precision-softmax for a softmax-like output
    ("layer", tensor_core_alignment),
    ("layer", low_precision_variable),
    ("layer", float8_output_layer),  # error at an output, warning for a softmax-like layer
    ("layer", float8_first_layer),
    ("layer", float8_misaligned),
    ("model", output_outside_layers),
    ("model", nonfinite_output),
    ("model", dtype_clash),  # a training call on zeros raises: the model cannot train
    ("model", unobserved_info),
    ("model", on_purpose_info),
    ("model", loss_scaling),  # not-compiled / no-loss-scaling
    ("model", cpu_float16_kernels),
    ("model", cpu_bfloat16_kernels),  # or cpu-bfloat16-routed
    ("model", xla_bfloat16_cpu),
    ("model", float8_no_gain),  # float8 layers in float32; no float8 Tensor Cores here (info)
    ("model", _float32_model),  # float32-model: what the recommended policy would find
)


def _run_checks(model: keras.Model, context: AuditContext) -> list[Finding]:
    findings: list[Finding] = []
    for layer in context.leaves:
        for scope, check in CHECKS:
            if scope == "layer":
                findings += check(layer, context)
    for scope, check in CHECKS:
        if scope == "model":
            findings += check(model, context)
    return sorted(findings, key=lambda finding: SEVERITIES.index(finding.severity))


def _layer_dtypes(layer: Any, context: AuditContext) -> LayerDtypes:
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

    Calls the model once on a batch of zeros (inference mode; nothing changes) and judges
    what the call shows; a float16/bfloat16 model is replayed once in training mode too (its
    loss, no gradients, nothing changes): a dtype clash of its own code there, which makes
    every training step raise, is an error (`dtype-clash`, with the layers `calibrate`
    would compute in float32). Flags: model outputs a real call returns in float16 or bfloat16
    (error: `low-precision-softmax` for a softmax/sigmoid/log-softmax output layer,
    `low-precision-output` otherwise), since the loss sees them; a softmax inside the model
    (an attention's, say) feeds float16/bfloat16 layers and is not flagged (measured:
    `benchmarks/softmax_precision.py`). Matmul and convolution sizes that are not multiples
    of 8 in float16/bfloat16 layers, in products whose N and K are both 128 or more and
    where padding adds at most 12.5% work (warning, with the padded size and its cost; an
    info for the model as it is on a machine without a GPU, where only GPU runs gain; a
    warning under `policy`, a plan for whichever machine trains it): a `Dense`'s units and
    input features, an `EinsumDense`'s K and N as its einsum lowers to a matmul (dimensions
    it keeps per head are batch dimensions), a convolution's filters and input channels (4
    suffice for an image's first convolution at stride >= 2), an attention's head sizes, and
    the output projection of an embedding called in reverse; an embedding lookup is a gather
    and has none. A float16 model compiled without a LossScaleOptimizer (error; info if not
    compiled, and an info, `keras-loss-scaling`, for a model compiled with Keras's `compile`
    under another policy and audited under `mixed_float16`, where Keras wraps it);
    variables stored in float16/bfloat16 (error: master weights must stay float32). A model
    that computes in float32 only gets a `float32-model` info: what the
    audit finds under `choose_policy()`'s recommendation. Layers quantized to float8 (Keras's
    `quantize("float8")`, as `model.quantize("float8")` does to every `Dense`), each judged
    once, as `float8_layers` would leave it out: a model output (error) or a softmax-like
    layer (warning), `float8-output-layer`; the model's first matmul layer (warning,
    `float8-first-layer`); a layer computing in float32 (warning, `float8-no-gain`); matmul
    dimensions not multiples of 16 (warning, `float8-misaligned`). On a machine without a GPU
    of compute capability 8.9 or later, float8 layers get a `float8-no-gain` info: float8 is
    emulated there.

    Args:
        model: `keras.Model` (a built model), or the path of a saved `.keras` (or legacy
            `.h5`) file. A file is read as it was saved: loaded under its model's own policy,
            compiled as Keras compiled it (its saved optimizer says whether Keras wrapped it
            in a `LossScaleOptimizer`), and never with code from the file: a file that holds
            code (a `Lambda` layer's bytecode) or needs classes from outside Keras and
            tfmixprec is refused. What its config declares is measured before anything is
            built (docs/guides/audit-in-ci.md): weights the file does not hold, past 256 MiB,
            are refused, and a call on zeros whose tensors would pass 256 MiB is not made
            (an `unobserved` info says so).
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
            audited (missing, a directory, not a model, holds code, declares weights it does
            not hold, does not load).

    Example:

    >>> report = tfmixprec.audit(model)
    >>> print(report)
    """
    # The audit leaves the process as it found it: compiling a file's model through tfmixprec
    # turns grappler's remapper off on a CPU, loading one sets Keras's global policy for a
    # while, and reading the global policy sets it where it was unset.
    with settings_kept(), cpu_float16.process_state_kept():
        followers = skipped = None
        if isinstance(model, (str, os.PathLike)):
            model, followers, skipped = load_model_file(model)
        context = gather_context(model, policy, hardware, followers, skipped)
        return AuditReport(
            model=model.name,
            policy=context.policy or context.model_policy,
            findings=_run_checks(model, context),
            layers=[_layer_dtypes(layer, context) for layer in context.layers],
        )
