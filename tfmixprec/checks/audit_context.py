"""What the audit's checks read besides a layer or the model (`AuditContext`): the policy audited,
the layers that follow the model's own policy, one observed call under that policy, and the
machine; gathered once per audit (`gather_context`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import keras

from tfmixprec._common.layers import (
    check_built_model,
    is_container,
    iter_layers,
)
from tfmixprec._common.observe import (
    Observation,
    observe,
    policies_swapped,
    unobserved,
)
from tfmixprec.precision.hardware import HardwareInfo, detect_hardware
from tfmixprec.precision.policy import (
    LOW_PRECISION,
    check_policy_name,
    choose_policy,
)

__all__: list[str] = []


@dataclasses.dataclass(frozen=True)
class AuditContext:
    """What a check reads besides its layer or model.

    Args:
        model_policy: String. The name of the model's own policy.
        policy: String or None. The policy audited instead of the model's own (`audit`'s
            `policy=`), or None.
        layers: Tuple of layers. The model's layers, nested ones included, no `InputLayer`.
        observation: `Observation`. One call of the model on zeros under the audited policy:
            its outputs' dtypes and each leaf call's (`tfmixprec._common.observe.observe`).
        hardware: `HardwareInfo` or None. The machine for machine findings; None when auditing
            under another policy (no machine findings then).
        followers: Frozenset of ints. The `id()`s of the policy objects that follow the
            model's own policy (a layer built with `dtype=` has a policy object of its own).
        no_gpu: Bool. The findings are for a machine without a GPU or TPU: this one, for the
            model as it is or under the policy recommended for it (`float32-model`).
    """

    model_policy: str
    policy: str | None
    layers: tuple[Any, ...]
    observation: Observation
    hardware: HardwareInfo | None
    followers: frozenset[int] = frozenset()
    no_gpu: bool = False

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

    def outputs_of(self, layer: Any) -> list[Any]:
        """The model outputs (`ModelOutput`) that `layer` computed, in any dtype."""
        return [out for out in self.observation.outputs if out.layer is layer]

    def low_precision_outputs(self, layer: Any) -> list[Any]:
        """The model outputs (`ModelOutput`) that `layer` computed and a real call returns in
        float16/bfloat16."""
        return [
            out
            for out in self.observation.outputs
            if out.layer is layer and out.dtype in LOW_PRECISION
        ]


def policy_followers(model: keras.Model, layers: Sequence[Any]) -> frozenset[int]:
    """The `id()`s of the policy objects that follow the model's own policy.

    A layer built without `dtype=` holds the very policy object that was global when it was
    built, the model's own; one built with `dtype=` holds an object of its own. Where no layer
    holds the model's object, the object most layers share does (layers built in a
    `policy_scope` and a model made after it); where none is shared (a model loaded by
    `keras.models.load_model`: every layer gets its own), layers whose policy has the model's
    policy's name count as following it.
    """
    own = model.dtype_policy
    if any(layer.dtype_policy is own for layer in layers):
        return frozenset([id(own)])
    shared = collections.Counter(id(layer.dtype_policy) for layer in layers).most_common(1)
    if shared and shared[0][1] > 1:
        return frozenset([shared[0][0]])
    return frozenset(id(lyr.dtype_policy) for lyr in layers if lyr.dtype_policy.name == own.name)


def observe_as_audited(
    model: keras.Model,
    layers: Sequence[Any],
    policy: str | None,
    followers: frozenset[int],
    skipped: str | None = None,
) -> Observation:
    """`observe(model)`, with the layers that follow the model's own policy computing in
    `policy` for the call (their own policies back after it); no call where `skipped` says
    why not. Where the call cannot run, the outputs' symbolic dtypes are those of the model as
    built: the outputs of layers that follow it are taken to be in `policy`'s compute dtype."""
    swapped = [layer for layer in [model, *layers] if id(layer.dtype_policy) in followers]
    if skipped is not None:
        observation = unobserved(model, skipped)
    elif policy is None:
        return observe(model)
    else:
        with policies_swapped(swapped, policy):
            observation = observe(model)
    if observation.error is None or policy is None:
        return observation
    follow = {id(layer) for layer in swapped}
    compute = keras.DTypePolicy(policy).compute_dtype
    outputs = tuple(
        dataclasses.replace(out, dtype=compute) if id(out.layer) in follow else out
        for out in observation.outputs
    )
    return dataclasses.replace(observation, outputs=outputs)


def gather_context(
    model: keras.Model,
    policy: str | None,
    hardware: HardwareInfo | None,
    followers: frozenset[int] | None = None,
    skipped: str | None = None,
) -> AuditContext:
    """Checks `audit`'s arguments and gathers what the checks read (`followers`: see
    `policy_followers`; a saved model's are read from its file; `skipped`: why not to call the
    model, for a file past `DECLARED_BUDGET`)."""
    if policy is not None:
        policy = check_policy_name(policy)
        if policy == "auto":
            policy = choose_policy(hardware).name
    check_built_model(model, "audit")
    machine = None
    if policy is None:  # the model as it is, on this machine
        machine = detect_hardware() if hardware is None else hardware
    layers = [lyr for lyr in iter_layers(model) if not isinstance(lyr, keras.layers.InputLayer)]
    followers = policy_followers(model, layers) if followers is None else followers
    observation = observe_as_audited(model, layers, policy, followers, skipped)
    return AuditContext(
        model_policy=model.dtype_policy.name,
        policy=policy,
        layers=tuple(layers),
        observation=observation,
        hardware=machine,
        followers=followers,
        no_gpu=machine is not None and not (machine.gpus or machine.tpus),
    )
