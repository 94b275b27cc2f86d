"""One worker of a 2-worker `MultiWorkerMirroredStrategy` `fit` that tests/fit/test_multi_worker.py
kills with SIGKILL and starts again.

TF_CONFIG comes from the environment. It trains a tiny MixedPrecisionModel with tfmixprec's
dynamic loss scale and `keras.callbacks.BackupAndRestore(save_freq=4)` (a folder per worker)
on data with an Inf in worker 1's shard of batch 2 and a NaN in worker 0's shard of batch 6 of
every epoch, and appends JSON lines to <out>/record-<task>.jsonl: the full optimizer state and
a hash of every weight and optimizer variable at each backup, at the start of the run (after
BackupAndRestore restored) and at the end. With --kill-at N, worker 1 kills itself with
SIGKILL at global batch N.
"""

import argparse
import json
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

SAVE_FREQ = 4
GLOBAL_BATCH = 16
STEPS = 10  # global steps per epoch
EPOCHS = 3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=-1)
    args = parser.parse_args()

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # first, before any other op
    import keras
    from resume_worker import build_model, fingerprint  # its folder is on sys.path

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, 4)).astype("float32")
    y = rng.normal(size=(STEPS * GLOBAL_BATCH, 1)).astype("float32")
    x[2 * GLOBAL_BATCH + GLOBAL_BATCH // 2, 0] = np.inf  # batch 2: worker 1's half
    x[6 * GLOBAL_BATCH + 1, 1] = np.nan  # batch 6: worker 0's half
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).with_options(options)

    with strategy.scope():
        model = build_model()

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.step, self.epoch = 0, None

        def write(self, event):
            record = {
                "event": event,
                "step": self.step,
                "epoch": self.epoch,
                "state": self.model.optimizer.read_state(),
                "hash": fingerprint(self.model),
            }
            with open(os.path.join(args.out, f"record-{task}.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")

        def on_train_begin(self, logs=None):
            self.write("begin")  # after BackupAndRestore (earlier in the list) restored

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            self.step += 1
            if self.step % SAVE_FREQ == 0:  # BackupAndRestore (earlier in the list) just saved
                self.write("backup")
            if task == 1 and self.step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_end(self, logs=None):
            self.write("end")

    backup = keras.callbacks.BackupAndRestore(
        os.path.join(args.out, "backup", f"worker-{task}"), save_freq=SAVE_FREQ
    )
    model.fit(train, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[backup, Recorder()])


if __name__ == "__main__":
    main()
