"""Routing one layer's computation around slow CPU kernels: the mechanism `cpu_float16` and
`cpu_bfloat16` share (which layers, and the measured reasons, are theirs).

A route replaces a method on the layer instance only: the class, the layer's config, its
saved file and every other model are untouched. A layer takes one route, once.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tfmixprec._keras.patches import Patch, patch, patches_of
from tfmixprec.precision.hardware import HardwareInfo, detect_hardware

__all__: list[str] = []  # private module: nothing here is part of the package's API

_WHO = "cpu route "  # a route's patch is made by "cpu route <its name>" (`_keras.patches`)


@dataclasses.dataclass(frozen=True)
class Route:
    """One way around a slow float16 or bfloat16 computation on CPUs (the tables
    `cpu_float16.ROUTES` and `cpu_bfloat16.ROUTES`).

    Attributes:
        name: String. What the route does, as `doctor` and `audit` print it.
        why: String. The measured reason, in one sentence.
        method: Callable `method(layer) -> (attribute, replacement) or None`: what it
            replaces on a layer it serves.
        helps: Callable `helps(hardware) -> bool`: the CPUs it was measured to help on.
    """

    name: str
    why: str
    method: Callable[[Any], tuple[str, Any] | None]
    helps: Callable[[HardwareInfo], bool]


def cpu_only(hardware: HardwareInfo | None) -> bool:
    """True on a machine without a GPU or TPU (`hardware` detected when `None`)."""
    hardware = detect_hardware() if hardware is None else hardware
    return not hardware.gpus and not hardware.tpus


def served(layers: Iterable[Any], dtype: str, routes: Sequence[Route]) -> list[tuple[Any, Route]]:
    """Each of `layers` that computes in `dtype` and is not quantized, with the first of
    `routes` that serves it (a layer takes one route); layers no route serves are left out."""
    found = []
    for layer in layers:
        if layer.compute_dtype != dtype or getattr(layer, "quantization_mode", None):
            continue
        taken = next((r for r in routes if r.method(layer) is not None), None)
        if taken is not None and not _own_method(layer, taken.method(layer)[0]):
            found.append((layer, taken))
    return found


def _own_method(layer: Any, attribute: str) -> bool:
    """Whether `layer` holds its own `attribute` on the instance (a user's `layer.call = ...`),
    not one a tfmixprec patch made: a route re-implements the class's method, so such a layer
    keeps its own, as a subclass that overrides it does."""
    if attribute not in vars(layer):
        return False
    return not any(p.attribute == attribute and p.active for p in patches_of(layer))


def _route_patches(layer: Any) -> list[Patch]:
    return [p for p in patches_of(layer) if p.who.startswith(_WHO)]


def route_of(layer: Any) -> str | None:
    """The name of the route `layer` takes, or None."""
    found = _route_patches(layer)
    return found[0].who[len(_WHO) :] if found else None


def route(layer: Any, name: str, attribute: str, method: Any) -> None:
    """Makes `layer.<attribute>` call `method(layer, ...)`, unless the layer already takes a
    route (a patch of `tfmixprec._keras.patches`)."""
    if route_of(layer) is None:
        patch(layer, attribute, _WHO + name, lambda _: types.MethodType(method, layer))


def unroute(layer: Any) -> str | None:
    """Takes `layer` off its route (the class's method again); returns the route's name, or
    None when it took none. For a layer whose computation changes kind (`float8_layers`)."""
    name = route_of(layer)
    for handle in _route_patches(layer):
        handle.undo()
    return name
