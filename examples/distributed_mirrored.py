"""Mixed precision under `tf.distribute.MirroredStrategy`.

Uses the GPUs present, or splits the CPU into 2 logical devices (a real 2-replica strategy).
One replica's shard of one batch gets an Inf: both replicas skip the step (the finite flag is
all-reduced), and the weights stay identical on both replicas.

    python examples/distributed_mirrored.py [--epochs 3]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# tfmixprec first: it imports TensorFlow without the start-up lines this log level hides
import tfmixprec  # noqa: E402, I001
import tensorflow as tf  # noqa: E402


def make_strategy() -> tf.distribute.MirroredStrategy:
    if len(tf.config.list_physical_devices("GPU")) >= 2:
        return tf.distribute.MirroredStrategy()
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )
    return tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])


def build_model(strategy: tf.distribute.MirroredStrategy):
    """A small regression model, created and compiled under `strategy`."""
    import keras

    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(32, activation="relu")(inputs)
        outputs = keras.layers.Dense(1, dtype="float32")(hidden)
        model = tfmixprec.MixedPrecisionModel(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", loss_scaling="dynamic")
    return model


def replicas_identical(model) -> bool:
    """Whether every weight holds the same values on every replica."""
    import numpy as np

    return all(
        all(np.array_equal(copies[0].numpy(), c.numpy()) for c in copies[1:])
        for copies in (w.value.values for w in model.weights)
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="tfmixprec under MirroredStrategy")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--policy", default="auto")
    args = parser.parse_args(argv)

    strategy = make_strategy()  # before anything else touches the devices

    import numpy as np

    policy = tfmixprec.set_policy(args.policy)
    print(f"replicas: {strategy.num_replicas_in_sync}, policy: {policy.name}")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 16)).astype("float32")
    y = (x @ rng.normal(size=(16, 1))).astype("float32")
    x[63, 0] = np.inf  # last sample of the first global batch of 64: one replica's shard

    model = build_model(strategy)
    history = model.fit(x, y, batch_size=64, epochs=args.epochs, shuffle=False, verbose=2)

    state = model.optimizer.read_state()  # host read, works on mirrored variables too
    identical = replicas_identical(model)
    result = {
        "replicas": strategy.num_replicas_in_sync,
        "overflow_steps": state["overflow_steps"],
        "applied_steps": state["iterations"],
        "replicas_identical": identical,
        "final_loss": history.history["loss"][-1],
    }
    print(
        f"overflow steps {result['overflow_steps']} (skipped on every replica), applied steps "
        f"{result['applied_steps']}, weights identical across replicas: {identical}"
    )
    print(f"final epoch's loss {result['final_loss']:.4f} (the mean over its applied steps)")
    return result


if __name__ == "__main__":
    main()
