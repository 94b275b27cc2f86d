"""What the tfmixprec callbacks copy from the device to the host each step of a `fit`: at most
one read a step beyond Keras's own logs, shared by every callback armed, and none on a step
where nothing is due (issue 47, item 1)."""

import contextlib
import sys
import tempfile
import warnings

import keras
import numpy as np
import pytest
from tensorflow.python.framework import ops as tf_ops

import tfmixprec
from tfmixprec.fit.reader import shared_read

STEPS = 6  # one epoch: the reads of steps 0-4 are counted (step 5's end is the epoch's)


class Reads:
    """Counts the device-to-host copies the callbacks make while it is on: every `_numpy` of an
    eager tensor (`.numpy()`, `float()`, `int()`, `np.asarray`, a variable's value) made
    inside a callback hook (Keras's `CallbackList`), except those Keras makes of its own logs
    (`pythonify_logs`) and those of the summaries `keras.callbacks.TensorBoard` writes itself
    (`tfmixprec.TensorBoard` is one). Keras's loop reads one value of its own a step (whether
    the iterator had data), outside the hooks. `np.asarray` of an eager tensor reads through
    the buffer protocol, which this count does not see: the callbacks' reads of state go
    through `.numpy()` (a due `GradientRangeMonitor` copies its gradients with `np.asarray`:
    it is not due in these fits)."""

    def __init__(self):
        self.count = 0
        self._numpy = tf_ops._EagerTensorBase._numpy

    def __enter__(self):
        original = self._numpy

        def counted(tensor):
            frame, hook = sys._getframe(1), False
            while frame is not None:
                if frame.f_code.co_name in _NOT_COUNTED or _kerass_board(frame):
                    return original(tensor)
                hook = hook or frame.f_code.co_filename.endswith("callback_list.py")
                frame = frame.f_back
            self.count += hook
            return original(tensor)

        tf_ops._EagerTensorBase._numpy = counted
        return self

    def __exit__(self, *exc):
        tf_ops._EagerTensorBase._numpy = self._numpy


# Keras's own logs, and a summary's `record_if` predicate (a constant on the host).
_NOT_COUNTED = ("pythonify_logs", "smart_constant_value")


def _kerass_board(frame):
    name = frame.f_code.co_filename
    return name.endswith("tensorboard.py") and "keras" in name and "tfmixprec" not in name


class PerStep(keras.callbacks.Callback):
    """First in the list: the reads between one step's start and the next's (its end, every
    callback's `on_train_batch_end`)."""

    def __init__(self, reads):
        super().__init__()
        self.reads, self.marks = reads, []

    def on_train_batch_begin(self, batch, logs=None):
        self.marks.append(self.reads.count)

    def per_step(self):
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def _model(kind, strategy=None):
    keras.utils.set_random_seed(0)
    cls = tfmixprec.MixedPrecisionModel if kind == "mixed_precision_model" else keras.Model
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with tfmixprec.policy_scope("mixed_float16"), scope:
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(8, name="hidden")(inputs)
        outputs = keras.layers.Dense(1, name="out", dtype="float32")(hidden)
        model = cls(inputs, outputs)
        # A scale under which no step overflows (at 2^15 the first one does).
        if kind == "mixed_precision_model":
            optimizer = tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(0.01), 128.0)
        else:  # Keras's own LossScaleOptimizer, adopted by the callbacks
            optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), 128.0)
        model.compile(optimizer, "mse")
    return model


def _callbacks(name, log_dir):
    x = np.ones((4, 4), "float32")
    made = {
        "LossScaleMonitor": lambda: [tfmixprec.LossScaleMonitor(update_freq=1)],
        "LossScaleMonitor(diagnose=3)": lambda: [tfmixprec.LossScaleMonitor(diagnose=3)],
        "OverflowGuard": lambda: [tfmixprec.OverflowGuard()],
        "TensorBoard": lambda: [tfmixprec.TensorBoard(log_dir, update_freq=1)],
        "PrecisionRepair": lambda: [tfmixprec.PrecisionRepair()],
        "GradientRangeMonitor": lambda: [tfmixprec.GradientRangeMonitor((x, x[:, :1]), 100)],
        "nothing due": lambda: [
            tfmixprec.LossScaleMonitor(update_freq=100),
            tfmixprec.OverflowGuard(update_freq=100),
            tfmixprec.TensorBoard(log_dir, update_freq=100),
        ],
    }
    if name == "all":
        return [c for key in made if key != "nothing due" for c in made[key]()]
    return made[name]()


CASES = (
    "LossScaleMonitor",
    "LossScaleMonitor(diagnose=3)",
    "OverflowGuard",
    "TensorBoard",
    "PrecisionRepair",
    "GradientRangeMonitor",
    "nothing due",
    "all",
)


def reads_per_step(kind, name, jit_compile=False, strategy=None, epochs=1):
    """The reads of each clean step but the last, with the callbacks of `name` (a step's
    reads end at the next step's start: an epoch's end and the next one's start are its
    last step's)."""
    model = _model(kind, strategy)
    model.jit_compile = jit_compile
    x, y = np.ones((STEPS * 4, 4), "float32"), np.ones((STEPS * 4, 1), "float32")
    with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        callbacks = _callbacks(name, log_dir)
        with Reads() as reads:
            watch = PerStep(reads)
            model.fit(x, y, batch_size=4, epochs=epochs, verbose=0, callbacks=[watch, *callbacks])
    return watch.per_step()


def test_the_count_sees_a_read():
    """The count is not blind: one `.numpy()` in a callback is one read, each step; Keras's own
    logs are not counted."""

    class OneRead(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.optimizer.iterations.numpy()

    model = _model("keras")
    x, y = np.ones((16, 4), "float32"), np.ones((16, 1), "float32")
    with Reads() as reads:
        watch = PerStep(reads)
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[watch])
        plain = watch.per_step()
        watch = PerStep(reads)
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[watch, OneRead()])
    assert plain == [0, 0, 0]
    assert watch.per_step() == [1, 1, 1]


# Reads a step before issue 47 -> now, on both kinds of model: LossScaleMonitor
# (update_freq=1) 12 -> 1, OverflowGuard 12 -> 1, TensorBoard (update_freq=1) 11 -> 1, all of
# them together 37 -> 1; PrecisionRepair and diagnose=3 1 -> 1 (keras.Model), 1 -> 0
# (MixedPrecisionModel, whose step logs the overflow total).
@pytest.mark.parametrize("kind", ["keras", "mixed_precision_model"])
@pytest.mark.parametrize("name", CASES)
def test_at_most_one_read_a_step(kind, name):
    expected = 0 if name in ("nothing due", "GradientRangeMonitor") else 1
    if kind == "mixed_precision_model" and name in (
        "PrecisionRepair",
        "LossScaleMonitor(diagnose=3)",
    ):
        expected = 0  # the step's logs hold the overflow total: no overflow, nothing to read
    assert reads_per_step(kind, name) == [expected] * (STEPS - 1)


@pytest.mark.parametrize("kind", ["keras", "mixed_precision_model"])
def test_all_together_under_xla(kind):
    assert reads_per_step(kind, "all", jit_compile=True) == [1] * (STEPS - 1)


@pytest.mark.parametrize("kind", ["keras", "mixed_precision_model"])
def test_an_epochs_end_and_start_read_nothing_more(kind):
    """The epoch's end and the next one's start (epoch logs, the epoch's overflows, the
    reports) use the last step's read."""
    assert reads_per_step(kind, "all", epochs=2) == [1] * (2 * STEPS - 1)


def test_all_together_under_two_replicas(two_cpu_strategy):
    assert reads_per_step("keras", "all", strategy=two_cpu_strategy) == [1] * (STEPS - 1)


def test_the_shared_read_is_the_optimizers_state():
    """The packed read holds what `read_state()` reads, value for value and type for type."""
    model = _model("mixed_precision_model")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    model.fit(x, y, batch_size=4, verbose=0)
    optimizer = model.optimizer
    optimizer.overflow_steps.assign(3)
    optimizer.last_overflow_iteration.assign(1)
    optimizer.loss_scale.assign(2.0**-3)
    read = shared_read(model).state(optimizer, None, None)
    expected = optimizer.read_state()
    assert {k: read[k] for k in expected} == expected
    assert [type(read[k]) for k in expected] == [type(v) for v in expected.values()]
    assert (read["step"], read["last_overflow_step"], read["loss_scale"]) == (5, 3, 0.125)
    assert read["last_overflow_scale"] == float(optimizer.last_overflow_scale.numpy())
