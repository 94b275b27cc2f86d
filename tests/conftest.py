"""Shared test setup: quiet TensorFlow, two logical CPU devices, a clean global policy."""

import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from live_tensorboard import start_tensorboard, stop  # noqa: E402

# Two logical CPUs give a real 2-replica MirroredStrategy. This must run before TensorFlow
# initializes its devices, so it happens at import time of the test session.
_cpus = tf.config.list_physical_devices("CPU")
try:
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )
except RuntimeError:  # devices already initialized by an earlier import
    pass


@pytest.fixture(autouse=True)
def _restore_global_policy():
    """Every test starts and ends with the float32 global policy."""
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture
def fit_left_early():
    """For a test whose plain `keras.Model` leaves a `fit` before the end of an epoch (a
    callback stops it or raises): Keras's epoch iterator and its epoch's generator hold each
    other (`tests/fit/test_fit_iterators.py`), with the fit's `tf.data` iterator, until a full
    collection, which may come minutes later in another test; freeing an autotuned iterator
    that old took 20-50 s there. Collected at the end of the test that made the cycle, where
    freeing the iterator is quick. (`MixedPrecisionModel.fit` closes the generator itself.)

    What was alive before the test is frozen meanwhile (`gc.freeze`: out of every collection),
    so the collection at the end scans only what the test made: a full collection of a
    process that ran hundreds of tests took about 2 s each time."""
    gc.freeze()
    try:
        yield
    finally:
        gc.collect()  # the test's own objects: the frozen ones are not scanned
        gc.unfreeze()  # back into the oldest generation


@pytest.fixture(scope="session")
def two_cpu_strategy():
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    if len(devices) < 2:
        pytest.fail(f"expected 2 logical CPU devices, found {devices}")
    return tf.distribute.MirroredStrategy(devices)


@pytest.fixture
def tensorboard_server():
    """A real `tensorboard` process on 127.0.0.1: call it with a log folder, get its port once
    it serves a run with the mixed_precision tags; stopped after the test."""
    servers = []
    yield lambda log_dir: start_tensorboard(log_dir, servers)
    stop(servers)


# The files whose tests take longest in all (summed over a `-n 2` run), longest first.
# `--dist loadfile` hands each pytest process one file at a time, by default the files with the
# most tests first, which left the slow files of few tests (benchmarks, examples) to the end
# of one process while the other had nothing left to run (in one run of 660 s, the two ended
# about a minute apart). The longest run first and the short files fill in at the end. Only
# the order changes.
LONGEST_FIRST = (
    "tests/fit/test_training.py",
    "tests/test_docs.py",
    "tests/tools/test_benchmarks.py",
    "tests/tools/test_benchmarks_zoo.py",
    "tests/fit/test_traces.py",
    "tests/fit/test_repair.py",
    "tests/tools/test_zoo_encoders.py",
    "tests/tools/test_cli.py",
    "tests/fit/test_multi_worker.py",
    "tests/test_examples.py",
    "tests/tools/test_zoo_decoders.py",
    "tests/checks/test_audit.py",
    "tests/scaling/test_scale_read_once.py",
    "tests/precision/test_float8.py",
    "tests/fit/test_overflow_batches.py",
    "tests/replay/test_diagnosis.py",
)


def pytest_configure(config):
    """Under `--dist loadfile`, pytest-xdist takes the files in the order they were collected
    (`pytest_collection_modifyitems` below), not by their number of tests."""
    if getattr(config.option, "dist", None) == "loadfile":
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The files of `LONGEST_FIRST` first, in its order, then the others by their number of
    tests, most first (pytest-xdist's own order); each file's tests in their own order."""
    files = [item.nodeid.split("::", 1)[0] for item in items]
    count = {name: files.count(name) for name in set(files)}

    def rank(name):
        if name in LONGEST_FIRST:
            return (LONGEST_FIRST.index(name), 0, name)
        return (len(LONGEST_FIRST), -count[name], name)

    order = {name: rank(name) for name in count}
    position = {id(item): (order[name], i) for i, (item, name) in enumerate(zip(items, files))}
    items.sort(key=lambda item: position[id(item)])
