"""What one `fit` step makes the host wait for: Keras's own LossScaleOptimizer against tfmixprec.

Each case trains the same small float16 model (a `Dense`, a `BatchNormalization`, a float32
output) for one epoch, then walks the train function Keras traced
(`tfmixprec.testing.host_waits`): the ops outside XLA clusters that need a device value on
the host (a conditional's or a loop's predicate, a Python function, a host-side check, an op
whose output size depends on its values), each with what it decides. On a CPU such a wait
costs nothing; on a GPU the step stalls until the value is computed. With `jit_compile=True`
the step is one XLA cluster and its conditionals stay on the device.

    python benchmarks/host_waits.py               # the table, XLA off and on
    python benchmarks/host_waits.py --cases keras adopted
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import contextlib  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmixprec  # noqa: E402
from tfmixprec.tools.testing import host_waits  # noqa: E402

try:  # two logical CPUs: a real 2-replica MirroredStrategy (before TensorFlow starts)
    _cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )
except RuntimeError:  # started already (the tests configure the same)
    pass

X = np.random.default_rng(0).normal(size=(64, 16)).astype("float32")
Y = np.zeros((64, 1), "float32")


def _model(cls=keras.Model, optimizer=None, strategy=None, **compile_args):
    keras.utils.set_random_seed(0)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with tfmixprec.policy_scope("mixed_float16"), warnings.catch_warnings(), scope:
        warnings.simplefilter("ignore")  # float16 without a GPU: said elsewhere
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(16, name="dense")(inputs)
        hidden = keras.layers.BatchNormalization(name="norm")(hidden)
        hidden = keras.layers.Dense(16, name="proj")(hidden)
        outputs = keras.layers.Dense(1, name="out", dtype="float32")(hidden)
        model = cls(inputs, outputs)
        if optimizer is None:  # Keras's own LossScaleOptimizer, as compile gives it
            optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
        model.compile(optimizer, "mse", **compile_args)
    return model


_STRATEGIES: list[tf.distribute.Strategy] = []


def _two_replicas() -> tf.distribute.Strategy:
    """One MirroredStrategy of 2 logical CPUs for the process (a second one on the same
    devices mixes up their collectives' keys)."""
    if not _STRATEGIES:
        devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
        _STRATEGIES.append(tf.distribute.MirroredStrategy(devices))
    return _STRATEGIES[0]


def every_callback(log_dir: str) -> list[keras.callbacks.Callback]:
    """Every tfmixprec callback, the batch keepers armed (`diagnose=`, `PrecisionRepair`)."""
    return [
        tfmixprec.LossScaleMonitor(diagnose=1),
        tfmixprec.OverflowGuard(),
        tfmixprec.GradientRangeMonitor((X[:8], Y[:8]), update_freq=1),
        tfmixprec.TensorBoard(log_dir, update_freq=1, diagnose=1),
        tfmixprec.PrecisionRepair(verbose=0),
    ]


def _float8(jit_compile: bool) -> keras.Model:
    model = _model(tfmixprec.MixedPrecisionModel, "adam", jit_compile=jit_compile)
    tfmixprec.float8_layers(model)  # `proj`: the one that follows the recipe
    return model


# name: (what it is, model builder taking jit_compile, whether tfmixprec's callbacks run)
CASES = {
    "keras": (
        "keras.Model + Keras's LossScaleOptimizer, plain fit (the baseline)",
        lambda jit: _model(jit_compile=jit),
        False,
    ),
    "adopted": (
        "the same model + every tfmixprec callback (Keras's optimizer adopted, the state "
        "guard, diagnose=, PrecisionRepair armed)",
        lambda jit: _model(jit_compile=jit),
        True,
    ),
    "MixedPrecisionModel": (
        "tfmixprec.MixedPrecisionModel + every tfmixprec callback",
        lambda jit: _model(tfmixprec.MixedPrecisionModel, "adam", jit_compile=jit),
        True,
    ),
    "accumulation": (
        "MixedPrecisionModel, accumulation_steps=2",
        lambda jit: _model(
            tfmixprec.MixedPrecisionModel, "adam", accumulation_steps=2, jit_compile=jit
        ),
        False,
    ),
    "float8": (
        "MixedPrecisionModel with a float8 layer + Float8Monitor",
        _float8,
        False,
    ),
    "keras, 2 replicas": (
        "the baseline under a MirroredStrategy of 2 replicas",
        lambda jit: _model(strategy=_two_replicas(), jit_compile=jit),
        False,
    ),
    "adopted, 2 replicas": (
        "adopted, every callback, under a MirroredStrategy of 2 replicas",
        lambda jit: _model(strategy=_two_replicas(), jit_compile=jit),
        True,
    ),
}
# XLA with MirroredStrategy over logical CPUs fails inside TensorFlow itself (even in float32).
NO_XLA = ("keras, 2 replicas", "adopted, 2 replicas")


def waits(case: str, jit_compile: bool) -> tuple:
    """The host waits of one case's traced step (`tfmixprec.testing.HostWait`s)."""
    _, build, callbacks = CASES[case]
    model = build(jit_compile)
    with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # adoption and min-scale lines: said elsewhere
        extra = every_callback(log_dir) if callbacks else []
        if case == "float8":
            extra = [tfmixprec.Float8Monitor(update_freq=1)]
        model.fit(X, Y, batch_size=32, epochs=1, verbose=0, callbacks=extra)
        return host_waits(model)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args(argv)
    print(f"tensorflow {tf.__version__}, keras {keras.__version__}")
    print("| case | jit_compile | host waits | what each decides |")
    print("|---|---|---|---|")
    found = {}
    for jit in (False, True):
        for case in args.cases:
            if jit and case in NO_XLA:
                print(f"| {case} | {jit} | - | XLA with MirroredStrategy fails on CPUs |")
                continue
            listed = waits(case, jit)
            found[(case, jit)] = listed
            what = "; ".join(f"`{w.op}` {w.purpose}" for w in listed) or "-"
            print(f"| {case} | {jit} | {len(listed)} | {what} |")
    print()
    for case in args.cases:
        print(f"{case}: {CASES[case][0]}")
    return found


if __name__ == "__main__":
    main()
