"""The patch registry (`tfmixprec._keras.patches`): every change tfmixprec makes to a layer's or
model's attributes is a patch with a handle; undone in any order, the object is always what
its remaining patches make it, and once all are undone it is exactly as it was."""

import itertools
import random

import keras
import numpy as np
import pytest

import tfmixprec
from tfmixprec._common.layers import iter_layers, watch_leaf_calls
from tfmixprec._keras.patches import patch, patches_of, undo_all
from tfmixprec.fit.adoption import adopt_when_set
from tfmixprec.fit.overflow_batches import OverflowBatches, set_keeper
from tfmixprec.precision import cpu_float16, float8
from tfmixprec.precision.hardware import HardwareInfo


class Thing:
    def call(self, x):
        return ["class", x]


def _replace(name):
    return lambda _: lambda x: [name, x]


def _wrap(name):
    return lambda own: lambda x: [name, *own(x)]


MAKERS = {"A": _replace("A"), "B": _wrap("B"), "C": _wrap("C"), "D": _replace("D")}


def _expected(thing_call, remaining):
    """What `call(1)` gives with the patches `remaining` (in the order made) over `thing_call`."""
    call = thing_call
    for name in remaining:
        call = MAKERS[name](call)
    return call(1)


@pytest.mark.parametrize("order", list(itertools.permutations("ABCD")))
@pytest.mark.parametrize("own", [False, True])
def test_undone_in_any_order_the_object_is_what_its_remaining_patches_make(order, own):
    thing = Thing()
    if own:  # an instance attribute of its own, set before any patch: kept and given back
        mine = lambda x: ["own", x]  # noqa: E731
        thing.call = mine
    before = dict(vars(thing))
    base = thing.call
    handles = {name: patch(thing, "call", f"maker {name}", MAKERS[name]) for name in "ABCD"}
    assert thing.call(1) == ["D", 1]  # D replaces what is below it
    remaining = list("ABCD")
    for name in order:
        handles[name].undo()
        remaining.remove(name)
        assert thing.call(1) == _expected(base, remaining), (order, remaining)
        assert [p.who for p in patches_of(thing)] == [f"maker {n}" for n in remaining]
    assert vars(thing) == before  # no marker left, the own attribute the same object
    if own:
        assert vars(thing)["call"] is mine


def test_a_handle_undoes_once_and_works_as_a_with_block():
    thing = Thing()
    with patch(thing, "call", "outer", _wrap("outer")) as outer:
        inner = patch(thing, "call", "inner", _wrap("inner"))
        assert thing.call(1) == ["inner", "outer", "class", 1]
        assert repr(outer) == "<Patch 'call' by 'outer', active>"
    assert thing.call(1) == ["inner", "class", 1]
    outer.undo()  # a second time: nothing
    assert repr(outer) == "<Patch 'call' by 'outer', undone>"
    assert undo_all(thing, who="inner") == 1 and inner.active is False
    assert vars(thing) == {}


# The attributes tfmixprec patches on layers and models (float8's counters add one), and the
# registry's own.
PATCHED = (
    "call",
    "quantized_call",
    "_float8_call",
    "activation",
    "train_step",
    "_tfmixprec_float8_counts",
)


def _patched_state(obj):
    own = vars(obj)
    return {name: own[name] for name in (*PATCHED, "_tfmixprec_patches") if name in own}


def _model():
    inputs = keras.Input((32,))
    h = keras.layers.Dense(32, activation="relu", name="first")(inputs)
    h = keras.layers.Dense(32, activation="relu", name="middle")(h)
    h = keras.layers.Dense(32, name="hidden")(h)
    outputs = keras.layers.Dense(4, name="out", dtype="float32")(h)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("order", ["made", "newest first", "shuffled"])
def test_every_patcher_of_tfmixprec_undone_leaves_the_model_as_it_was(order):
    """A CPU route, float8's counters, the state guard and the overflow keeper on the step, and
    a replay's call watchers, all at once; their handles undone in `order`."""
    tfmixprec.set_policy("mixed_float16")
    model = _model()
    model.get_layer("middle").quantize("float8")
    objects = [model, *iter_layers(model)]
    before = {id(obj): _patched_state(obj) for obj in objects}
    routed = cpu_float16.fast_float16_layers(model, HardwareInfo())
    assert "first" in routed
    assert float8.watch_float8(model) == [model.get_layer("middle").path]
    model.compile(optimizer=tfmixprec.LossScaleOptimizer(keras.optimizers.SGD()), loss="mse")
    adopt_when_set(model, "test")  # the state guard on the step
    set_keeper(model, OverflowBatches(2))  # the keeper over it
    calls = []
    with watch_leaf_calls(model, lambda layer, args, result: calls.append(layer.name)):
        model(np.ones((2, 32), "float32"))
        assert calls == ["first", "middle", "hidden", "out"]
        handles = [h for obj in objects for h in patches_of(obj)]
        whos = sorted({h.who for h in handles})
        assert whos == [
            "cpu route float32 product",
            "float8 counters",
            "overflow keeper",
            "state guard",
            "watch_leaf_calls",
        ], whos
        if order == "newest first":
            handles.reverse()
        elif order == "shuffled":
            random.Random(0).shuffle(handles)
        for handle in handles:
            handle.undo()
    after = {id(obj): _patched_state(obj) for obj in objects}
    assert after == before
    assert all(not patches_of(obj) for obj in objects)
    calls.clear()
    model(np.ones((2, 32), "float32"))  # the classes' own calls: nothing watches
    assert calls == []


def test_a_value_written_from_outside_wins_and_retires_the_patches_it_replaced():
    thing = Thing()
    below = patch(thing, "call", "below", _wrap("below"))
    above = patch(thing, "call", "above", _wrap("above"))
    mine = lambda x: ["mine", x]  # noqa: E731
    thing.call = mine  # the user's own, written over both patches
    assert patches_of(thing) == []  # seen: the patches it replaced are retired
    assert not below.active and not above.active
    above.undo()  # nothing left to undo: the user's value stays
    assert thing.call is mine
    with patch(thing, "call", "later", _wrap("later")):
        assert thing.call(1) == ["later", "mine", 1]
    assert vars(thing) == {"call": mine}


def test_a_make_that_raises_changes_nothing():
    thing = Thing()

    def broken(_):
        raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="no"):
        patch(thing, "call", "broken", broken)
    assert vars(thing) == {}


def test_patches_of_lists_in_the_order_made_across_attributes():
    thing = Thing()
    thing.other = 1
    patch(thing, "call", "first", _wrap("first"))
    patch(thing, "other", "second", lambda value: value + 1)
    patch(thing, "call", "third", _wrap("third"))
    assert [p.who for p in patches_of(thing)] == ["first", "second", "third"]
    assert undo_all(thing) == 3 and vars(thing) == {"other": 1}


def _chain(step):
    names = []
    while step is not None:
        names.append(getattr(step, "__name__", repr(step)))
        step = getattr(step, "__wrapped__", None)
    return names


def test_a_train_step_the_user_sets_between_fits_is_kept_and_guarded_once():
    """A review found the user's step dropped, and the class's step guarded twice, when the
    overflow keeper was taken off after a fit with `diagnose=`."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")

    def fit(callbacks):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=callbacks)

    fit([tfmixprec.LossScaleMonitor(diagnose=1)])
    calls = []

    def my_step(data):
        calls.append(1)
        return keras.Model.train_step(model, data)

    model.train_step = my_step
    fit([tfmixprec.LossScaleMonitor(diagnose=1)])
    assert _chain(model.train_step) == ["guarded", "my_step"] and calls
    calls.clear()
    model.make_train_function(force=True)
    fit([])
    assert calls  # the user's step, still
