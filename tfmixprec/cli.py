"""The `tfmixprec` command: doctor, audit, demo and bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2
DEMO_POLICIES = ("auto", "mixed_float16", "mixed_bfloat16", "float32")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfmixprec",
        description="Safe, visible and fast mixed precision for Keras 3 on TensorFlow.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    doctor = sub.add_parser("doctor", help="hardware report and the recommended policy")
    doctor.add_argument("--json", action="store_true", help="print JSON")

    audit = sub.add_parser("audit", help="audit a saved .keras model for mixed precision")
    audit.add_argument("model", help="path to a .keras file")
    audit.add_argument(
        "--policy",
        choices=DEMO_POLICIES,
        help="audit as if the model had been built under this policy",
    )
    audit.add_argument("--json", action="store_true", help="print JSON")

    demo = sub.add_parser("demo", help="train a small CNN on the digits data set")
    demo.add_argument("--policy", choices=DEMO_POLICIES, default="auto")
    demo.add_argument("--epochs", type=_positive_int, default=12)
    demo.add_argument("--logdir", default="runs", help="TensorBoard log folder (default: runs)")
    demo.add_argument("--batch-size", type=_positive_int, default=64)
    demo.add_argument("--quiet", action="store_true", help="no progress bar")

    bench = sub.add_parser("bench", help="step time and throughput per policy, side by side")
    bench.add_argument("--model", choices=("mlp", "cnn", "transformer"), default="mlp")
    bench.add_argument(
        "--policies",
        nargs="+",
        choices=DEMO_POLICIES,
        default=["float32", "mixed_bfloat16", "auto"],
    )
    bench.add_argument("--size", type=_positive_int, default=1024, help="model width")
    bench.add_argument("--batch-size", type=_positive_int, default=256)
    bench.add_argument("--steps", type=_positive_int, default=20, help="steps per timed run")
    bench.add_argument("--repeats", type=_positive_int, default=3)
    return parser


def _quiet_tensorflow() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def cmd_doctor(args: argparse.Namespace) -> int:
    import tfmixprec

    report = tfmixprec.doctor(print_report=not args.json)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    return EXIT_OK


def cmd_audit(args: argparse.Namespace) -> int:
    path = Path(args.model)
    if not path.is_file():
        print(f"tfmixprec audit: error: no such file: {str(path)!r}", file=sys.stderr)
        return EXIT_USAGE
    if not zipfile.is_zipfile(path):
        print(
            f"tfmixprec audit: error: {str(path)!r} is not a Keras model file (.keras is a zip "
            "archive; save the model with model.save('model.keras')).",
            file=sys.stderr,
        )
        return EXIT_USAGE
    import keras

    import tfmixprec

    try:
        model = keras.models.load_model(path, compile=True)
    except Exception as err:  # any load failure is a bad input here, not a crash
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(
            f"tfmixprec audit: error: could not load {str(path)!r} as a Keras model: {first_line}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        report = tfmixprec.audit(model, policy=args.policy)
    except (TypeError, ValueError) as err:
        print(f"tfmixprec audit: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(report.to_json() if args.json else report)
    return EXIT_OK if report.ok else EXIT_FINDINGS


def load_digits_split(seed: int = 0):
    """scikit-learn's digits (1797 8x8 images, shipped inside the package): 80/20 split."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def build_demo_model():
    import keras

    import tfmixprec

    layers = keras.layers
    inputs = keras.Input((8, 8, 1))
    h = layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    h = layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = layers.MaxPooling2D()(h)
    h = layers.Flatten()(h)
    h = layers.Dense(64, activation="relu")(h)
    outputs = layers.Dense(10, activation="softmax")(h)
    model = tfmixprec.MixedPrecisionModel(inputs, outputs, name="digits_cnn")
    tfmixprec.float32_outputs(model)
    return model


def cmd_demo(args: argparse.Namespace) -> int:
    import keras

    import tfmixprec

    choice = tfmixprec.choose_policy()
    policy = choice.name if args.policy == "auto" else args.policy
    print(f"policy: {policy}" + (f" (auto: {choice.reason})" if args.policy == "auto" else ""))
    (x_train, y_train), (x_test, y_test) = load_digits_split()
    run_dir = Path(args.logdir) / f"demo-{policy}-{time.strftime('%Y%m%d-%H%M%S')}"
    start = time.perf_counter()
    with tfmixprec.policy_scope(policy):
        keras.utils.set_random_seed(0)
        model = build_demo_model()
        model.compile(
            optimizer=keras.optimizers.Adam(2e-3),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
        monitor = tfmixprec.LossScaleMonitor(verbose=1, update_freq=20)
        board = tfmixprec.TensorBoard(str(run_dir), update_freq=5)
        model.fit(
            x_train,
            y_train,
            batch_size=args.batch_size,
            epochs=args.epochs,
            verbose=0 if args.quiet else (1 if sys.stdout.isatty() else 2),
            callbacks=[monitor, board],
        )
        _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    _print_demo_summary(
        policy, accuracy, len(x_test), model.optimizer, time.perf_counter() - start, args.logdir
    )
    return EXIT_OK


def _print_demo_summary(
    policy: str, accuracy: float, n_test: int, optimizer: Any, seconds: float, logdir: str
) -> None:
    from tfmixprec.loss_scale import format_scale

    state = optimizer.read_state()
    steps = state["overflow_steps"] + state["iterations"]
    print("")
    print("tfmixprec demo summary")
    print(f"  policy          {policy}")
    print(f"  test accuracy   {accuracy:.4f} ({n_test} held-out digits images)")
    kind = "dynamic" if optimizer.dynamic else "fixed"
    print(f"  loss scale      {format_scale(state['loss_scale'])} ({kind})")
    print(f"  overflow steps  {state['overflow_steps']} of {steps}")
    print(f"  training time   {seconds:.1f} s")
    print(f"  TensorBoard     tensorboard --logdir {logdir}")


def cmd_bench(args: argparse.Namespace) -> int:
    from tfmixprec import bench

    machine = bench.describe_machine()
    print(
        f"machine: {machine['cpu']} ({machine['cores']} cores), GPUs: {machine['gpus'] or 'none'}; "
        f"TensorFlow {machine['tensorflow']}, Keras {machine['keras']}"
    )
    results = bench.run_bench(
        model=args.model,
        policies=args.policies,
        size=args.size,
        batch=args.batch_size,
        steps=args.steps,
        repeats=args.repeats,
        float16_steps=max(2, args.steps // 10),
        float16_batch=min(args.batch_size, 16),
    )
    print(bench.format_table(results))
    return EXIT_OK


COMMANDS = {"doctor": cmd_doctor, "audit": cmd_audit, "demo": cmd_demo, "bench": cmd_bench}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tfmixprec` command. Returns the exit code."""
    args = _parser().parse_args(argv)  # usage errors exit 2 here
    _quiet_tensorflow()
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
