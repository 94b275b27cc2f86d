"""One worker of a 2-worker `MultiWorkerMirroredStrategy` run of Keras's own `fit`, `evaluate`
and `predict` on a `tfmixprec.MixedPrecisionModel` (tests/fit/test_multi_worker.py).

TF_CONFIG comes from the environment. The global batch of `INF_STEP` (of each epoch) holds an
Inf in its second half only: worker 1's shard (the dataset is sharded by DATA, so each worker
takes its half of every global batch). The callbacks are the ones a user would pass:
LossScaleMonitor, OverflowGuard, tfmixprec.TensorBoard (the same log_dir on every worker),
BackupAndRestore (a folder per worker) and ModelCheckpoint (on the chief only). A recorder
hashes the weights and the inner optimizer's variables before and after each batch, and every
weight and optimizer variable at each epoch's end. Writes fit-<task>.json and fit-<task>.npz
to --out. With --loop-out, the same process then runs tests/workers/multiworker_worker.py's
custom loop under the same strategy, into that folder.

`data`, `dataset` and `build_model` are imported by the test too, for the same fit in one
process.
"""

import argparse
import glob
import hashlib
import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_BATCH = 16
STEPS = 8  # global steps per epoch
EPOCHS = 2
INF_STEP = 5  # 0-based global step of each epoch whose second half (worker 1's) holds an Inf


def data():
    """(x with the Inf, y, x without it): 128 samples of 4 features."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, 4)).astype("float32")
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2]).astype("float32")
    x_bad = x.copy()
    x_bad[INF_STEP * GLOBAL_BATCH + GLOBAL_BATCH // 2 + 1, 2] = np.inf
    return x_bad, y, x


def dataset(*arrays):
    """Batches of the global batch size, sharded by DATA across workers."""
    data_set = tf.data.Dataset.from_tensor_slices(arrays if len(arrays) > 1 else arrays[0])
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return data_set.batch(GLOBAL_BATCH).with_options(options)


def build_model():
    """Dense(8, tanh) -> Dense(1) on 4 inputs, float32 with tfmixprec's dynamic loss scale."""
    import keras

    import tfmixprec

    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(inputs))
    model = tfmixprec.MixedPrecisionModel(inputs, outputs)
    optimizer = tfmixprec.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2), initial_scale=256, growth_interval=3
    )
    model.compile(optimizer=optimizer, loss="mse", loss_scaling="dynamic")
    return model


def fingerprint(model, loss_scale_state=True):
    """A hash of every weight and optimizer variable (this worker's copies); without
    `loss_scale_state`, of the weights and the inner optimizer's variables only (what a
    skipped step leaves alone)."""
    optimizer = model.optimizer if loss_scale_state else model.optimizer.inner_optimizer
    digest = hashlib.sha256()
    for variable in model.weights + optimizer.variables:
        digest.update(np.asarray(variable.numpy()).tobytes())
    return digest.hexdigest()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--loop-out", help="then run multiworker_worker's custom loop here")
    args = parser.parse_args()

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # first, before any other op
    import keras

    import tfmixprec

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    tempfile.tempdir = os.path.join(args.out, f"tmp-{task}")  # where a worker's TB run goes
    os.makedirs(tempfile.tempdir)
    x_bad, y, x = data()
    train = dataset(x_bad, y)
    shards = strategy.experimental_distribute_dataset(train)
    local_finite = [
        bool(np.isfinite(strategy.experimental_local_results(xb)[0].numpy()).all())
        for xb, _ in shards
    ]

    with strategy.scope():
        model = build_model()

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches, self.epochs, self.tb_dirs = [], [], []

        def on_train_batch_begin(self, batch, logs=None):
            self.before = fingerprint(self.model, loss_scale_state=False)

        def on_train_batch_end(self, batch, logs=None):
            after = fingerprint(self.model, loss_scale_state=False)
            overflow = float(logs["overflow"])
            self.batches.append({"before": self.before, "after": after, "overflow": overflow})

        def on_epoch_end(self, epoch, logs=None):
            state = self.model.optimizer.read_state()
            self.epochs.append({"hash": fingerprint(self.model), "state": state})
            found = glob.glob(os.path.join(tempfile.gettempdir(), "tfmixprec-tb-worker-*"))
            events = glob.glob(os.path.join(tempfile.gettempdir(), "*", "train", "events.*"))
            self.tb_dirs.append({"dirs": len(found), "event_files": len(events)})

    recorder = Recorder()
    callbacks = [
        recorder,
        tfmixprec.LossScaleMonitor(update_freq=1),
        tfmixprec.OverflowGuard(),
        tfmixprec.TensorBoard(os.path.join(args.out, "logs"), update_freq=1),
        keras.callbacks.BackupAndRestore(os.path.join(args.out, "backup", f"worker-{task}")),
    ]
    if strategy.extended.should_checkpoint:
        callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(args.out, "model.keras")))
    history = model.fit(train, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    evaluated = model.evaluate(dataset(x, y), verbose=0, return_dict=True)
    predicted = model.predict(dataset(x), verbose=0)
    direct = np.asarray(model(x))
    np.savez(
        os.path.join(args.out, f"fit-{task}.npz"),
        predicted=predicted,
        direct=direct,
        **{f"weight_{i}": np.asarray(w.numpy()) for i, w in enumerate(model.weights)},
    )
    record = {
        "pid": os.getpid(),
        "local_finite": local_finite,
        "history": history.history,
        "batches": recorder.batches,
        "epochs": recorder.epochs,
        "tb_dirs": recorder.tb_dirs,
        "evaluate": evaluated,
        "state": model.optimizer.read_state(),
        "checkpointed": bool(strategy.extended.should_checkpoint),
    }
    with open(os.path.join(args.out, f"fit-{task}.json"), "w") as f:
        json.dump(record, f)
    if args.loop_out:  # the same processes and strategy: no second start of 2 workers
        from multiworker_worker import custom_loop  # its folder is on sys.path

        tempfile.tempdir = None  # the loop's temporary files outside the fit's TB folder
        custom_loop(strategy, args.loop_out)


if __name__ == "__main__":
    main()
