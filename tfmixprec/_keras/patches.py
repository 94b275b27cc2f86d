"""Every change tfmixprec makes to a layer's or a model's behaviour on the instance: an
attribute (a method, `activation`, `train_step`) replaced on that object alone, recorded with
who made it, and undone by the handle it returns.

Why one registry: several parts of tfmixprec replace the same attributes. A CPU route
replaces a layer's `call`, the call watcher of a replay wraps whatever `call` the layer has,
float8's counters replace the float8 forward (`_float8_call`, or `quantized_call` on Keras
3.16), add their variables and, for one call, replace `activation`, and the overflow
keeper and the state guard both wrap a model's `train_step`. Each used to save and restore
what it found, so it had to know what the others might have set, and undoing them out of
order put back a replacement that was already gone. Here each attribute keeps a stack:
what the instance had of its own before the first patch (or nothing: the class's), then each
patch in the order made. A patch is made by `make(current)`, given the value below it (a
watcher wraps the routed call, a keeper wraps the guarded step). Undoing one, in any order,
takes it out and makes the patches above it again over what is below, so the object is always
what its remaining patches make it; once every patch is undone it is exactly as its class (and
its own attributes) made it, with no marker left (`tests/_keras/test_patches.py`).

A value written to a patched attribute from outside the registry (a user's own `train_step`
set after tfmixprec wrapped the step) wins: the next patch or undo on that attribute finds the
top patch's value gone, takes the written value as the object's own and retires the patches
it replaced (their handles then do nothing), so it is never thrown away or wrapped twice.

Patches are Python-side: they take effect when the object is next called (a `tf.function`
traced before keeps what it traced, and its owner retraces). Making and undoing hold one lock;
reading the attribute does not take it, so a patcher that patches during a call serializes
its calls itself (`watch_float8_call` does).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

__all__: list[str] = []  # private module: nothing here is part of the package's API

_STACKS = "_tfmixprec_patches"  # on a patched object: {attribute: _Stack}, while any is made
_ABSENT = object()  # the object had no attribute of its own: the class's shows through
_LOCK = threading.RLock()
_ORDER = itertools.count()  # the order patches are made in, across attributes


class Patch:
    """The handle of one patch: `undo()` (or the end of a `with` block) takes it out.

    Attributes:
        target: The object patched.
        attribute: String. The attribute replaced.
        who: String. What made it (`"cpu route float32 product"`, `"overflow keeper"`, ...).
        active: Bool. False once undone, or retired by a value written from outside.
    """

    def __init__(self, target: Any, attribute: str, who: str, make: Callable[[Any], Any]):
        self.target, self.attribute, self.who, self.make = target, attribute, who, make
        self.active = True
        self.value: Any = None  # what it made, last
        self.order = next(_ORDER)

    def undo(self) -> None:
        """Takes this patch out (once; again does nothing). The patches made after it on the
        same attribute are made again over what is left below them."""
        with _LOCK:
            if not self.active:
                return
            stack = vars(self.target)[_STACKS][self.attribute]
            if stack.retired_by_outside_write(self.target):
                return  # a value written from outside replaced this patch already
            self.active = False
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
            patch.value = patch.make(getattr(target, self.attribute, None))
            self.put(target, patch.value)
        if not self.patches:
            self.drop(target)

    def drop(self, target: Any) -> None:
        stacks = vars(target)[_STACKS]
        del stacks[self.attribute]
        if not stacks:
            vars(target).pop(_STACKS)

    def retired_by_outside_write(self, target: Any) -> bool:
        """Whether a value was written to the attribute from outside the registry since the
        top patch: then that value is the object's own, and every patch here is retired."""
        if vars(target).get(self.attribute, _ABSENT) is self.patches[-1].value:
            return False
        for patch in self.patches:
            patch.active = False
        self.drop(target)
        return True


def patch(
    target: Any, attribute: str, who: str, make: Callable[[Any], Any], raw: bool = False
) -> Patch:
    """Replaces `target.<attribute>` with `make(current)` on this object alone.

    Args:
        target: The layer or model (any object with a `__dict__`).
        attribute: String. The attribute to replace.
        who: String. What makes the patch (reported by `patches_of`).
        make: Callable `(current value) -> new value` (current: None where the object has
            no such attribute, so a patch may add one, as float8's counters do); called again
            when a patch below this one is undone, with the new value below.
        raw: Bool. Set with `object.__setattr__` (past Keras's attribute tracking), for
            attributes Keras reads privately (`_float8_call`, `activation` during a call) and
            attributes Keras must not track (float8's counter variables).

    Returns:
        `Patch`, the handle that undoes it.
    """
    with _LOCK:
        stack = vars(target).get(_STACKS, {}).get(attribute)
        if stack is not None and stack.retired_by_outside_write(target):
            stack = None
        handle = Patch(target, attribute, who, make)
        handle.value = make(getattr(target, attribute, None))  # may raise: nothing changed yet
        if stack is None:
            stack = vars(target).setdefault(_STACKS, {})[attribute] = _Stack(target, attribute, raw)
        stack.put(target, handle.value)
        stack.patches.append(handle)
        return handle


def patches_of(target: Any, attribute: str | None = None, who: str | None = None) -> list[Patch]:
    """The patches in effect on `target` (on `attribute`, made by `who`, when given), in the
    order they were made."""
    with _LOCK:
        stacks = vars(target).get(_STACKS, {})
        for stack in list(stacks.values()):
            stack.retired_by_outside_write(target)
        found = [p for stack in stacks.values() for p in stack.patches]
    return sorted(
        (
            p
            for p in found
            if (attribute is None or p.attribute == attribute) and (who is None or p.who == who)
        ),
        key=lambda p: p.order,
    )


def undo_all(target: Any, attribute: str | None = None, who: str | None = None) -> int:
    """Undoes the patches `patches_of` finds, newest first; returns how many."""
    found = patches_of(target, attribute, who)
    for handle in reversed(found):
        handle.undo()
    return len(found)
