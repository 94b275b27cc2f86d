"""Throughput of `MixedPrecisionModel.fit` on 1 worker and on 2, same model and global batch.

Three variants, each in its own process(es), the same MLP, data, policy and GLOBAL batch:

- `plain`: one process, no strategy (the reference);
- `mwms-1`: `MultiWorkerMirroredStrategy` with a 1-worker cluster (its cost on its own);
- `mwms-2`: 2 workers on 127.0.0.1 (`tfmixprec.testing.run_workers`), each computing half of
  every global batch, gradients all-reduced.

A round launches each variant once, alternating the order from round to round (A B C, C B A,
...); in each process the model is traced and warmed up, then `--runs` `fit` calls of
`--steps` steps are timed from the end of their first batch to the end of their last
(`tfmixprec.bench.StepTimer`). A process's figure is its median run (a 2-worker run's is the
slower worker's); the ratio to `plain` is paired by round, and its median reported. Every
process trains the same steps from the same seed, so the final weights must agree: bit for
bit between the 2 workers, and within float tolerance with `plain` (the all-reduce sums the
half-batch gradients in another order).

On one machine the 2 workers share its cores (each runs TensorFlow's default thread pools),
so they are not expected to be faster: the point is that it runs and agrees. On 2 machines,
run `examples/multi_worker.py` instead.

    python benchmarks/multi_worker.py              # about 5 minutes on 2 cores
    python benchmarks/multi_worker.py --smoke      # a tiny run, for the tests
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

VARIANTS = ("plain", "mwms-1", "mwms-2")
WORKERS = {"plain": 1, "mwms-1": 1, "mwms-2": 2}
VARIANTS_WORKERS = [(v, i) for v in VARIANTS for i in range(WORKERS[v])]
SMOKE = dict(width=16, depth=1, features=8, batch=16, steps=3, runs=1, rounds=1, check_steps=2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256, help="the GLOBAL batch size")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per process")
    parser.add_argument("--check-steps", type=int, default=5, help="steps before the check")
    parser.add_argument("--rounds", type=int, default=3, help="processes per variant")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads a process")
    parser.add_argument("--smoke", action="store_true", help="a tiny, quick run (tests)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)  # where a worker writes
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    return args


# ------------------------------------------------------------------ in a worker process
def build(args: argparse.Namespace, strategy):
    """The MLP and its dataset (GLOBAL batch, sharded by data), compiled in the scope."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmixprec

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * 8, args.features)).astype("float32")
    teacher = rng.normal(size=(args.features, 10))
    y = np.argmax(x @ teacher, axis=1).astype("int32")  # a learnable task, not random labels
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat()
    with strategy.scope():
        tfmixprec.set_policy(args.policy)
        keras.utils.set_random_seed(0)
        inputs = keras.Input((args.features,))
        h = inputs
        for _ in range(args.depth):
            h = keras.layers.Dense(args.width, activation="relu")(h)
        outputs = keras.layers.Dense(10, activation="softmax", dtype="float32")(h)
        model = tfmixprec.MixedPrecisionModel(inputs, outputs)
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    return model, dataset.with_options(options)


def save_weights(model, path: str) -> None:
    import numpy as np

    np.savez(path, *[np.asarray(w.numpy()) for w in model.weights])


def worker_main(args: argparse.Namespace) -> None:
    """Train `--check-steps`, warm up, time `--runs` fits; write the times and the weights
    (after the check steps and at the end) to files named by --record."""
    import tensorflow as tf

    if args.threads:  # before TensorFlow starts its thread pools
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    if args.worker == "plain":
        strategy = tf.distribute.get_strategy()
        index = 0
    else:  # first, before any other TensorFlow op: it reads TF_CONFIG
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        index = strategy.cluster_resolver.task_id or 0
    from tfmixprec.tools import bench

    model, dataset = build(args, strategy)
    model.fit(dataset, epochs=1, steps_per_epoch=args.check_steps, verbose=0)
    save_weights(model, f"{args.record}-{index}-early.npz")
    bench.time_fit(model, dataset, args.steps)  # trace and warm up
    times = [bench.time_fit(model, dataset, args.steps).per_step for _ in range(args.runs)]
    save_weights(model, f"{args.record}-{index}-end.npz")
    with open(f"{args.record}-{index}.json", "w") as f:
        json.dump({"times": times, "replicas": strategy.num_replicas_in_sync}, f)


# ------------------------------------------------------------------ the driver
def launch(variant: str, argv: list[str], record: str, timeout: float) -> None:
    """Runs one variant's process(es); raises with the end of stderr if one fails."""
    from tfmixprec.tools.testing import run_workers

    command = [sys.executable, os.path.abspath(__file__), *argv]
    command += ["--worker", variant, "--record", record]
    if variant == "plain":
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        failures = [done.stderr] if done.returncode else []
    else:
        results = run_workers(command, WORKERS[variant], timeout=timeout)
        failures = [r.stderr for r in results if r.returncode]
    if failures:
        raise RuntimeError(f"{variant} failed:\n{failures[0][-3000:]}")


def collect(args: argparse.Namespace, argv: list[str], folder: str) -> dict:
    """Runs every round; returns {variant: [per-round seconds per step]}."""
    step_s: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for round_ in range(args.rounds):
        order = VARIANTS if round_ % 2 == 0 else tuple(reversed(VARIANTS))
        for variant in order:
            record = os.path.join(folder, f"{variant}-{round_}")
            launch(variant, argv, record, args.timeout)
            per_worker = []
            for index in range(WORKERS[variant]):
                with open(f"{record}-{index}.json") as f:
                    per_worker.append(statistics.median(json.load(f)["times"]))
            step_s[variant].append(max(per_worker))
    return step_s


def weights(folder: str, variant: str, round_: int, index: int, when: str) -> list:
    import numpy as np

    with np.load(os.path.join(folder, f"{variant}-{round_}-{index}-{when}.npz")) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


def max_diff(a: list, b: list) -> float:
    import numpy as np

    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


LEARNING_RATE = 1e-3  # Adam's, in `build`
EPSILON = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}  # machine epsilons


def tolerance(policy: str, steps: int) -> tuple[float, float]:
    """`(rtol, atol)` for the weights of `mwms-2` against `plain` after `steps` Adam steps.

    The all-reduce sums the two half-batch gradients in another order than one process does,
    so they differ by the rounding of the compute dtype (its machine epsilon: 2^-23 for
    float32, 2^-7 for bfloat16, 2^-10 for float16). Adam's step is `lr * m / sqrt(v)`, which a
    relative change of the gradients by `eps` changes by about `lr * eps`, so after `steps`
    steps the weights differ by at most about `steps * lr * eps` (atol), plus the float32
    rounding of the weights themselves (rtol). Measured: 7.5e-9 in float32 and 8.3e-6 in
    bfloat16 after 2 steps on an AMD EPYC, against bounds of 2.4e-10 + 2.4e-7 |w| and 1.6e-5.
    A worker that trains on the wrong data differs by about `lr` per step.
    """
    import keras

    import tfmixprec

    name = tfmixprec.choose_policy().name if policy == "auto" else policy
    eps = EPSILON[keras.DTypePolicy(name).compute_dtype]
    return steps * EPSILON["float32"], steps * LEARNING_RATE * eps


def agreement(args: argparse.Namespace, folder: str) -> list[str]:
    """Lines on whether the weights agree across workers and with `plain`."""
    import numpy as np

    rtol, atol = tolerance(args.policy, args.check_steps)
    lines = []
    for round_ in range(args.rounds):
        w = {(v, i): weights(folder, v, round_, i, "end") for v, i in VARIANTS_WORKERS}
        early = {(v, i): weights(folder, v, round_, i, "early") for v, i in VARIANTS_WORKERS}
        same = all(np.array_equal(a, b) for a, b in zip(w["mwms-2", 0], w["mwms-2", 1]))
        diff = max_diff(early["mwms-2", 0], early["plain", 0])
        close = all(
            np.allclose(a, b, rtol=rtol, atol=atol)
            for a, b in zip(early["mwms-2", 0], early["plain", 0])
        )
        lines.append(
            f"round {round_}: 2 workers' weights bit-identical: {same}; max |w - plain| after "
            f"{args.check_steps} steps: mwms-2 {diff:.1e} (allclose rtol {rtol:.1e}, atol "
            f"{atol:.1e}: {close});"
            f" at the end: mwms-1 {max_diff(w['mwms-1', 0], w['plain', 0]):.1e}, mwms-2 "
            f"{max_diff(w['mwms-2', 0], w['plain', 0]):.1e}"
        )
    return lines


def report(args: argparse.Namespace, step_s: dict, folder: str) -> dict:
    import keras
    import tensorflow as tf

    import tfmixprec
    from tfmixprec.tools import bench

    machine = bench.describe_machine()
    print(
        f"machine: {machine['cpu']} ({machine['cores']} cores), GPUs: {machine['gpus'] or 'none'}; "
        f"TensorFlow {tf.__version__}, Keras {keras.__version__}"
    )
    policy = args.policy
    if policy == "auto":
        policy = f"auto ({tfmixprec.choose_policy().name})"
    print(
        f"policy={policy} MLP {args.depth}x{args.width} features={args.features} "
        f"global batch={args.batch} steps/run={args.steps} runs/process={args.runs} "
        f"rounds={args.rounds} intra-op threads/process={args.threads or 'default'}"
    )
    ratios = {}
    for variant in VARIANTS:
        median = statistics.median(step_s[variant])
        paired = [t / p for t, p in zip(step_s[variant], step_s["plain"])]
        ratios[variant] = statistics.median(paired)
        print(
            f"{variant:7s} workers {WORKERS[variant]}  median {1000 * median:8.2f} ms/step  "
            f"{args.batch / median:9.1f} examples/s  throughput vs plain "
            f"{1 / ratios[variant]:.3f} (paired, median of {len(paired)})"
        )
    for line in agreement(args, folder):
        print(line)
    return {"step_s": step_s, "ratios": ratios}


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return None
    with tempfile.TemporaryDirectory(prefix="tfmixprec-multi-worker-") as folder:
        step_s = collect(args, argv, folder)
        return report(args, step_s, folder)


if __name__ == "__main__":
    main()
