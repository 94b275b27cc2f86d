"""Setting and choosing dtype policies, and forcing float32 on output and softmax layers."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras

from tfmixprec._common.layers import check_built_model, forget_traced_functions, iter_layers
from tfmixprec._common.observe import Observation, observe
from tfmixprec._common.text import docs_page
from tfmixprec._keras.settings import global_policy, restore_global_policy
from tfmixprec.precision import cpu_float16
from tfmixprec.precision.cpu_route import unroute
from tfmixprec.precision.hardware import GPUInfo, HardwareInfo, detect_hardware

__all__ = [
    "PolicyChoice",
    "PolicyChange",
    "choose_policy",
    "set_policy",
    "policy_scope",
    "float32_outputs",
]

POLICY_NAMES = ("mixed_float16", "mixed_bfloat16", "float32", "auto")
LOW_PRECISION = ("float16", "bfloat16")
# Activations whose float16 output loses too much (saturation, log of tiny values).
FLOAT32_ACTIVATIONS = ("softmax", "log_softmax", "sigmoid")
_WARNED = {"float16_without_gpu": False}  # set_policy's warning comes once per process


@dataclasses.dataclass(frozen=True)
class PolicyChoice:
    """The policy `auto` picks, and why.

    Args:
        name: String. A Keras policy name.
        reason: String. One sentence saying why.
    """

    name: str
    reason: str


@dataclasses.dataclass(frozen=True)
class PolicyChange:
    """One layer whose policy `float32_outputs` changed."""

    layer: str
    old: str
    new: str
    why: str


def choose_policy(hardware: HardwareInfo | None = None) -> PolicyChoice:
    """Picks the fastest safe policy for the hardware.

    `mixed_bfloat16` on TPUs and on NVIDIA GPUs with compute capability >= 8.0 (no loss
    scaling needed); `mixed_float16` on compute capability 7.x (float16 Tensor Cores only);
    `mixed_bfloat16` on CPUs with AVX512_BF16 or AMX_BF16; `float32` otherwise (older GPUs and
    CPUs without bfloat16, where mixed precision is slower). With several GPUs the weakest
    decides, since all replicas run one policy.

    Args:
        hardware: `HardwareInfo`. The devices; detected when `None`.

    Returns:
        A `PolicyChoice` with `name` and `reason`.

    Example:

    >>> tfmixprec.choose_policy().name  # on this machine
    >>> a100 = tfmixprec.HardwareInfo(gpus=(tfmixprec.GPUInfo("NVIDIA A100", (8, 0)),))
    >>> tfmixprec.choose_policy(a100).name
    'mixed_bfloat16'
    """
    hw = detect_hardware() if hardware is None else hardware
    if hw.tpus:
        return PolicyChoice(
            "mixed_bfloat16", f"{hw.tpus} TPU device(s): TPUs compute natively in bfloat16."
        )
    if hw.gpus:
        return _choose_for_gpus(hw.gpus)
    if hw.cpu_bfloat16:
        flags = "AMX_BF16" if hw.cpu_amx else "AVX512_BF16"
        return PolicyChoice(
            "mixed_bfloat16",
            f"no GPU; the CPU ({hw.cpu_name or 'unknown'}) has {flags}: bfloat16 matmuls run "
            "natively (about 2x float32). A whole model gains less, some nothing (MobileNetV3 "
            "measured 0.68-1.10x float32 through tfmixprec): `tfmixprec bench --model` "
            "measures yours.",
        )
    return PolicyChoice(
        "float32",
        "no GPU and no CPU bfloat16 support (AVX512_BF16/AMX_BF16): float16 and bfloat16 "
        "would be emulated and slower than float32.",
    )


def _choose_for_gpus(gpus: tuple[GPUInfo, ...]) -> PolicyChoice:
    """The policy for NVIDIA GPUs: the weakest compute capability decides."""
    ccs = [g.compute_capability for g in gpus]
    if any(cc is None for cc in ccs):
        names = ", ".join(g.name for g in gpus if g.compute_capability is None)
        return PolicyChoice(
            "float32",
            f"GPU(s) with unknown compute capability ({names}): no known fast float16 "
            "or bfloat16 path, so float32 is the safe choice.",
        )
    weakest = min(ccs)
    cc_text = f"{weakest[0]}.{weakest[1]}"
    if weakest >= (8, 0):
        return PolicyChoice(
            "mixed_bfloat16",
            f"NVIDIA GPU(s) with compute capability {cc_text} (>= 8.0) have bfloat16 "
            "Tensor Cores; bfloat16 has float32's range, so no loss scaling is needed.",
        )
    if weakest >= (7, 0):
        return PolicyChoice(
            "mixed_float16",
            f"NVIDIA GPU(s) with compute capability {cc_text} have float16 Tensor Cores "
            "but no bfloat16 ones; use float16 with loss scaling.",
        )
    return PolicyChoice(
        "float32",
        f"NVIDIA GPU(s) with compute capability {cc_text} (< 7.0) have no Tensor Cores: "
        "mixed precision would be slower than float32.",
    )


def check_policy_name(name: Any) -> str:
    """Returns the policy name of `name` (a string or a `keras.DTypePolicy`), or raises."""
    if isinstance(name, keras.DTypePolicy):
        name = name.name
    if not isinstance(name, str):
        raise TypeError(
            f"policy must be a policy name (one of {list(POLICY_NAMES)}). "
            f"Received: name={name!r} of type {type(name).__name__}"
        )
    if name not in POLICY_NAMES:
        close = difflib.get_close_matches(name, POLICY_NAMES, n=1, cutoff=0.4)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"Unknown policy name. Valid names: {', '.join(POLICY_NAMES)}.{hint} "
            f"Received: name={name!r}"
        )
    return name


def set_policy(
    name: str | keras.DTypePolicy, hardware: HardwareInfo | None = None
) -> keras.DTypePolicy:
    """Sets Keras's global dtype policy; `"auto"` picks one by hardware.

    Args:
        name: String. `"mixed_float16"`, `"mixed_bfloat16"`, `"float32"` or `"auto"`.
        hardware: `HardwareInfo`. Used by `"auto"`; detected when `None`.

    Returns:
        The `keras.DTypePolicy` now in effect.

    Raises:
        ValueError: For an unknown name (the message suggests the closest valid one).
        TypeError: For a value that is not a string.

    Warns:
        UserWarning: Once per process, for `"mixed_float16"` on a machine without a GPU or
            TPU: float16 is slow there; the warning names the faster policy for the machine
            and what `tfmixprec.cpu_float16` does about the slow kernels.

    Example:

    >>> tfmixprec.set_policy("auto").name  # what choose_policy() picks on this machine
    """
    name = check_policy_name(name)
    if name == "auto":
        name = choose_policy(hardware).name
    keras.config.set_dtype_policy(name)
    cpu_float16.route_around_fused_matmul(name)  # float16 without a GPU
    _warn_float16_without_gpu(name, hardware)
    return keras.config.dtype_policy()


def float16_without_gpu_note(hardware: HardwareInfo) -> str:
    """Why `mixed_float16` is slow on a machine without a GPU and what to do (said by
    `set_policy`'s warning and by `doctor`, whose routes line lists what `cpu_float16` does
    here): what in one sentence, the fix in one, and the docs page; under 400 characters."""
    faster = choose_policy(hardware).name
    if cpu_float16.applies("mixed_float16", hardware):
        keep = "to keep float16, train a MixedPrecisionModel, which routes around the slow kernels"
    else:
        keep = "tfmixprec's routes around them are off: tfmixprec.cpu_float16.enable()"
    return (
        "mixed_float16 without a GPU trains at best as fast as float32 (slow float16 CPU "
        f"kernels). For speed use {faster!r} (set_policy('auto') picks it); {keep}. "
        f"{docs_page('guides/float16-on-cpus')}"
    )


def _user_stacklevel() -> int:
    """The `stacklevel` that points a warning at the first caller outside this module (and
    outside `contextlib`, for `policy_scope`)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename in (__file__, contextlib.__file__):
        frame, level = frame.f_back, level + 1
    return level


def _warn_float16_without_gpu(name: str, hardware: HardwareInfo | None) -> None:
    if name != "mixed_float16" or _WARNED["float16_without_gpu"]:
        return
    hardware = detect_hardware() if hardware is None else hardware
    if hardware.gpus or hardware.tpus:
        return
    _WARNED["float16_without_gpu"] = True
    warnings.warn(float16_without_gpu_note(hardware), UserWarning, stacklevel=_user_stacklevel())


@contextlib.contextmanager
def policy_scope(name: str, hardware: HardwareInfo | None = None) -> Iterator[Any]:
    """Sets the global policy inside a `with` block and restores the previous one on exit
    (a global policy that was never set is left unset again, as Keras had it).

    Args:
        name: String. As for `set_policy`.
        hardware: `HardwareInfo`. Used by `"auto"`.

    Yields:
        The `keras.DTypePolicy` in effect inside the block.

    Example:

    >>> with tfmixprec.policy_scope("mixed_bfloat16"):
    ...     model = build_model()
    """
    check_policy_name(name)  # fail before touching the global policy
    previous = global_policy()  # None while unset: reading it through Keras would set it
    try:
        yield set_policy(name, hardware)
    finally:
        restore_global_policy(previous)


@functools.cache
def _known_activations() -> dict[Any, str]:
    """The softmax-like functions by what they are, not their `__name__`: TensorFlow's
    `tf.nn.softmax` is named `softmax_v2`, `tf.math.sigmoid` `sigmoid`, Keras's ops their own."""
    import tensorflow as tf

    known = {}
    for name in FLOAT32_ACTIVATIONS:
        for module in (keras.activations, keras.ops, tf.nn, tf.math):
            function = getattr(module, name, None)
            if callable(function):
                known[function] = name
    return known


def _activation_name(layer: Any) -> str | None:
    """The name of a layer's activation function: a softmax-like function by identity
    (`_known_activations`), any other by its `__name__`."""
    activation = getattr(layer, "activation", None)
    if activation is None or not callable(activation):
        return None
    try:
        known = _known_activations().get(activation)
    except TypeError:  # an unhashable callable object
        known = None
    return known or getattr(activation, "__name__", None)


def float32_reason(layer: Any) -> str | None:
    """Why `layer` must compute in float32 on its own account (softmax-like), or None."""
    if isinstance(layer, keras.layers.Softmax):
        return "Softmax layer"
    name = _activation_name(layer)
    if name in FLOAT32_ACTIVATIONS:
        return f"{name} activation"
    return None


def float32_outputs(model: keras.Model, softmax: bool = False) -> list[PolicyChange]:
    """Makes the layers that produce float16/bfloat16 model outputs compute in float32, and
    with `softmax=True` every standalone softmax layer of the model too.

    The loss sees the model's outputs: a softmax (or any output) in float16 saturates and
    loses the small probabilities whose log the loss takes. Which outputs are float16 or
    bfloat16 is read from one real call of the model on a batch of zeros, not from the
    layers' policies (KerasHub's causal LMs return float32 logits from a float16 layer:
    nothing to change there).

    A softmax inside the model is left alone by default, as measured
    (`benchmarks/RESULTS.md`, section 7): its consumers compute in float16/bfloat16 anyway;
    through a float16 softmax an attention output is at most 1.3 float16 epsilons from
    float64 (0.6 through a float32 softmax) and the score gradient 2.8 (0.6), and a GPT-2
    trained with its attention softmax in float16 or in float32 reached the same loss to 4
    digits (5.3193 and 5.3191 after 30 steps; the policy, not the softmax, moves it 0.9% from
    float32). `softmax=True` still gives PyTorch autocast's rule, every softmax in float32,
    to the layers that are a softmax by themselves: each `keras.layers.Softmax` and each
    `Activation("softmax")` / `Activation("log_softmax")` among the model's layers (nested
    models' included). A softmax inside another layer is not one: `MultiHeadAttention`'s own
    `Softmax` stays in the attention's dtype, since its product with the values must share
    it, and so does a `Dense(activation="softmax")`, whose matmul would turn float32 too.

    Works on built Sequential, functional and subclassed models, nested ones included. No
    weight value changes (mixed policies already store variables in float32); a second call
    changes nothing.

    Args:
        model: `keras.Model`. A built model.
        softmax: Bool. Also make every standalone softmax layer compute in float32.

    Returns:
        List of `PolicyChange(layer, old, new, why)`, one per changed layer.

    Raises:
        TypeError: If `model` is not a `keras.Model` or `softmax` is not a bool.
        ValueError: If the model is not built, or is a subclassed model that cannot be called
            on a batch of zeros (before or after the change: a model whose call fails with
            its softmax layers in float32 is put back as it was).

    Example:

    >>> tfmixprec.set_policy("mixed_float16")
    >>> probs = keras.layers.Dense(3, "softmax", name="probs")
    >>> model = keras.Sequential([keras.Input((4,)), probs])
    >>> [c.layer for c in tfmixprec.float32_outputs(model)]
    ['probs']
    """
    check_built_model(model, "float32_outputs")
    if not isinstance(softmax, bool):
        raise TypeError(f"softmax must be a bool. Received: softmax={softmax!r}")
    # Decide everything first, then change: nothing is half-changed on error.
    before = observe(model)
    changes = _float32_changes(before.outputs)
    if softmax:
        changes = _with_softmax_layers(model, changes)
    if not changes:
        return []
    previous = [(layer, layer.dtype_policy) for layer, _ in changes]
    recorded = compute_in_float32(model, [layer for layer, _ in changes])
    try:
        after = observe(model)  # the model must still run
        if after.error and not before.error:
            raise ValueError(after.error)
    except ValueError as err:
        compute_in_float32(model, [layer for layer, _ in previous], dict(previous).get)
        raise ValueError(
            f"Model {model.name!r} fails to call with these layers in float32, so they are "
            f"back as they were: {', '.join(change.layer for _, change in changes)} "
            f"({_cause(err)}). Received: softmax={softmax!r}"
        ) from err
    _warn_if_still_low(model, after)
    if not recorded:
        _warn_if_not_saved(model, [change for _, change in changes])
    return [change for _, change in changes]


def _cause(err: Exception) -> str:
    """The error under `err` (what the model's call raised), on one line, without colors."""
    cause = err.__cause__ or err
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", str(cause)).split())
    return f"{type(cause).__name__}: {text}"


def standalone_softmax_layers(model: keras.Model) -> list[Any]:
    """The layers of `model` (and of the models nested in it, not of other layers) that are a
    softmax by themselves: `keras.layers.Softmax`, `Activation("softmax"/"log_softmax")`."""
    found = []
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            found += standalone_softmax_layers(layer)
        elif isinstance(layer, keras.layers.Softmax) or (
            isinstance(layer, keras.layers.Activation)
            and _activation_name(layer) in ("softmax", "log_softmax")
        ):
            found.append(layer)
    return found


def _with_softmax_layers(
    model: keras.Model, changes: list[tuple[Any, PolicyChange]]
) -> list[tuple[Any, PolicyChange]]:
    """`changes` and a change for each standalone softmax layer in float16/bfloat16."""
    seen = {id(layer) for layer, _ in changes}
    for layer in standalone_softmax_layers(model):
        policy = layer.dtype_policy
        if id(layer) not in seen and policy.compute_dtype in LOW_PRECISION:
            seen.add(id(layer))
            why = f"{float32_reason(layer)} (softmax=True)"
            changes.append((layer, PolicyChange(layer.name, policy.name, "float32", why)))
    return changes


def compute_in_float32(
    model: keras.Model, layers: Sequence[Any], policy_of: Callable[[Any], Any] | None = None
) -> bool:
    """Makes each of `layers` compute in float32 (`policy_of(layer)`: the float32 policy to
    give it, `float32` when None) and drops `model`'s traced functions (a `fit` in progress
    retraces with `model.make_train_function(force=True)`). Returns whether the model's saved
    config records the change (False: a reloaded model computes them in the policy's dtype
    again; a KerasHub task's config holds its constructor's arguments). A layer that took a
    CPU route around a float16 or bfloat16 kernel takes it no more (the class's method)."""
    before = _saved_config(model)
    for layer in layers:
        unroute(layer)
        layer.dtype_policy = keras.DTypePolicy("float32") if policy_of is None else policy_of(layer)
    forget_traced_functions(model)
    return before is None or _saved_config(model) != before


def _float32_changes(outputs: Sequence[Any]) -> list[tuple[Any, PolicyChange]]:
    """For each model output in float16/bfloat16: the layer that computed it and the layers
    nested in it, and the pass-through layers that carried it out (see `_observe`), each with
    the `PolicyChange` that makes it compute in float32 (layers already in float32 left out)."""
    changes: dict[int, tuple[Any, PolicyChange]] = {}

    def change(layer: Any, why: str) -> None:
        if id(layer) not in changes and layer.dtype_policy.compute_dtype in LOW_PRECISION:
            changes[id(layer)] = (
                layer,
                PolicyChange(layer.name, layer.dtype_policy.name, "float32", why),
            )

    for output in outputs:
        if output.layer is None or output.dtype not in LOW_PRECISION:
            continue
        reason = float32_reason(output.layer)
        change(
            output.layer,
            f"produces a model output in {output.dtype}" + (f"; {reason}" if reason else ""),
        )
        for part in iter_layers(output.layer):  # a layer of layers computes with them
            change(part, f"inside {output.layer.name!r}, which produces a model output")
        for layer in output.through:
            change(layer, f"passes on the model output {output.layer.name!r} produces")
    return list(changes.values())


def _warn_if_still_low(model: keras.Model, observed: Observation) -> None:
    """Warns of model outputs still in float16/bfloat16 after the change (`observed`: a call
    after it): made by an operation no layer's dtype controls."""
    left = [out.dtype for out in observed.outputs if out.dtype in LOW_PRECISION]
    if left:
        warnings.warn(
            f"float32_outputs left {len(left)} output(s) of model {model.name!r} in {left[0]}: "
            "an operation outside the layers it changed makes them (raw tensor arithmetic "
            "in a call, say). Cast them in the model's call: keras.ops.cast(output, "
            f"'float32'). {docs_page('guides/audit-in-ci')}",
            UserWarning,
            stacklevel=3,
        )


def _saved_config(model: keras.Model) -> Any:
    """What `model.save` writes of the model's structure (None if it cannot say)."""
    try:
        return keras.saving.serialize_keras_object(model)
    except Exception:  # a model without a config: nothing to compare
        return None


def _warn_if_not_saved(model: keras.Model, changes: list[PolicyChange]) -> None:
    """Warns that the model's config does not record the change: a saved and loaded model
    (a KerasHub task, whose config holds its constructor's arguments only) computes those
    outputs in float16/bfloat16 again."""
    names = ", ".join(repr(change.layer) for change in changes)
    warnings.warn(
        f"float32_outputs changed {names} of model {model.name!r}, but its config does not "
        "record layer dtypes, so a saved and reloaded model computes them in the policy's "
        "dtype again. Call tfmixprec.float32_outputs(model) again after loading, or build the "
        "model with a float32 head if its class takes one (KerasHub's image classifiers: "
        f"head_dtype='float32'). {docs_page('guides/audit-in-ci')}",
        UserWarning,
        stacklevel=3,
    )
