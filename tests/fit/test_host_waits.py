"""What a `fit` step makes the host wait for (`tfmixprec.testing.host_waits`): tfmixprec adds
none to Keras's own count, without XLA and with it (benchmarks/host_waits.py holds the cases;
benchmarks/RESULTS.md, the table)."""

import functools
import importlib.util
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec.tools.testing import HostWait, host_waits

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_waits.py"
_spec = importlib.util.spec_from_file_location("host_waits_cases", SCRIPT)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

APPLY_OR_SKIP = "applies the step or skips it (the finite check)"
# Each (case, jit_compile) is fitted and walked once a process: the table test below prints,
# through the benchmark's own `main`, what the first test found for "keras".
_waits = functools.cache(cases.waits)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_tfmixprec_adds_no_host_wait_to_kerass_step(jit_compile):
    keras_waits = _waits("keras", jit_compile)
    for case in ("adopted", "MixedPrecisionModel"):  # every callback, the keepers armed
        found = _waits(case, jit_compile)
        assert len(found) <= len(keras_waits), (case, found, keras_waits)
        if jit_compile:  # one XLA cluster: its conditionals stay on the device
            assert found == ()
        else:  # the one conditional Keras's optimizer has too: apply or skip
            assert [(w.op, w.kind, w.purpose) for w in found] == [
                ("If", "conditional", APPLY_OR_SKIP)
            ], case
    if jit_compile:
        assert keras_waits == ()
    else:
        assert keras_waits[0].purpose == APPLY_OR_SKIP  # found by the optimizer's update


def test_under_two_replicas_too(two_cpu_strategy):
    """Keras's step under MirroredStrategy has its conditionals in cross-replica context;
    tfmixprec's has its one there (no XLA: with MirroredStrategy over logical CPUs it fails
    inside TensorFlow itself)."""
    if not cases._STRATEGIES:
        cases._STRATEGIES.append(two_cpu_strategy)  # one strategy on these devices a process
    keras_waits = cases.waits("keras, 2 replicas", False)
    found = cases.waits("adopted, 2 replicas", False)
    assert len(found) < len(keras_waits)
    assert [(w.op, w.purpose) for w in found] == [("If", APPLY_OR_SKIP)]


def test_a_host_wait_is_found_where_one_is_added():
    """The walk is not blind: a `py_function` or a `cond` on a value added to the step shows,
    with what it is; a `cond` decided by shapes alone, or inside an XLA-compiled step, is not
    listed."""
    seen = []

    class Watched(keras.Model):
        def train_step(self, data):
            logs = super().train_step(data)
            tf.py_function(lambda: seen.append(1), [], Tout=[])
            tf.cond(logs["loss"] > 1e9, lambda: tf.constant(1.0), lambda: tf.constant(0.0))
            rows = tf.shape(data[0])[0]  # known on the host without the device
            tf.cond(rows > 2, lambda: tf.constant(1.0), lambda: tf.constant(0.0))
            return logs

    def build(jit_compile):
        inputs = keras.Input((4,))
        model = Watched(inputs, keras.layers.Dense(1)(inputs))
        model.compile("sgd", "mse", jit_compile=jit_compile)
        return model

    x, y = np.zeros((8, 4), "float32"), np.zeros((8, 1), "float32")
    model = build(False)
    model.fit(x, y, batch_size=4, verbose=0)
    found = host_waits(model)
    assert [(w.op, w.kind) for w in found] == [
        ("EagerPyFunc", "py_function"),
        ("StatelessIf", "conditional"),  # its branches only compute
    ]
    assert found[0].purpose == "copies values to the host (a Python function)"
    assert isinstance(found[1], HostWait) and found[1].where.endswith("cond")
    compiled = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    compiled.compile("sgd", "mse", jit_compile=True)
    compiled.train_step = lambda data: {
        **keras.Sequential.train_step(compiled, data),
        "flag": tf.cond(tf.constant(True), lambda: 1.0, lambda: 0.0),
    }
    compiled.fit(x, y, batch_size=4, verbose=0)
    assert host_waits(compiled) == ()


def test_host_waits_needs_a_traced_step():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)], name="fresh")
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="model 'fresh' has no traced train function: call fit"):
        host_waits(model)
    eager = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)], name="eager")
    eager.compile("sgd", "mse", run_eagerly=True)
    eager.fit(np.zeros((4, 4)), np.zeros((4, 1)), verbose=0)
    with pytest.raises(ValueError, match="model 'eager' has no traced"):
        host_waits(eager)
    assert tfmixprec.testing.HostWait is HostWait


def test_the_benchmark_prints_its_table(capsys, monkeypatch):
    monkeypatch.setattr(cases, "waits", _waits)
    found = cases.main(["--cases", "keras"])
    printed = capsys.readouterr().out.splitlines()
    assert "| case | jit_compile | host waits | what each decides |" in printed
    rows = [line for line in printed if line.startswith("| keras |")]
    assert rows[0].startswith(f"| keras | False | {len(found[('keras', False)])} | `If` applies")
    assert rows[1] == "| keras | True | 0 | - |"
