"""A training run that `tests/test_reliability.py` kills with SIGKILL and starts again.

It trains a tiny MixedPrecisionModel with `keras.callbacks.BackupAndRestore(save_freq=4)` on
data with two Inf batches per epoch, and appends JSON lines to --record: the full optimizer
state and a hash of every weight and optimizer variable at each backup, at the start of the
run (after BackupAndRestore restored) and at the end. With --kill-at N it kills itself with
SIGKILL at global batch N (mid-epoch).
"""

import argparse
import json
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from fit_worker import fingerprint  # noqa: E402  (its folder is on sys.path)

import tfmixprec  # noqa: E402

SAVE_FREQ = 4


def snapshot(model, event, step):
    state = model.optimizer.read_state()
    return {"event": event, "step": step, "state": state, "hash": fingerprint(model)}


class Recorder(keras.callbacks.Callback):
    def __init__(self, path, kill_at):
        super().__init__()
        self.path, self.kill_at, self.step = path, kill_at, 0

    def write(self, record):
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_begin(self, logs=None):
        self.write(snapshot(self.model, "begin", self.step))

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step % SAVE_FREQ == 0:  # BackupAndRestore (earlier in the list) just saved
            self.write(snapshot(self.model, "backup", self.step))
        if self.step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, logs=None):
        self.write(snapshot(self.model, "end", self.step))


def build_model():
    """Dense(8, relu) -> Dense(1), compiled with a dynamic scale that moves within an epoch
    (also built by tests/workers/mw_resume_worker.py, in its strategy's scope)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(inputs))
    model = tfmixprec.MixedPrecisionModel(inputs, outputs)
    model.compile(
        optimizer=tfmixprec.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2), initial_scale=256, growth_interval=3, hysteresis=2
        ),
        loss="mse",
    )
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backup", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--kill-at", type=int, default=-1)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 4)).astype("float32")
    y = rng.normal(size=(80, 1)).astype("float32")
    x[2 * 8, 0] = np.inf  # batch 2 of every epoch overflows
    x[6 * 8, 1] = np.nan  # and batch 6

    model = build_model()
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[
            keras.callbacks.BackupAndRestore(args.backup, save_freq=SAVE_FREQ),
            Recorder(args.record, args.kill_at),
        ],
    )


if __name__ == "__main__":
    main()
