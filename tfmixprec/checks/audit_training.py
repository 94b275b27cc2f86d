"""The audit's findings on how a model will train: loss scaling for float16 (its optimizer, or
the wrapper Keras's `compile` adds), and on a machine without a GPU, the float16 and bfloat16
layers that run slow CPU kernels and XLA under bfloat16.
"""

from __future__ import annotations

import keras

from tfmixprec._common.text import first_few
from tfmixprec.checks.audit_context import AuditContext
from tfmixprec.checks.audit_report import Finding
from tfmixprec.precision import cpu_bfloat16, cpu_float16
from tfmixprec.precision.cpu_route import route_of

__all__: list[str] = []


_LOSS_SCALE_FIX = "Compile with tfmixprec.LossScaleOptimizer(your_optimizer)."


def loss_scaling(model: keras.Model, context: AuditContext) -> list[Finding]:
    """`not-compiled` (info) or `no-loss-scaling` (error) for a model computing in float16;
    `keras-loss-scaling` (info) for a model audited under `mixed_float16` that was compiled
    under another policy, whose optimizer its `compile` wraps there (`_wrapper_at_compile`)."""
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
    name = type(optimizer).__name__
    wrapper = _wrapper_at_compile(model, context)
    if wrapper is not None:
        message = (
            f"the model was compiled under {context.model_policy} with {name}; compiled the "
            f"same way under mixed_float16, {wrapper}, so the loss is scaled."
        )
        fix = (
            "None needed, unless you turn that off (compile(auto_scale_loss=False)): then "
            "compile with tfmixprec.LossScaleOptimizer(your_optimizer)."
        )
        return [Finding("info", "keras-loss-scaling", None, message, fix)]
    message = (
        f"the model computes in float16 but its optimizer {name} does not scale the loss: "
        "small gradients flush to zero."
    )
    return [Finding("error", "no-loss-scaling", None, message, _LOSS_SCALE_FIX)]


def _wrapper_at_compile(model: keras.Model, context: AuditContext) -> str | None:
    """What wraps the model's optimizer for loss scaling when it is compiled under the
    audited policy, or None where nothing would. Keras's `compile` wraps it in its own
    `LossScaleOptimizer` where `auto_scale_loss` is on (its default, which the model does not
    keep) and the model's policy is exactly `mixed_float16`; a KerasHub task's `compile`
    passes through to it (tfmixprec's `MixedPrecisionModel` has a tfmixprec
    `LossScaleOptimizer` under any policy). A model compiled under `mixed_float16` already has
    the optimizer it would get; a class with a `compile` of its own may do anything: None."""
    if context.policy != "mixed_float16" or context.model_policy == "mixed_float16":
        return None
    if type(model).compile.__module__.split(".")[0] not in ("keras", "keras_hub"):
        return None
    return (
        "Keras's compile wraps it in its own LossScaleOptimizer (auto_scale_loss=True, "
        "compile's default)"
    )


def cpu_float16_kernels(model: keras.Model, context: AuditContext) -> list[Finding]:
    """Float16 layers that run float16 CPU kernels slow on this machine's CPU, not routed."""
    if not context.cpu_only:
        return []
    served = cpu_float16.served_layers(model, context.hardware)
    # by the layer itself: nested layers share names (each KerasHub block's `query`)
    slow = [(layer.name, route) for layer, route in served if route_of(layer) != route.name]
    if not slow:
        return []
    shown = first_few([repr(name) for name, _ in slow])
    whys = "; ".join(dict.fromkeys(route.why for _, route in slow))
    message = (
        f"on this machine (no GPU), {len(slow)} float16 layer(s) ({shown}) run TensorFlow "
        f"float16 CPU kernels that are slow on this CPU: {whys} (benchmarks/RESULTS.md, 16)."
    )
    fix = (
        "Train through tfmixprec (MixedPrecisionModel.compile or make_train_step do it), "
        "or call tfmixprec.cpu_float16.fast_float16_layers(model): their products then "
        "run in float32, within float16 rounding."
    )
    return [Finding("info", "cpu-float16-kernels", None, message, fix)]


def cpu_bfloat16_kernels(model: keras.Model, context: AuditContext) -> list[Finding]:
    """bfloat16 layers that a `cpu_bfloat16` route serves on this CPU: routed or not yet."""
    if not context.cpu_only:
        return []
    served = [
        (layer, route)
        for layer, route in cpu_bfloat16.served_layers(model, context.hardware)
        # a table's logits only where this model's observed call computes them
        if route is not cpu_bfloat16.LOGITS
        or any(call.float_input for call in context.observation.calls_of(layer))
    ]
    if not served:
        return []
    shown = first_few([f"{layer.name!r} ({route.name})" for layer, route in served])
    if all(route_of(layer) == route.name for layer, route in served):
        message = f"{len(served)} bfloat16 layer(s) take a tfmixprec.cpu_bfloat16 route: {shown}."
        fix = "None needed: their outputs and saved files are as Keras makes them."
        return [Finding("info", "cpu-bfloat16-routed", None, message, fix)]
    why = "; ".join(dict.fromkeys(route.why for _, route in served))  # each route once
    message = (
        f"on this CPU, {len(served)} bfloat16 layer(s) run slower than they need: {shown} "
        f"({why}; docs/guides/bfloat16-on-cpus.md)."
    )
    fix = (
        "Train through tfmixprec (MixedPrecisionModel.compile does it), or call "
        "tfmixprec.cpu_bfloat16.fast_bfloat16_layers(model): within bfloat16 rounding."
    )
    return [Finding("info", "cpu-bfloat16-kernels", None, message, fix)]


def xla_bfloat16_cpu(model: keras.Model, context: AuditContext) -> list[Finding]:
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
