"""One worker of a 2-worker `MultiWorkerMirroredStrategy` fit with `PrecisionRepair`
(tests/fit/test_repair.py): the inputs that pass 65504 in `big` are in the second half of each
global batch only, worker 1's shard (the dataset is sharded by DATA). Writes repair-<task>.json
(the repairs, the loss-scale state, the layers' dtypes, a hash of the weights) to --out.

`data` and `dataset` are imported by the test too, for the same fit in one process.
"""

import argparse
import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_BATCH = 32
STEPS = 8


def data():
    """Small inputs; rows 16 and 24 of each global batch (worker 1's half) hold a 10."""
    x = 0.1 * np.random.default_rng(1).normal(size=(STEPS * GLOBAL_BATCH, 8)).astype("float32")
    x[16::GLOBAL_BATCH, 0] = 10.0
    x[24::GLOBAL_BATCH, 0] = 10.0
    return x, np.zeros((len(x), 1), "float32")


def dataset(x, y):
    data_set = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return data_set.with_options(options)


def summary(model, repair):
    digest = hashlib.sha256()
    for weight in model.weights:
        digest.update(np.asarray(weight.numpy()).tobytes())
    return {
        "repairs": [[r.step, list(r.layers), r.cause] for r in repair.repairs],
        "state": model.optimizer.read_state(),
        "dtypes": {layer.name: layer.compute_dtype for layer in model.layers},
        "hash": digest.hexdigest(),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # first, before any other op
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from overflow_models import model as overflow_model

    import tfmixprec

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    model = overflow_model("flows", cls=tfmixprec.MixedPrecisionModel, strategy=strategy)
    repair = tfmixprec.PrecisionRepair(verbose=0)
    model.fit(dataset(*data()), epochs=2, shuffle=False, verbose=0, callbacks=[repair])
    with open(os.path.join(args.out, f"repair-{task}.json"), "w") as file:
        json.dump(summary(model, repair), file)


if __name__ == "__main__":
    main()
