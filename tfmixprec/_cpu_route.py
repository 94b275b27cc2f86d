"""Routing one layer's computation around slow CPU kernels: the mechanism `cpu_float16` and
`cpu_bfloat16` share (which layers, and the measured reasons, are theirs).

A route replaces a method on the layer instance only: the class, the layer's config, its
saved file and every other model are untouched. A layer takes one route, once.
"""

from __future__ import annotations

import types
from typing import Any

from tfmixprec.hardware import HardwareInfo, detect_hardware

__all__: list[str] = []  # private module: nothing here is part of the package's API

_ROUTE = "_tfmixprec_cpu_route"  # on a routed layer instance: the route's name
_REPLACED = "_tfmixprec_cpu_route_replaces"  # and the method it replaced


def cpu_only(hardware: HardwareInfo | None) -> bool:
    """True on a machine without a GPU or TPU (`hardware` detected when `None`)."""
    hardware = detect_hardware() if hardware is None else hardware
    return not hardware.gpus and not hardware.tpus


def route_of(layer: Any) -> str | None:
    """The name of the route `layer` takes, or None."""
    return getattr(layer, _ROUTE, None)


def route(layer: Any, name: str, attribute: str, method: Any) -> None:
    """Makes `layer.<attribute>` call `method(layer, ...)`, unless the layer already takes a
    route."""
    if route_of(layer) is None:
        setattr(layer, attribute, types.MethodType(method, layer))
        setattr(layer, _ROUTE, name)
        setattr(layer, _REPLACED, attribute)


def unroute(layer: Any) -> str | None:
    """Takes `layer` off its route (the class's method again); returns the route's name, or
    None when it took none. For a layer whose computation changes kind (`float8_layers`)."""
    name = route_of(layer)
    if name is not None:
        for attribute in (vars(layer).pop(_REPLACED), _ROUTE):
            vars(layer).pop(attribute, None)
    return name
