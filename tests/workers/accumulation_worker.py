"""One worker of a 2-process MultiWorkerMirroredStrategy run with gradient accumulation.

TF_CONFIG comes from the environment. Both workers read the same 32 samples; the dataset is
sharded by data, so each global micro-batch of 4 gives 2 samples to each worker, and a window
of 4 micro-batches is one applied step of 16 samples. For each N of --inf-sample (-1: none), a
fresh model is trained on the data with sample N Inf (on the worker whose shard holds it), and
its final weights (.npz), optimizer state and loss history (.json) written to --out.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402


def data(inf_sample=-1):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 2)).astype("float32")
    if inf_sample >= 0:
        x[inf_sample, 0] = np.inf
    return x, y


def build(accumulation_steps):
    import keras

    import tfmixprec

    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(2, name="out")(hidden)
    model = tfmixprec.MixedPrecisionModel(inputs, outputs)
    optimizer = tfmixprec.LossScaleOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.5),
        initial_scale=64,
        accumulation_steps=accumulation_steps,
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--inf-sample", type=int, nargs="+", default=[-1])
    args = parser.parse_args()

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import numpy as np

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    for inf_sample in args.inf_sample:
        dataset = tf.data.Dataset.from_tensor_slices(data(inf_sample)).batch(4)
        with strategy.scope():
            model = build(accumulation_steps=4)
        history = model.fit(dataset.with_options(options), epochs=1, verbose=0)
        name = os.path.join(args.out, f"{inf_sample}-{task}")
        np.savez(f"{name}.npz", *[w.numpy() for w in model.weights])
        record = {"state": model.optimizer.read_state(), "history": history.history}
        with open(f"{name}.json", "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    main()
