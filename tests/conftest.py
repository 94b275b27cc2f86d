"""Shared test setup: quiet TensorFlow, two logical CPU devices, a clean global policy."""

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
