"""`model.fit` across machines with `tf.distribute.MultiWorkerMirroredStrategy`.

Trains a small digits classifier (`MixedPrecisionModel`) with `LossScaleMonitor`,
`OverflowGuard`, `tfmixprec.TensorBoard`, `BackupAndRestore` (one folder per worker) and, on
the chief only, `ModelCheckpoint`; then evaluates. The chief prints a summary (loss scale,
overflow steps, test accuracy); every worker prints a sha256 of its weights, the same on all.

On a cluster, run one command per worker, each with its own `TF_CONFIG` (same "cluster",
its own "task" index; worker 0 is the chief) and the same arguments; `--out` should be a
folder every worker can write to (a shared file system):

    TF_CONFIG='{"cluster": {"worker": ["host1:12345", "host2:12345"]},
                "task": {"type": "worker", "index": 0}}' \\
        python examples/multi_worker.py --epochs 3 --out /shared/run      # on host1
    # the same on host2 with "index": 1

On one machine (a laptop, CI), `--local 2` starts 2 workers on 127.0.0.1 itself, on the CPU
(`tfmixprec.testing.run_workers`), and prints the end of each one's output:

    python examples/multi_worker.py --local 2 --epochs 3 --out /tmp/run
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# tfmixprec first: it imports TensorFlow without the start-up lines this log level hides
import tfmixprec  # noqa: E402, I001
import tensorflow as tf  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="tfmixprec under MultiWorkerMirroredStrategy", allow_abbrev=False
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default="multi_worker_run", help="checkpoint, logs, backups")
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--batch", type=int, default=64, help="the GLOBAL batch size")
    parser.add_argument("--accumulation-steps", type=int, default=1)
    parser.add_argument("--local", type=int, default=0, help="start N workers on this machine")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds, with --local")
    return parser.parse_args(argv)


def without_local(argv: list[str]) -> list[str]:
    """The arguments without `--local N` / `--local=N`: what each worker gets."""
    rest, args = [], iter(argv)
    for arg in args:
        if arg == "--local":
            next(args, None)
        elif not arg.startswith("--local="):
            rest.append(arg)
    return rest


def run_local(args: argparse.Namespace, argv: list[str]) -> int:
    """Runs this script as each of `args.local` workers on 127.0.0.1; prints their output."""
    from tfmixprec.testing import run_workers

    command = [sys.executable, os.path.abspath(__file__), *without_local(argv)]
    # A rehearsal on the CPU: N processes would each take every GPU's memory. On a machine
    # with a GPU per worker, start the workers yourself, each with its own TF_CONFIG and GPU.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    try:
        results = run_workers(command, args.local, timeout=args.timeout, env=env)
    except TimeoutError as error:
        print(f"the {args.local} workers did not finish: {error}", file=sys.stderr)
        return 1
    for result in results:
        print(f"--- worker {result.index} (exit code {result.returncode})")
        print("\n".join(result.stdout.rstrip().splitlines()[-12:]))
        if result.returncode != 0:
            print(result.stderr[-3000:])
    return max(abs(r.returncode) for r in results)


def load_data(global_batch: int) -> tuple[tf.data.Dataset, tf.data.Dataset]:
    """Digits as datasets batched with the GLOBAL batch size, sharded by data across workers."""
    from tfmixprec.datasets import load_digits

    (x, y), (x_test, y_test) = load_digits()
    x, x_test = x.reshape(len(x), -1), x_test.reshape(len(x_test), -1)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    # The same seed on every worker: each shuffles alike, then takes its own share of each batch.
    train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0)
    train = train.batch(global_batch).with_options(options)
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(global_batch)
    return train, test.with_options(options)


def build_model(strategy: tf.distribute.Strategy, accumulation_steps: int):
    """A 64-64-10 classifier under the current policy, built and compiled in the scope."""
    import keras

    with strategy.scope():
        keras.utils.set_random_seed(0)  # the same initial weights on every worker
        inputs = keras.Input((64,))
        hidden = keras.layers.Dense(64, activation="relu", name="hidden")(inputs)
        outputs = keras.layers.Dense(10, activation="softmax", name="probs")(hidden)
        model = tfmixprec.MixedPrecisionModel(inputs, outputs)
        tfmixprec.float32_outputs(model)
        model.compile(
            optimizer=keras.optimizers.Adam(2e-3),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            accumulation_steps=accumulation_steps,
        )
    return model


def make_callbacks(strategy: tf.distribute.Strategy, out: str, task: str) -> list:
    """The callbacks of every worker; the checkpoint on the chief only."""
    import keras

    chief = strategy.extended.should_checkpoint
    callbacks = [
        tfmixprec.LossScaleMonitor(verbose=int(chief)),
        tfmixprec.OverflowGuard(patience=50, max_consecutive=5, verbose=int(chief)),
        tfmixprec.TensorBoard(os.path.join(out, "logs")),  # written by the chief
        # Keras's BackupAndRestore knows nothing of workers: one folder each, or they race.
        keras.callbacks.BackupAndRestore(os.path.join(out, "backup", task)),
    ]
    if chief:
        callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(out, "model.keras")))
    return callbacks


def fingerprint(model) -> str:
    """sha256 of this worker's copy of every weight."""
    import numpy as np

    digest = hashlib.sha256()
    for weight in model.weights:
        digest.update(np.asarray(weight.numpy()).tobytes())
    return digest.hexdigest()


def train(args: argparse.Namespace, strategy: tf.distribute.Strategy) -> dict:

    resolver = strategy.cluster_resolver  # task None without TF_CONFIG: one worker
    index = resolver.task_id or 0
    task = f"{resolver.task_type or 'worker'}-{index}"  # "chief-0" and "worker-0" may both be
    chief = strategy.extended.should_checkpoint
    policy = tfmixprec.set_policy(args.policy)
    train_data, test_data = load_data(args.batch)
    model = build_model(strategy, args.accumulation_steps)
    callbacks = make_callbacks(strategy, args.out, task)
    model.fit(train_data, epochs=args.epochs, verbose=2 if chief else 0, callbacks=callbacks)
    _, accuracy = model.evaluate(test_data, verbose=0)  # the same on every worker
    state = model.optimizer.read_state()
    result = {"worker": index, "policy": policy.name, "accuracy": accuracy, **state}
    result["fingerprint"] = fingerprint(model)
    if chief:
        print(
            f"chief: {strategy.num_replicas_in_sync} replicas, policy {policy.name}, "
            f"loss scale {state['loss_scale']:g}, overflow steps {state['overflow_steps']}, "
            f"test accuracy {accuracy:.3f}"
        )
    print(f"worker {index}: test accuracy {accuracy:.4f}, weights sha256 {result['fingerprint']}")
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.local:
        return run_local(args, argv)
    # First, before any other TensorFlow op: it reads TF_CONFIG and sets up the collectives.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    train(args, strategy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
