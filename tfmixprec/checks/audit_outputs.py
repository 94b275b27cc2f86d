"""The audit's findings on what a model computes in: outputs in float16/bfloat16 (a layer's or an
operation's outside any layer), variables stored in them, NaN/Inf from a call on zeros, a
training call that raises on the model's own dtype mix, layers in float32 on purpose, and a
model the audit could not call.
"""

from __future__ import annotations

from typing import Any

import keras

from tfmixprec._common.layers import (
    all_layers,
    float32_on_purpose,
)
from tfmixprec._common.observe import (
    LayerCall,
    policies_swapped,
)
from tfmixprec._keras.graph import all_sublayers
from tfmixprec.checks.audit_context import AuditContext
from tfmixprec.checks.audit_report import Finding
from tfmixprec.checks.training_call import training_clash
from tfmixprec.precision.policy import (
    LOW_PRECISION,
    float32_reason,
)

__all__: list[str] = []


_FLOAT32_FIX = "Call tfmixprec.float32_outputs(model), or give this layer dtype='float32'."


def low_precision_output(layer: Any, context: AuditContext) -> list[Finding]:
    """A model output that a real call returns in float16/bfloat16: the loss sees it.

    Only outputs: a softmax, sigmoid or log-softmax inside the model feeds layers that compute
    in float16/bfloat16 anyway, and computing it in float32 changes nothing measurable there
    (`benchmarks/softmax_precision.py`: an attention's softmax within 2 machine epsilons of a
    float32 one, the same training loss to 4 digits).
    """
    outputs = context.low_precision_outputs(layer)
    if not outputs:
        return []
    dtype, reason = outputs[0].dtype, float32_reason(layer)
    through = ", ".join(repr(passing.name) for passing in outputs[0].through)
    via = f" (through {through})" if through else ""
    if reason is not None:
        message = (
            f"{reason} computed in {dtype} produces a model output{via}: it saturates and "
            "loses small probabilities, whose log the loss takes."
        )
        return [Finding("error", "low-precision-softmax", layer.name, message, _FLOAT32_FIX)]
    message = f"produces a model output in {dtype}{via}; the loss should see float32."
    return [Finding("error", "low-precision-output", layer.name, message, _FLOAT32_FIX)]


def low_precision_variable(layer: Any, context: AuditContext) -> list[Finding]:
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


def output_outside_layers(model: keras.Model, context: AuditContext) -> list[Finding]:
    """A model output in float16/bfloat16 made by an operation outside any layer (raw
    tensor arithmetic in a subclassed model's `call`): no layer's dtype can fix it."""
    dtypes = [
        out.dtype
        for out in context.observation.outputs
        if out.layer is None and out.dtype in LOW_PRECISION
    ]
    if not dtypes:
        return []
    message = (
        f"{len(dtypes)} model output(s) in {dtypes[0]} made outside any layer (an operation in "
        "the model's call); the loss should see float32."
    )
    fix = "Cast it in the model's call: keras.ops.cast(output, 'float32')."
    return [Finding("error", "low-precision-output", None, message, fix)]


def nonfinite_output(model: keras.Model, context: AuditContext) -> list[Finding]:
    """A call on zeros whose float16/bfloat16 values are not finite: the first layer that
    returned NaN/Inf, and the first such operation, with whether a constant of the model's
    own code was too large for the dtype or its values passed the range (`op_watch`)."""
    observation, op = context.observation, context.observation.nonfinite
    if op is None or observation.finite or not (op.constant or op.inputs_finite):
        return []  # finite, not finite in float32 too, or from a non-finite input
    layer = _nonfinite_source(model, next(c for c in observation.calls if not c.finite))
    at = f" at {op.where}" if op.where else ""
    if op.constant:
        why = (
            f"its {op.operation}{at} is given a constant too large for {op.dtype}: the model's "
            f"own code, not {op.dtype}'s range of its values"
        )
    else:  # every input finite
        why = f"its {op.operation}{at} passes {op.dtype}'s range"
    message = (
        f"a call on a batch of zeros returns NaN/Inf in {op.dtype}: the first layer whose "
        f"output is not finite is {layer.path!r}, and {why}."
    )
    fix = (
        "Compute that layer in float32 (tfmixprec.calibrate(model, data) finds the layers and "
        "explain_overflow says why), or use mixed_bfloat16."
    )
    return [Finding("error", "nonfinite-output", layer.name, message, fix)]


def _nonfinite_source(model: keras.Model, call: LayerCall) -> Any:
    """The layer that made `call`'s NaN/Inf: its own, or, where an input came from an
    operation outside the leaf layers (an attention layer's own code around its dropout), the
    innermost layer around it."""
    if all(source is not None for source in call.input_sources):
        return call.layer
    around = [
        outer
        for outer in all_layers(model)
        if outer is not model and any(part is call.layer for part in all_sublayers(outer))
    ]
    return min(around, key=lambda outer: len(all_sublayers(outer)), default=call.layer)


def dtype_clash(model: keras.Model, context: AuditContext) -> list[Finding]:
    """`dtype-clash` (error): a float16/bfloat16 model whose training call on zeros raises
    because its own code mixes dtypes (`training_call`), with the layers `calibrate` would
    compute in float32. Not tried where the inference call did not run."""
    observation = context.observation
    low = any(context.compute_dtype(layer) in LOW_PRECISION for layer in context.leaves)
    if not low or not observation.called or observation.error is not None:
        return []
    follow = [lyr for lyr in (model, *context.layers) if id(lyr.dtype_policy) in context.followers]
    swapped = follow if context.policy is not None else []
    with policies_swapped(swapped, context.policy or context.model_policy):
        found = training_clash(model)
    if found is None:
        return []
    layer = None if found.clash.layer is None else found.clash.layer.name
    return [Finding("error", "dtype-clash", layer, found.message(), found.fix())]


def on_purpose_info(model: keras.Model, context: AuditContext) -> list[Finding]:
    """`float32-on-purpose` (info): layers that `calibrate` or `PrecisionRepair` set to
    float32 because their values pass float16's range (recorded on the model in this
    process): expected, nothing to fix."""
    marked = float32_on_purpose(model)
    if not marked:
        return []
    names = ", ".join(f"{path!r} ({why})" for path, why in marked.items())
    message = f"{len(marked)} layers compute in float32 on purpose: {names}."
    fix = "Nothing to fix: their values pass float16's range (see docs/guides/repair.md)."
    return [Finding("info", "float32-on-purpose", None, message, fix)]


def unobserved_info(model: keras.Model, context: AuditContext) -> list[Finding]:
    """`unobserved` (info): the model could not be called on a batch of zeros, or the audit of
    a file did not call it (past `DECLARED_BUDGET`), so its outputs' dtypes are the ones Keras
    infers symbolically (which a real call can contradict)."""
    error = context.observation.error
    if error is None:
        return []
    symbolic = (
        "its outputs' dtypes are Keras's symbolic ones, which a real call can contradict (a "
        "layer may return float32 under a float16 policy)."
    )
    fix = "Check the outputs' dtypes on a real batch: model(batch).dtype."
    if not context.observation.called:
        message = f"{error}, so {symbolic}"
        fix += (
            " For a file you trust, audit the model in Python, where the call has no budget: "
            "tfmixprec.audit(keras.models.load_model(path))."
        )
    else:
        message = f"calling the model on a batch of zeros failed ({error[:200]}), so {symbolic}"
    return [Finding("info", "unobserved", None, message, fix)]
