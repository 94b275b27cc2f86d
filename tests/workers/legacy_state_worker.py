"""Writes an optimizer's state as one tfmixprec release saved it (tests/scaling/test_state_file.py):
run with PYTHONPATH pointing at that release's `tfmixprec` (checked out of git history). For
accumulation_steps 1 and 3: a small model trained 6 steps with an overflow, saved as
`<out>/acc<N>.keras` and `<out>/acc<N>-ckpt` (tf.train.Checkpoint), and the optimizer's
variables in order as `<out>/acc<N>.json` (name, value).

    PYTHONPATH=/tmp/v0.2 python tests/workers/legacy_state_worker.py --out DIR
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmixprec  # noqa: E402


def model_and_optimizer(accumulation: int, module=tfmixprec):
    """The model and optimizer every release builds (also the test's, with today's code)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(4)(inputs)))
    kwargs = {"accumulation_steps": accumulation} if accumulation > 1 else {}
    opt = module.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0**10, **kwargs)
    return model, opt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    for accumulation in (1, 3):
        model, opt = model_and_optimizer(accumulation)
        model.compile(optimizer=opt, loss="mse")
        x = np.random.default_rng(0).normal(size=(20, 3)).astype("float32")
        x[4, 0] = np.inf  # step 1 overflows
        model.fit(x, np.ones((20, 2), "float32"), batch_size=4, shuffle=False, verbose=0)
        prefix = os.path.join(args.out, f"acc{accumulation}")
        model.save(prefix + ".keras")
        tf.train.Checkpoint(model=model, optimizer=opt).write(prefix + "-ckpt")
        values = [(v.path.split("/")[-1], np.asarray(v.numpy()).tolist()) for v in opt.variables]
        with open(prefix + ".json", "w") as f:
            json.dump({"version": tfmixprec.__version__, "variables": values}, f)


if __name__ == "__main__":
    main()
