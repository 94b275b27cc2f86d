"""Writes an optimizer's state as tfmixprec releases saved it (tests/scaling/test_state_file.py),
each release's `tfmixprec` (checked out of git history) imported in turn in this one process:
every module of the one before is dropped from `sys.modules` and its Keras registrations
with it, so each release saves with its own classes. For accumulation_steps 1 and 3: a small
model trained 6 steps with an overflow, saved as `<out>/acc<N>.keras` and `<out>/acc<N>-ckpt`
(tf.train.Checkpoint), and the optimizer's variables in order as `<out>/acc<N>.json` (name,
value).

    python tests/workers/legacy_state_worker.py --release /tmp/v0.2/code /tmp/v0.2 ...
"""

import argparse
import importlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def model_and_optimizer(accumulation: int, module=None):
    """The model and optimizer every release builds (also the test's, with today's code)."""
    module = importlib.import_module("tfmixprec") if module is None else module
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(4)(inputs)))
    kwargs = {"accumulation_steps": accumulation} if accumulation > 1 else {}
    opt = module.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0**10, **kwargs)
    return model, opt


def _release(code: str):
    """The `tfmixprec` package in folder `code`, none of another release's modules left."""
    for name in [n for n in sys.modules if n == "tfmixprec" or n.startswith("tfmixprec.")]:
        del sys.modules[name]
    keras.backend.clear_session()  # layer names counted from 0, as in a process of its own
    custom = keras.saving.get_custom_objects()  # the live registry
    for name in [n for n in custom if n.startswith("tfmixprec>")]:
        del custom[name]
    sys.path.insert(0, code)
    try:
        module = importlib.import_module("tfmixprec")
    finally:
        sys.path.remove(code)
    assert module.__file__.startswith(code), (module.__file__, code)
    return module


def write(module, out: str) -> None:
    for accumulation in (1, 3):
        model, opt = model_and_optimizer(accumulation, module)
        model.compile(optimizer=opt, loss="mse")
        x = np.random.default_rng(0).normal(size=(20, 3)).astype("float32")
        x[4, 0] = np.inf  # step 1 overflows
        model.fit(x, np.ones((20, 2), "float32"), batch_size=4, shuffle=False, verbose=0)
        prefix = os.path.join(out, f"acc{accumulation}")
        model.save(prefix + ".keras")
        tf.train.Checkpoint(model=model, optimizer=opt).write(prefix + "-ckpt")
        values = [(v.path.split("/")[-1], np.asarray(v.numpy()).tolist()) for v in opt.variables]
        with open(prefix + ".json", "w") as f:
            json.dump({"version": module.__version__, "variables": values}, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--release", nargs=2, action="append", required=True, metavar=("CODE", "OUT")
    )
    for code, out in parser.parse_args().release:
        write(_release(code), out)


if __name__ == "__main__":
    main()
