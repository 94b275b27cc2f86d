"""The batch keeper (`fit/overflow_batches.py`): one device copy of the batch a step whoever
keeps, rows in the batch's own dtype, released between fits, a kept batch read alone, and a
`diagnose=N` that a keeper filled before its `fit` does not starve (issue 47, items 2, 3, 17c
and 17d)."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from overflow_models import bad_run_model, overflowing
from overflow_models import model as overflow_model
from tensorflow.python.framework import ops as tf_ops

import tfmixprec
from tfmixprec._keras.fit import traced_train_functions
from tfmixprec.fit.kept_rows import scratch_row as _scratch_row

WRITES = ("Tile", "ResourceScatterNdUpdate", "ResourceScatterUpdate")


def _writes(graph, seen=None):
    """The ops of a traced step (and the functions it calls) that copy rows of the batch:
    `(op type, rows written)`, the rows from the static shape of what is written."""
    seen = set() if seen is None else seen
    found = []
    for op in graph.get_operations():
        if op.type in WRITES and "gradient_tape" not in op.name:
            written = op.outputs[0] if op.type == "Tile" else op.inputs[2]
            found.append((op.type, written.shape[0]))
        for attr in ("f", "then_branch", "else_branch"):
            try:
                name = op.get_attr(attr).name
            except (ValueError, AttributeError):
                continue
            outer = graph
            while outer is not None and name not in outer._functions:
                outer = getattr(outer, "outer_graph", None)
            if outer is not None and name not in seen:
                seen.add(name)
                found += _writes(outer._functions[name].graph, seen)
    return found


def _armed(kind, jit_compile, callbacks):
    if kind == "keras":  # compiled the Keras way: Keras's own LossScaleOptimizer, adopted
        with tfmixprec.policy_scope("mixed_float16"):
            model = overflow_model("norm", optimizer=keras.optimizers.SGD(1e-6))
    else:
        model = overflow_model("norm", cls=tfmixprec.MixedPrecisionModel)
    model.jit_compile = jit_compile
    x, y = overflowing(n=64, every=10**6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=32, verbose=0, callbacks=callbacks())
    return model


@pytest.mark.parametrize("kind", ["keras", "mixed_precision_model"])
@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize(
    "callbacks",
    [
        lambda: [tfmixprec.PrecisionRepair()],
        lambda: [tfmixprec.LossScaleMonitor(diagnose=1)],
        lambda: [tfmixprec.PrecisionRepair(), tfmixprec.LossScaleMonitor(diagnose=3)],
    ],
    ids=["repair", "diagnose=1", "both"],
)
def test_one_row_of_the_batch_a_step_whoever_keeps(kind, jit_compile, callbacks):
    """The batch (x and y, and the step's record) is written into one row a step, with one
    scatter: no tiled copies, however many slots (before: with PrecisionRepair, two tiled rows
    scattered into two rows, 4 batch copies a step against diagnose=1's one)."""
    model = _armed(kind, jit_compile, callbacks)
    assert _writes(traced_train_functions(model)[-1].graph) == [("ResourceScatterUpdate", 1)]


def _uint8_model():
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,), dtype="uint8")
        flag = keras.Input((1,), dtype="bool")
        hidden = keras.layers.Dense(16, name="big", kernel_initializer="ones")(
            keras.ops.cast(inputs, "float32") * 300.0
        )
        hidden = hidden * keras.ops.cast(flag, hidden.dtype)
        small = keras.initializers.Constant(1e-4)
        outputs = keras.layers.Dense(1, name="out", dtype="float32", kernel_initializer=small)(
            hidden
        )
        model = tfmixprec.MixedPrecisionModel([inputs, flag], outputs)
        model.compile(tfmixprec.LossScaleOptimizer("sgd", initial_scale=8.0), "mse")
    return model


def _uint8_data():
    x = np.random.default_rng(0).integers(0, 5, size=(32, 8)).astype("uint8")
    x[9] = 255  # batch 1: 8 x 255 x 300 = 612000 passes float16's 65504 (others: < 9601)
    flag = np.ones((32, 1), bool)
    return [x, flag], np.ones((32, 1), "float32")


@pytest.mark.parametrize("jit_compile", [False, True])
def test_narrow_integers_and_bool_are_kept_in_their_own_dtype(jit_compile):
    """A uint8 image is kept as uint8 (not float32: 4x the bytes), a bool as bool, and come
    back exactly."""
    model = _uint8_model()
    model.jit_compile = jit_compile
    (x, flag), y = _uint8_data()
    keeper = model.keep_overflow_batches(1)
    model.fit([x, flag], y, batch_size=8, shuffle=False, verbose=0)
    (kept,) = keeper.kept
    assert kept.step == 1
    (x_kept, flag_kept), y_kept, _ = kept.batch
    assert (x_kept.dtype, flag_kept.dtype) == (np.uint8, np.bool_)
    np.testing.assert_array_equal(x_kept, x[8:16])
    np.testing.assert_array_equal(flag_kept, flag[8:16])
    # Three rows (the slot, the newest overflow's, one more), each the step's record (20
    # bytes), the three tensors' shapes (2 int64 each), and the batch of 8: one byte a uint8
    # and a bool, four a float32 (each tensor's bytes a whole number of 4-byte words here).
    assert keeper.nbytes == 3 * (20 + 3 * 2 * 8 + 8 * (8 * 1 + 1 * 1 + 1 * 4))


def _odd_bytes_model():
    """Three inputs whose bytes a row are no whole number of 4-byte words: 3 uint8, 1 bool, 5
    float16 (10 bytes). A 255 in the uint8 input overflows float16 (3 x 255 x 300)."""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        image = keras.Input((3,), dtype="uint8")
        flag = keras.Input((1,), dtype="bool")
        extra = keras.Input((5,), dtype="float16")
        hidden = keras.layers.Dense(16, name="big", kernel_initializer="ones")(
            keras.ops.cast(image, "float32") * 300.0
        )
        hidden = hidden * keras.ops.cast(flag, hidden.dtype)
        hidden = hidden + 0.0 * keras.ops.sum(keras.ops.cast(extra, hidden.dtype))
        small = keras.initializers.Constant(1e-4)
        outputs = keras.layers.Dense(1, name="out", dtype="float32", kernel_initializer=small)(
            hidden
        )
        model = tfmixprec.MixedPrecisionModel([image, flag, extra], outputs)
        model.compile(tfmixprec.LossScaleOptimizer("sgd", initial_scale=8.0), "mse")
    return model


@pytest.mark.parametrize("jit_compile", [False, True])
def test_bytes_of_no_whole_word_come_back_exactly(jit_compile):
    """Tensors whose bytes are no whole number of 4-byte words (odd uint8 and bool counts, a
    float16 input), in batches of 7 whose size the step does not know, the last one ragged
    (4 rows): each kept batch comes back bit for bit, in its dtypes and shapes. Bytes that
    read as a NaN or a subnormal float32 (255s, small integers) too: the rows' words are
    moved, never computed on."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 3, size=(32, 3)).astype("uint8")
    image[9] = image[30] = 255  # batch 1 (rows 7..13) and the ragged batch 4 (rows 28..31)
    flag = rng.integers(0, 2, size=(32, 1)).astype(bool)
    flag[9] = flag[30] = True
    extra = rng.normal(size=(32, 5)).astype("float16")
    extra[0, 0] = np.float16(6e-8)  # float16's smallest subnormal, kept as its bits
    y = np.ones((32, 1), "float32")
    model = _odd_bytes_model()
    model.jit_compile = jit_compile
    keeper = model.keep_overflow_batches(5)
    data = tf.data.Dataset.from_tensor_slices(((image, flag, extra), y)).batch(7)
    model.fit(data, verbose=0)
    steps = [k.step for k in keeper.kept]
    assert {1, 4} <= set(steps) and keeper.kept[0].scale == 8.0, steps
    for kept in keeper.kept:
        rows = slice(7 * kept.step, 7 * kept.step + 7)
        (got_image, got_flag, got_extra), got_y, weight = kept.batch
        assert weight is None
        for got, want in [(got_image, image), (got_flag, flag), (got_extra, extra), (got_y, y)]:
            assert (got.dtype, got.shape) == (want.dtype, want[rows].shape)
            assert got.tobytes() == want[rows].tobytes()


def test_reading_a_kept_batch_copies_that_batch_alone():
    """`kept` copies the rows of the slot it reads, not every row of the variable."""
    model, x, y = bad_run_model(jit_compile="auto")
    keeper = model.keep_overflow_batches(3)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    copied = []
    original = tf_ops._EagerTensorBase._numpy

    def counting(tensor):
        value = original(tensor)
        copied.append(np.asarray(value).nbytes)
        return value

    tf_ops._EagerTensorBase._numpy = counting
    try:
        kept = keeper.kept
    finally:
        tf_ops._EagerTensorBase._numpy = original
    assert [k.step for k in kept] == [1, 3]
    assert max(copied) == 8 * 8 * 4  # one batch of x (8 x 8 float32), not 5 rows of it


@pytest.mark.parametrize("kind", ["keras", "mixed_precision_model"])
def test_a_dormant_keeper_holds_no_batch(kind):
    """Between fits the callbacks' keeper holds one value a row, not the largest batch seen;
    the next fit grows the rows again in its step, reuses the traced step, and repairs."""
    x, y = overflowing(n=256)
    if kind == "keras":
        with tfmixprec.policy_scope("mixed_float16"):
            model = overflow_model("flows", optimizer=keras.optimizers.SGD(1e-6))
    else:
        model = overflow_model("flows", cls=tfmixprec.MixedPrecisionModel)
    repair = tfmixprec.PrecisionRepair(verbose=0)

    class Held(keras.callbacks.Callback):
        held, traced = [], []

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                Held.traced.append(self.model.train_function)

        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                Held.held.append(vars(self.model)["_tfmixprec_overflow_batches"].nbytes)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x[:64], y[:64], batch_size=32, verbose=0, callbacks=[repair, Held()])
        keeper = vars(model)["_tfmixprec_overflow_batches"]
        assert keeper.nbytes == 2 * 4  # 2 rows of one word (4 bytes)
        model.fit(x, y, batch_size=32, shuffle=False, verbose=0, callbacks=[repair, Held()])
    assert Held.traced[1] is Held.traced[0]  # the dormant keeper's traced step, reused
    # In the second fit its batches again: the record (20 bytes), x's and y's shapes, x and y.
    assert Held.held == [2 * (20 + 2 * 2 * 8 + (32 * 8 + 32) * 4)]
    assert [r.step for r in repair.repairs] == [4]  # the 5th overflow in a row
    assert keeper.nbytes == 2 * 4


@pytest.mark.parametrize("jit_compile", [False, True])
def test_diagnose_is_not_starved_by_a_keeper_filled_before(jit_compile):
    """After keep_overflow_batches(1) filled in one fit, diagnose=3 in the next replays that
    fit's first 3 overflow steps (from the keeper's newest slot), each at its step."""
    model, x, y = bad_run_model(jit_compile="auto")
    model.jit_compile = jit_compile
    keeper = model.keep_overflow_batches(1)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert [k.step for k in keeper.kept] == [1]
    x2 = x.copy()
    x2[:, 0] = 1e6  # every batch overflows forward
    monitor = tfmixprec.LossScaleMonitor(diagnose=3)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model.fit(x2, y, batch_size=8, shuffle=False, verbose=0, callbacks=[monitor])
    assert not [w for w in said if "diagnose=" in str(w.message)]  # every one replayed
    found = [(step, d.cause, d.layer) for step, d in monitor.diagnoses]
    assert found == [(s, "forward-overflow", "big") for s in (4, 5, 6)]


def test_diagnose_says_which_overflows_a_full_keeper_could_not_give():
    """With several overflow steps in one execution past a full keeper, diagnose= replays the
    newest and says it, once."""
    model, x, y = bad_run_model(jit_compile="auto")
    model.compile(
        tfmixprec.LossScaleOptimizer("sgd", initial_scale=8.0), "mse", steps_per_execution=2
    )
    keeper = model.keep_overflow_batches(1)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    x2 = x.copy()
    x2[:, 0] = 1e6
    monitor = tfmixprec.LossScaleMonitor(diagnose=3)
    with pytest.warns(RuntimeWarning, match=r"diagnose=3 replays 1 of 2 overflow steps") as said:
        model.fit(x2, y, batch_size=8, shuffle=False, verbose=0, callbacks=[monitor])
    assert len([w for w in said if "replays 1 of 2" in str(w.message)]) == 1
    assert [step for step, _ in monitor.diagnoses] == [5, 7]
    assert len(keeper.kept) == 1


@pytest.mark.parametrize("latest", [False, True])
@pytest.mark.parametrize("limit", [0, 1, 2, 3, 4])
def test_the_scratch_row_is_never_a_kept_batchs(limit, latest):
    """Which row a step writes follows from the count of kept overflow steps alone: never a
    row a kept batch is in (the first `limit`, and the newest), and within the rows."""
    rows = limit + int(latest) + 1
    held = {}  # slot -> row
    for count in range(12):
        scratch = int(_scratch_row(np.int64(count), limit, latest))
        assert 0 <= scratch < rows
        assert scratch not in held.values(), (count, scratch, held)
        assert int(_scratch_row(np.int64(count), limit, latest, vector=True)[0]) == scratch
        if count < limit:
            held[count] = scratch
        if latest:
            held["newest"] = scratch


@pytest.mark.parametrize("jit_compile", [False, True])
def test_dormant_keeper_wakes_to_another_structure(jit_compile):
    """diagnose=3 in two fits; the second adds a sample_weight (another batch structure for the
    dormant keeper's traced step): its overflow steps are still replayed, each at its step,
    the first one too (found by a review: the woken keeper kept nothing in the step that met
    the new structure, and said nothing)."""
    model, x, y = bad_run_model(jit_compile="auto")
    model.jit_compile = jit_compile
    first = tfmixprec.LossScaleMonitor(diagnose=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[first])
    done = int(model.optimizer.iterations.numpy()) + int(model.optimizer.overflow_steps.numpy())
    x2 = x.copy()
    x2[:, 0] = 1e6  # every batch overflows forward
    w = np.linspace(0.5, 1.5, len(x)).astype("float32")
    monitor = tfmixprec.LossScaleMonitor(diagnose=3)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model.fit(
            x2, y, sample_weight=w, batch_size=8, shuffle=False, verbose=0, callbacks=[monitor]
        )
    assert not [str(m.message) for m in said if "diagnose=" in str(m.message)]
    found = [(step, d.cause, d.layer) for step, d in monitor.diagnoses]
    assert found == [(s, "forward-overflow", "big") for s in (done, done + 1, done + 2)]
