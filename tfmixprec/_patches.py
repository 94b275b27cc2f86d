"""Every change tfmixprec makes to a layer's or a model's behaviour on the instance: an
attribute (a method, `activation`, `train_step`) replaced on that object alone, recorded with
who made it, and undone by the handle it returns.

Why one registry: several parts of tfmixprec replace the same attributes. A CPU route
replaces a layer's `call`, the call watcher of a replay wraps whatever `call` the layer has,
float8's counters replace `_float8_call` and, for one call, `activation`, and the overflow
keeper and the state guard both wrap a model's `train_step`. Each used to save and restore
what it found, so it had to know what the others might have set, and undoing them out of
order put back a replacement that was already gone. Here each attribute keeps a stack:
what the instance had of its own before the first patch (or nothing: the class's), then each
patch in the order made. A patch is made by `make(current)`, given the value below it (a
watcher wraps the routed call, a keeper wraps the guarded step). Undoing one, in any order,
takes it out and makes the patches above it again over what is below, so the object is always
what its remaining patches make it; once every patch is undone it is exactly as its class (and
its own attributes) made it, with no marker left (`tests/test_patches.py`).

Patches are Python-side: they take effect when the object is next called (a `tf.function`
traced before keeps what it traced, and its owner retraces). Making and undoing hold one lock,
so replica threads tracing at once see whole stacks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__: list[str] = []  # private module: nothing here is part of the package's API

_STACKS = "_tfmixprec_patches"  # on a patched object: {attribute: _Stack}, while any is made
_ABSENT = object()  # the object had no attribute of its own: the class's shows through
_LOCK = threading.RLock()


class Patch:
    """The handle of one patch: `undo()` (or the end of a `with` block) takes it out.

    Attributes:
        target: The object patched.
        attribute: String. The attribute replaced.
        who: String. What made it (`"cpu_float16 route"`, `"overflow keeper"`, ...).
    """

    def __init__(self, target: Any, attribute: str, who: str, make: Callable[[Any], Any]):
        self.target, self.attribute, self.who, self.make = target, attribute, who, make
        self.active = True

    def undo(self) -> None:
        """Takes this patch out (once; again does nothing). The patches made after it on the
        same attribute are made again over what is left below them."""
        with _LOCK:
            if not self.active:
                return
            self.active = False
            stack = vars(self.target)[_STACKS][self.attribute]
            stack.patches.remove(self)
            stack.rebuild(self.target)

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return f"<Patch {self.attribute!r} by {self.who!r}, {state}>"


class _Stack:
    """One attribute's patches over what the object had of its own."""

    def __init__(self, target: Any, attribute: str, raw: bool) -> None:
        self.attribute, self.raw = attribute, raw
        self.own = vars(target).get(attribute, _ABSENT)
        self.patches: list[Patch] = []

    def put(self, target: Any, value: Any) -> None:
        if value is _ABSENT:
            vars(target).pop(self.attribute, None)  # the class's again (nothing to untrack)
        elif self.raw:
            object.__setattr__(target, self.attribute, value)
        else:
            setattr(target, self.attribute, value)

    def rebuild(self, target: Any) -> None:
        """The attribute made again from its own value up, through the patches left."""
        self.put(target, self.own)
        for patch in self.patches:
            self.put(target, patch.make(getattr(target, self.attribute)))
        if not self.patches:
            stacks = vars(target)[_STACKS]
            del stacks[self.attribute]
            if not stacks:
                vars(target).pop(_STACKS)


def patch(
    target: Any, attribute: str, who: str, make: Callable[[Any], Any], raw: bool = False
) -> Patch:
    """Replaces `target.<attribute>` with `make(current)` on this object alone.

    Args:
        target: The layer or model (any object with a `__dict__`).
        attribute: String. The attribute to replace.
        who: String. What makes the patch (reported by `patches_of`).
        make: Callable `(current value) -> new value`; called again when a patch below this
            one is undone, with the new value below.
        raw: Bool. Set with `object.__setattr__` (past Keras's attribute tracking), for
            attributes Keras reads privately (`_float8_call`, `activation` during a call).

    Returns:
        `Patch`, the handle that undoes it.
    """
    with _LOCK:
        stacks = vars(target).setdefault(_STACKS, {})
        stack = stacks.get(attribute)
        if stack is None:
            stack = stacks[attribute] = _Stack(target, attribute, raw)
        handle = Patch(target, attribute, who, make)
        stack.put(target, make(getattr(target, attribute)))
        stack.patches.append(handle)
        return handle


def patches_of(target: Any, attribute: str | None = None, who: str | None = None) -> list[Patch]:
    """The patches in effect on `target` (on `attribute`, made by `who`, when given), in the
    order they were made."""
    with _LOCK:
        stacks = vars(target).get(_STACKS, {})
        found = [p for name, stack in stacks.items() for p in stack.patches]
    return [
        p
        for p in found
        if (attribute is None or p.attribute == attribute) and (who is None or p.who == who)
    ]


def undo_all(target: Any, attribute: str | None = None, who: str | None = None) -> int:
    """Undoes the patches `patches_of` finds, newest first; returns how many."""
    found = patches_of(target, attribute, who)
    for handle in reversed(found):
        handle.undo()
    return len(found)
