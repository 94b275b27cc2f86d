"""The module paths of tfmixprec 0.4.0, which kept every module in one folder, still work:
`import tfmixprec.loss_scale`, `from tfmixprec.cpu_float16 import status`,
`tfmixprec.overflow_batches.current_keeper(...)`. Each old path is the module that now holds
its code; a module that was split (`float8`, `gradient_range`, `_keras_compat`) is one module
object with the names of the modules it became. `tests/test_moved.py` checks every path and
every name that 0.4.0's modules listed in their `__all__`.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__all__: list[str] = []  # private module: nothing here is part of the package's API

# 0.4.0's module -> the module(s) its code lives in now.
MOVED: dict[str, tuple[str, ...]] = {
    "_adoption": ("fit.adoption",),
    "_arrays": ("_common.arrays",),
    "_cadence": ("_common.cadence",),
    "_cpu_route": ("precision.cpu_route",),
    "_dtypes": ("_common.dtypes",),
    "_fit_hooks": ("fit.hooks",),
    "_fit_reader": ("fit.reader",),
    "_keras_compat": (
        "_keras.fit",
        "_keras.float8",
        "_keras.graph",
        "_keras.kernels",
        "_keras.optimizer_hooks",
        "_keras.saving",
    ),
    "_layers": ("_common.layers",),
    "_model_file": ("checks.model_file",),
    "_observe": ("_common.observe",),
    "_state_file": ("scaling.state_file",),
    "_text": ("_common.text",),
    "_validate": ("_common.validate",),
    "accumulation": ("scaling.accumulation",),
    "attribution": ("scaling.attribution",),
    "audit": ("checks.audit",),
    "bench": ("tools.bench",),
    "calibration": ("replay.calibration",),
    "callbacks": ("fit.callbacks",),
    "cli": ("tools.cli",),
    "cpu_bfloat16": ("precision.cpu_bfloat16",),
    "cpu_float16": ("precision.cpu_float16",),
    "datasets": ("tools.datasets",),
    "diagnosis": ("replay.diagnosis", "fit.overflow_batches"),
    "doctor": ("checks.doctor",),
    "float8": ("precision.float8", "precision.float8_recipe", "fit.float8_monitor"),
    "gradient_range": ("scaling.gradient_range", "fit.gradient_monitor"),
    "hardware": ("precision.hardware",),
    "loss_scale": ("scaling.loss_scale",),
    "optimizer": ("scaling.optimizer",),
    "overflow_batches": ("fit.overflow_batches",),
    "policy": ("precision.policy",),
    "repair": ("fit.repair",),
    "state_guard": ("scaling.state_guard",),
    "tensorboard": ("fit.tensorboard", "fit.layout"),
    "testing": ("tools.testing",),
    "training": ("fit.training",),
    "unscaling": ("scaling.unscaling",),
    "zoo": ("tools.zoo",),
}


def _merged(old: str, modules: list[Any]) -> types.ModuleType:
    """One module object with the names of `modules` (the first one's win), and their
    `__all__`s together: an old path whose code was split."""
    merged = types.ModuleType(f"tfmixprec.{old}", modules[0].__doc__)
    listed: list[str] = []
    for module in reversed(modules):
        merged.__dict__.update(
            {k: v for k, v in vars(module).items() if not (k.startswith("__") and k.endswith("__"))}
        )
    for module in modules:
        listed += [n for n in getattr(module, "__all__", []) if n not in listed]
    merged.__all__ = listed
    return merged


def install(package: types.ModuleType) -> None:
    """Makes each old path importable (`sys.modules`) and, where the package has no public name
    of its own there (`tfmixprec.audit` is the function), an attribute of the package."""
    for old, news in MOVED.items():
        modules = [importlib.import_module(f"tfmixprec.{new}") for new in news]
        module = modules[0] if len(modules) == 1 else _merged(old, modules)
        sys.modules[f"tfmixprec.{old}"] = module
        if not hasattr(package, old):
            setattr(package, old, module)
