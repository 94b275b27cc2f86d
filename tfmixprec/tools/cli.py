"""The `tfmixprec` command: doctor, audit, demo and bench."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The parser lives in the top-level `_tfmixprec_args`, outside the package, so that the console
# script (`_tfmixprec_cli`) answers `--help` and usage errors without importing TensorFlow.
from _tfmixprec_args import build_parser, start_tensorflow

# The exit codes: 0 done, 1 the audit found an error, 2 bad input (argparse's code too).
EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


def cmd_doctor(args: argparse.Namespace) -> int:
    import tfmixprec

    report = tfmixprec.doctor(print_report=not args.json)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    return EXIT_OK


def cmd_audit(args: argparse.Namespace) -> int:
    """Audits a saved model file as it was saved (`tfmixprec.audit(path)`): under the policy
    its layers were saved with, compiled as Keras compiled it, and without running code from
    the file. Exit 0 with no error (warnings and info allowed), 1 with one, 2 when the file
    cannot be audited."""
    import tfmixprec

    try:
        report = tfmixprec.audit(args.model, policy=args.policy)
    except (TypeError, ValueError) as err:
        print(f"tfmixprec audit: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(report.to_json() if args.json else report)
    return EXIT_OK if report.ok else EXIT_FINDINGS


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
    from tfmixprec.tools.datasets import load_digits

    choice = tfmixprec.choose_policy()
    policy = choice.name if args.policy == "auto" else args.policy
    print(f"policy: {policy}" + (f" (auto: {choice.reason})" if args.policy == "auto" else ""))
    (x_train, y_train), (x_test, y_test) = load_digits()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.logdir) / f"demo-{policy}-{stamp}"
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
    _print_demo_summary(policy, accuracy, len(x_test), model.optimizer, time.perf_counter() - start)
    if not args.no_story:
        story = Path(args.logdir) / f"demo-float16-story-{stamp}"
        _print_story(run_float16_story(x_train, y_train, story))
    print(f"  TensorBoard     tensorboard --logdir {args.logdir}")
    print('                  then open the "Mixed precision" tab')
    return EXIT_OK


def _print_demo_summary(
    policy: str, accuracy: float, n_test: int, optimizer: Any, seconds: float
) -> None:
    from tfmixprec.scaling.loss_scale import format_scale

    state = optimizer.read_state()
    steps = state["step"]
    print("")
    print("tfmixprec demo summary")
    print(f"  policy          {policy}")
    print(f"  test accuracy   {accuracy:.4f} ({n_test} held-out digits images)")
    kind = "dynamic" if optimizer.dynamic else "fixed"
    print(f"  loss scale      {format_scale(state['loss_scale'])} ({kind})")
    print(f"  overflow steps  {state['overflow_steps']} of {steps}")
    print(f"  training time   {seconds:.1f} s")


# The float16 phase: `wide` projects an image with weights of about 3e4, so its outputs reach
# about 1e5 on these images (past float16's 65504, a fraction of float32's range); `narrow`
# scales them back. Both are frozen, so the values stay where they are while the classifier
# after them learns.
STORY_IMAGES, STORY_BATCH, STORY_EPOCHS = 512, 32, 3


def build_story_model():
    """A float16 digits classifier (under the current policy) whose layer `wide` passes
    float16's 65504 on every batch; computed in float32 it is finite."""
    import keras

    import tfmixprec

    normal = keras.initializers.RandomNormal
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Flatten(name="flatten")(inputs)
    wide = keras.layers.Dense(
        64, kernel_initializer=normal(stddev=3e4, seed=1), trainable=False, name="wide"
    )
    narrow = keras.layers.Dense(
        32, kernel_initializer=normal(stddev=1e-6, seed=2), trainable=False, name="narrow"
    )
    h = keras.layers.Dense(32, activation="relu", name="hidden")(narrow(wide(h)))
    outputs = keras.layers.Dense(10, activation="softmax", dtype="float32", name="digit")(h)
    return tfmixprec.MixedPrecisionModel(inputs, outputs, name="float16_story")


def run_float16_story(x: Any, y: Any, run_dir: Path) -> dict[str, Any]:
    """Trains `build_story_model` under mixed_float16 with a diagnosis of the first overflow
    and `PrecisionRepair`, written to `run_dir` every step; returns what the readers say."""
    import warnings

    print("")
    print(
        "float16 story: mixed_float16, shown for its loss-scale story, not for speed on this "
        "machine; a layer's outputs pass float16's 65504 ..."
    )
    with warnings.catch_warnings():  # the line above says it: not set_policy's warning too
        warnings.filterwarnings("ignore", "mixed_float16 without a GPU", UserWarning)
        return _fit_story(x, y, run_dir)


def _fit_story(x: Any, y: Any, run_dir: Path) -> dict[str, Any]:
    import keras

    import tfmixprec
    from tfmixprec.fit.repair import repairs_of

    with tfmixprec.policy_scope("mixed_float16"):
        keras.utils.set_random_seed(0)
        model = build_story_model()
        model.compile(optimizer=keras.optimizers.Adam(2e-3), loss="sparse_categorical_crossentropy")
        monitor = tfmixprec.LossScaleMonitor(update_freq=1, diagnose=1)
        callbacks = [
            tfmixprec.PrecisionRepair(verbose=0),
            monitor,
            tfmixprec.TensorBoard(str(run_dir), update_freq=1, diagnose=1),
        ]
        n = STORY_IMAGES
        history = model.fit(x[:n], y[:n], batch_size=STORY_BATCH, epochs=STORY_EPOCHS,
                            shuffle=False, verbose=0, callbacks=callbacks)  # fmt: skip
    return {
        "state": model.optimizer.read_state(),
        "events": monitor.events,
        "diagnoses": monitor.diagnoses,
        "repairs": repairs_of(model),
        "loss": history.history["loss"],  # per epoch: nan while no step was applied
    }


def _print_story(story: dict[str, Any]) -> None:
    """The float16 phase's lines, each read from a tfmixprec reader: the monitor's overflow
    lines, its diagnoses, the repairs made on the model, the optimizer's state."""
    import re

    from tfmixprec.scaling.loss_scale import format_scale

    state, repairs = story["state"], story["repairs"]
    found = [re.match(r"overflow at step (\d+) .*loss scale (\S+) ->", e) for e in story["events"]]
    steps = [int(m.group(1)) for m in found if m]
    scales = " -> ".join(m.group(2) for m in found if m)  # the scale each overflow step used
    print("")
    print("tfmixprec float16 story (steps 0-based, skipped steps counted)")
    print(f"  overflow        {state['overflow_steps']} of {state['step']} steps skipped, steps "
          f"{steps[0]}-{steps[-1]}: loss scale {scales}")  # fmt: skip
    for step, diagnosis in story["diagnoses"]:
        row = next(r for r in diagnosis.layers if r.layer == diagnosis.layer)
        print(f"  diagnosis       step {step}: {diagnosis.cause} in {diagnosis.layer!r}, its "
              f"outputs reach {row.float32_max_abs:.3g} in float32")  # fmt: skip
    for repair in repairs:
        layers = ", ".join(repr(layer) for layer in repair.layers)
        print(f"  repair          step {repair.step}: {layers} now float32, loss scale "
              f"restarted at {format_scale(repair.loss_scale)}")  # fmt: skip
    last = repairs[-1].step if repairs else -1
    after = state["step"] - 1 - last  # steps taken after the last repair
    later = len([step for step in steps if step > last])  # of them, the monitor's overflows
    losses = " -> ".join(f"{loss:.3f}" for loss in story["loss"])
    print(f"  after it        {after} steps, {later} overflow; loss per epoch {losses}")


def cmd_bench(args: argparse.Namespace) -> int:
    """Times each policy on a built-in model (`bench.run_bench`) or on a zoo model or your own
    (`bench.run_model_bench`), prints the table and the policy to use (`bench.recommend`).
    Exit 2 when the model cannot be built or benched: one line on stderr says why (bench turns
    the errors of your code and model, and running out of memory, into it), and the global
    policy and TensorFlow's options are as they were."""
    from tfmixprec.tools import bench

    machine = bench.describe_machine()
    print(
        f"machine: {machine['cpu']} ({machine['cores']} cores), GPUs: {machine['gpus'] or 'none'}; "
        f"TensorFlow {machine['tensorflow']}, Keras {machine['keras']}"
    )
    progress = lambda line: print(f"bench: {line}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        with bench.process_kept():
            results = _bench_results(args, bench, progress)
    except (ImportError, TypeError, ValueError) as err:
        print(f"tfmixprec bench: error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_USAGE
    print(bench.format_table(results))
    policies = {r.resolved_policy for r in results}
    if "float32" in policies and len(policies) > 1:  # something to compare float32 with
        print(bench.recommend(results).text)
    return EXIT_OK


def _bench_results(args: argparse.Namespace, bench: Any, progress: Any) -> list[Any]:
    if args.model in bench.MODELS:  # built in
        batch = args.batch_size or 256
        return bench.run_bench(
            model=args.model,
            policies=args.policies or ["float32", "mixed_bfloat16", "auto"],
            size=args.size,
            batch=batch,
            steps=args.steps,
            repeats=args.repeats,
            float16_steps=max(2, args.steps // 10),
            float16_batch=min(batch, 16),
            progress=progress,
        )
    return bench.run_model_bench(
        args.model,
        policies=args.policies or bench.MODEL_POLICIES,
        batch=args.batch_size,
        steps=args.steps,
        repeats=args.repeats,
        progress=progress,
    )


COMMANDS = {"doctor": cmd_doctor, "audit": cmd_audit, "demo": cmd_demo, "bench": cmd_bench}


def run_parsed(args: argparse.Namespace) -> int:
    """Runs the subcommand `args` names (parsed by `build_parser`); returns its exit code."""
    return COMMANDS[args.command](args)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `tfmixprec` command in this process, as the console script does (its Python
    warnings aside, which stay Python's). Returns the exit code; usage errors raise
    `SystemExit(2)`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # bare `tfmixprec`: its help, as the console script prints it
        parser.print_help()
        return EXIT_OK
    start_tensorflow()  # TensorFlow is imported already: only its log level's default
    return run_parsed(args)


if __name__ == "__main__":
    sys.exit(main())
