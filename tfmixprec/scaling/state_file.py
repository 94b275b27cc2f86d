"""The optimizer's state in a saved file: by name, with a format version.

Private: `LossScaleOptimizer.save_own_variables` / `load_own_variables` (a `.keras` file, a
`.weights.h5`, `BackupAndRestore`) call `save` and `load`. Keras's own optimizers save their
variables by position; a tfmixprec release that added a state variable shifted the rest, and
a file from one release was read into the wrong variables of the next. So tfmixprec's own
state is saved under its names, next to `FORMAT_KEY`, and the inner optimizer's variables
(Keras's, whose layout tfmixprec does not change) by position under `inner_<i>`.

The state kept per trained variable (the overflow counts, the accumulated gradients) follows
the variables' paths, saved under `PATHS_KEY` (format 2): a model loaded from a file may list
its variables in another order than the one that saved it (Keras's float8 layers create
their scale variables before the kernel when they are rebuilt), and each entry goes back to
the variable it belongs to.

A file from tfmixprec 0.1 to 0.3 holds the state by position. It is read through the layout
of the release that wrote it, recognized by the number, order and shapes of its arrays: it
loads exactly (variables that release did not have start fresh), or it is refused with an
error that says why; a value is never assigned to another variable. Nothing is assigned
before everything is checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__: list[str] = []  # private module: nothing here is part of the package's API

FORMAT = 2  # 1: the first by-name layout (tfmixprec 0.4); 2: with the variables' paths
FORMAT_KEY = "tfmixprec_state_format"
PATHS_KEY = "tfmixprec_variable_paths"  # the trained variables' paths, in the state's order
_PER_VARIABLE = ("nonfinite_steps", "last_nonfinite_step")  # one entry a trained variable
INNER = "inner_"

# The optimizer's own variables by position in the releases before FORMAT, after Keras's
# `iteration` and `learning_rate` (its base optimizer's). Per release: the scalars, the
# vectors made by `build` (one entry a trained variable), and, with gradient accumulation,
# the window's variables ("*" : one sum a trained variable, in its shape).
_COMMON = (
    "iteration",
    "learning_rate",
    "step_counter",
    "dynamic_scale",
    "hysteresis_tracker",
    "overflow_steps",
    "consecutive_overflows",
    "last_overflow_iteration",
    "min_scale_overflow_iteration",
)
LEGACY = {
    "0.1": (_COMMON, (), ("micro_step", "window_finite", "*")),
    "0.2": (
        (*_COMMON, "last_overflow_scale"),
        ("nonfinite_steps", "last_nonfinite_step"),
        ("micro_step", "window_nonfinite", "*"),
    ),
    "0.3": (
        (*_COMMON, "last_overflow_scale", "min_scale_overflows", "longest_overflow_run"),
        ("nonfinite_steps", "last_nonfinite_step"),
        ("micro_step", "window_nonfinite", "*"),
    ),
}
_SUMS = "accumulated_gradient"


# What a refusal promises: the optimizer, whole (Keras loads a model's layers before it).
NOTHING_LOADED = "No optimizer variable was assigned."


def own_state(variables: Sequence[Any]) -> list[tuple[str, Any]]:
    """`(key, variable)` for the optimizer's own variables: their names, the accumulation
    sums numbered (`accumulated_gradient_0`, ...)."""
    named, sums = [], 0
    for variable in variables:
        name = variable.name
        if name == _SUMS:
            name, sums = f"{_SUMS}_{sums}", sums + 1
        named.append((name, variable))
    return named


def save(own: Sequence[Any], inner: Sequence[Any], store: Any, trained: Sequence[Any]) -> None:
    """Writes the state by name (`own`: the optimizer's own variables; `inner`: its inner
    optimizer's; `trained`: the variables it was built with, whose paths are saved)."""
    store[FORMAT_KEY] = np.array(FORMAT)
    store[PATHS_KEY] = _encoded([v.path for v in trained])
    for key, variable in own_state(own):
        store[key] = variable.numpy()
    for i, variable in enumerate(inner):
        store[f"{INNER}{i}"] = variable.numpy()


def load(
    own: Sequence[Any], inner: Sequence[Any], store: Any, what: str, trained: Sequence[Any]
) -> None:
    """Reads a file's state into the variables (`what` names the optimizer in errors;
    `trained`: the variables it was built with)."""
    keys = list(store.keys())
    plan = None
    if FORMAT_KEY in keys:
        plan = _named_plan(own, inner, store, keys, what, [v.path for v in trained])
    if plan is None:
        plan = _legacy_plan(own, inner, store, keys, what)
    for variable, value in plan:  # everything checked: now assign
        variable.assign(value)


def _named_plan(
    own: Sequence[Any],
    inner: Sequence[Any],
    store: Any,
    keys: list[str],
    what: str,
    paths: list[str],
) -> list[tuple[Any, Any]]:
    version = int(np.asarray(store[FORMAT_KEY]))
    if version > FORMAT:
        raise ValueError(
            f"{what}: the file's optimizer state has format {version}, written by a newer "
            f"tfmixprec (this one reads up to {FORMAT}). Upgrade tfmixprec to load it."
        )
    mine = dict(own_state(own))
    theirs = {k for k in keys if k not in (FORMAT_KEY, PATHS_KEY) and not k.startswith(INNER)}
    missing, extra = sorted(set(mine) - theirs), sorted(theirs - set(mine))
    if missing or extra:
        raise ValueError(
            f"{what}: the file's optimizer state does not fit this optimizer; "
            + _difference(missing, extra)
        )
    values = {key: np.asarray(store[key]) for key in mine}
    if PATHS_KEY in keys:
        saved = _decoded(np.asarray(store[PATHS_KEY]))
        values = _follow_paths(values, saved, paths)
    plan = [(mine[key], values[key]) for key in mine]
    plan += _inner_plan(inner, [np.asarray(store[f"{INNER}{i}"]) for i in range(_count(keys))])
    _check_shapes(plan, what)
    return plan


def _encoded(paths: list[str]) -> np.ndarray:
    """`paths` as the bytes of their UTF-8 text, one a line (Keras's stores take numbers)."""
    return np.frombuffer("\n".join(paths).encode(), dtype=np.uint8).copy()


def _decoded(array: np.ndarray) -> list[str]:
    text = array.astype(np.uint8).tobytes().decode()
    return text.split("\n") if text else []


def _follow_paths(values: dict[str, Any], saved: list[str], paths: list[str]) -> dict[str, Any]:
    """`values` with the per-variable state moved from the order of the `saved` paths to the
    order of `paths` (this optimizer's variables), when both name the same variables once
    each; else as they are (the shapes are checked next)."""
    if saved == paths or sorted(saved) != sorted(paths) or len(set(paths)) != len(paths):
        return values
    position = {path: i for i, path in enumerate(saved)}
    order = [position[path] for path in paths]  # this optimizer's j-th: the file's order[j]
    moved = dict(values)
    for key in _PER_VARIABLE:
        if key in values and np.shape(values[key]) == (len(order),):
            moved[key] = np.asarray(values[key])[order]
    sums = [f"{_SUMS}_{i}" for i in range(len(order))]
    if all(key in values for key in sums):
        moved.update({key: values[sums[order[j]]] for j, key in enumerate(sums)})
    return moved


def _count(keys: list[str]) -> int:
    return sum(key.startswith(INNER) for key in keys)


def _difference(missing: list[str], extra: list[str]) -> str:
    """What a reader needs to know of a mismatch: which state is missing or extra, and why."""
    parts = []
    if any(k.startswith(_SUMS) or k == "micro_step" for k in extra):
        parts.append(
            "the file's optimizer accumulated gradients and this one does not (create it with "
            "the file's accumulation_steps)"
        )
    elif any(k.startswith(_SUMS) or k == "micro_step" for k in missing):
        parts.append(
            "this optimizer accumulates gradients and the file's did not (create it without "
            "accumulation_steps)"
        )
    parts.append(
        f"missing from the file: {missing or 'nothing'}; not in this optimizer: "
        f"{extra or 'nothing'}"
    )
    return ". ".join(parts) + f". {NOTHING_LOADED}"


def _inner_plan(inner: Sequence[Any], values: list[Any]) -> list[tuple[Any, Any]]:
    if len(values) != len(inner):
        raise ValueError(
            f"the file's inner optimizer has {len(values)} variables and this one's "
            f"{len(inner)} (another optimizer kind, or one built for other weights). "
            f"{NOTHING_LOADED}"
        )
    return list(zip(inner, values))


def _check_shapes(plan: list[tuple[Any, Any]], what: str) -> None:
    for variable, value in plan:
        if tuple(variable.shape) != tuple(np.shape(value)):
            raise ValueError(
                f"{what}: the file's {variable.name!r} has shape {np.shape(value)}, this "
                f"optimizer's {tuple(variable.shape)} (built for other weights?). "
                f"{NOTHING_LOADED}"
            )


def _legacy_plan(
    own: Sequence[Any], inner: Sequence[Any], store: Any, keys: list[str], what: str
) -> list[tuple[Any, Any]]:
    """The plan for a file from tfmixprec 0.1 to 0.3: the one release layout whose every
    array has the shape this optimizer's variable of that name has."""
    values = [np.asarray(store[str(i)]) for i in range(len(keys))]
    mine = dict(own_state(own))
    fits = []
    for release, layout in LEGACY.items():
        for with_window in (False, True):
            for built in (True, False):
                names = _legacy_names(layout, with_window, built, mine)
                plan = _match(names, values, mine, inner if built else inner[:2])
                if plan is not None and _key(plan) not in {_key(p) for _, p in fits}:
                    fits.append((release, plan))  # two readings giving one plan are one
    if len(fits) != 1:
        why = "matches no" if not fits else f"matches {len(fits)}"
        raise ValueError(
            f"{what}: the file's optimizer state ({len(values)} arrays, by position) "
            f"{why} layout of tfmixprec 0.1 to 0.3 for this optimizer (its weights, its "
            "inner optimizer and its accumulation_steps). Create the optimizer as the file's "
            f"was. {NOTHING_LOADED}"
        )
    return fits[0][1]


def _key(plan: list[tuple[Any, Any]]) -> tuple:
    """What a plan assigns: which variable gets which array (by position in the file)."""
    return tuple(id(variable) for variable, _ in plan)


def _legacy_names(layout: tuple, with_window: bool, built: bool, mine: dict) -> list[str]:
    scalars, vectors, window = layout
    names = list(scalars) + (list(vectors) if built else [])
    if with_window and built:
        sums = sorted(k for k in mine if k.startswith(_SUMS))
        names += [n for n in window if n != "*"] + (sums or ["<no sums>"])
    return names


def _match(
    names: list[str], values: list[Any], mine: dict, inner: Sequence[Any]
) -> list[tuple[Any, Any]] | None:
    """The plan if `names` then `inner` fit `values` exactly (count and shapes), else None."""
    if len(names) + len(inner) != len(values):
        return None
    plan = []
    for name, value in zip(names, values):
        if name == "window_finite":  # 0.1: one flag for the window; now one per variable
            target = mine.get("window_nonfinite")
            if target is None or np.shape(value) != ():
                return None
            value = np.full(tuple(target.shape), 1 - int(value), np.asarray(target.numpy()).dtype)
        else:
            target = mine.get(name)
        if target is None or tuple(target.shape) != tuple(np.shape(value)):
            return None
        plan.append((target, value))
    for variable, value in zip(inner, values[len(names) :]):
        if tuple(variable.shape) != tuple(np.shape(value)):
            return None
        plan.append((variable, value))
    return plan
