"""One worker of a 2-process MultiWorkerMirroredStrategy custom loop on 127.0.0.1
(tests/fit/test_multi_worker.py).

TF_CONFIG comes from the environment; each worker has its own data (no sharding). Worker 1's
batch 2 is all Inf (worker 0's is clean): both workers must skip that step. Writes the final
weights (.npz) and optimizer state (.json) to --out; then tries a plain `keras.Model.fit`
under the same strategy and records how it ended.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    custom_loop(tf.distribute.MultiWorkerMirroredStrategy(), args.out, args.steps)


def custom_loop(strategy, out, steps=5):
    """The custom loop and the plain keras fit, under `strategy`, written to `out`
    (tests/workers/fit_worker.py runs it too, after its own fit, with --loop-out)."""
    import keras
    import numpy as np

    import tfmixprec

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    rng = np.random.default_rng(task)  # different data on each worker
    x = rng.normal(size=(steps * 8, 4)).astype("float32")
    y = rng.normal(size=(steps * 8, 1)).astype("float32")
    if task == 1:
        x[2 * 8 : 3 * 8] = np.inf  # batch 2, on worker 1 only
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = dataset.with_options(options)

    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        outputs = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(inputs))
        model = tfmixprec.MixedPrecisionModel(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", loss_scaling="dynamic")

    # A custom loop, as a user's own would be: tfmixprec's train_step, one strategy.run per
    # batch (tests/workers/fit_worker.py runs Keras's own fit instead).
    @tf.function
    def step(batch):
        logs = strategy.run(model.train_step, args=(batch,))
        return strategy.experimental_local_results(logs["overflow"])[0]

    batches = strategy.experimental_distribute_dataset(dataset)
    overflow_log = [float(step(batch)) for batch in batches]
    np.savez(
        os.path.join(out, f"weights-{task}.npz"),
        *[np.asarray(w.numpy()) for w in model.weights],
    )
    record = {"state": model.optimizer.read_state(), "overflow_log": overflow_log}
    record["keras_fit"] = keras_fit(strategy)
    with open(os.path.join(out, f"state-{task}.json"), "w") as f:
        json.dump(record, f)


def keras_fit(strategy):
    """What a plain `keras.Model.fit` under the same strategy does: the upstream failure
    tfmixprec works around (keras-team/keras#20585), or "fit ran" once Keras fixes it."""
    import keras
    import numpy as np

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.ones((32, 4), "float32")
    try:
        model.fit(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(8), verbose=0)
    except ValueError as error:
        return "fit failed: " + " ".join(str(error).split())
    return "fit ran"


if __name__ == "__main__":
    main()
