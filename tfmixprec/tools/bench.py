"""Training step time and throughput per policy, measured side by side in one process.

Used by `tfmixprec bench` and `benchmarks/speedup.py`. Runs alternate between the variants
(A, B, C, A, B, C, ...) so that drift in the machine hits all alike; the figure is the median.
This is the runner: the timing under each policy, the table and the recommendation. The models
it times come from `bench_model` (built-in, zoo, or a user's own), its refusals and one-line
errors from `bench_errors`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmixprec._common.validate import check_int_at_least_one
from tfmixprec._keras.fit import epochs_closed
from tfmixprec.fit.training import MixedPrecisionModel
from tfmixprec.precision import cpu_float16
from tfmixprec.precision.hardware import detect_hardware
from tfmixprec.precision.policy import (
    check_policy_name,
    choose_policy,
    policy_scope,
)
from tfmixprec.tools.bench_errors import out_of_memory, user_code
from tfmixprec.tools.bench_model import MODEL_POLICIES as MODEL_POLICIES
from tfmixprec.tools.bench_model import MODELS as MODELS
from tfmixprec.tools.bench_model import ModelSource as ModelSource
from tfmixprec.tools.bench_model import build_model as build_model
from tfmixprec.tools.bench_model import (
    builtin_data,
    check_bench_memory,
    model_source,
    source_variants,
)
from tfmixprec.tools.bench_model import load_function as load_function
from tfmixprec.tools.bench_model import synthetic_inputs as synthetic_inputs
from tfmixprec.tools.bench_model import synthetic_targets as synthetic_targets

# Internal module (used by `tfmixprec bench` and benchmarks/): the package exports nothing from it.
__all__: list[str] = []


@dataclasses.dataclass
class BenchResult:
    """One variant's timing."""

    model: str
    policy: str  # as asked first ("auto" stays "auto")
    resolved_policy: str
    stack: str  # "keras" (plain model.fit) or "tfmixprec" (MixedPrecisionModel)
    batch: int
    step_ms: float
    samples_per_s: float
    runs_ms: list[float]  # one per repeat, in the order of the repeats
    asked: tuple[str, ...] = ()  # every name asked that resolved to this policy (one row)

    @property
    def label(self) -> str:
        """The policy as the table shows it: `mixed_bfloat16 (auto)` where `auto` resolved to
        it, whether `mixed_bfloat16` was asked too or not."""
        return _policy_label(self.resolved_policy, self.asked or (self.policy,))


def _policy_label(resolved: str, asked: Sequence[str]) -> str:
    others = [name for name in asked if name != resolved]
    return f"{resolved} ({', '.join(others)})" if others else resolved


def distinct_policies(policies: Sequence[str], hardware: Any) -> list[tuple[str, ...]]:
    """The names asked, grouped by the policy each resolves to (`"auto"` by
    `choose_policy(hardware)`), in the order first asked: each policy is timed once."""
    groups: dict[str, list[str]] = {}
    for policy in policies:
        resolved = choose_policy(hardware).name if policy == "auto" else check_policy_name(policy)
        if policy not in groups.setdefault(resolved, []):
            groups[resolved].append(policy)
    return [tuple(asked) for asked in groups.values()]


class StepTimer(keras.callbacks.Callback):
    """Times the steps of one `fit` call from the end of its first batch to the end of its
    last, so tracing, `fit`'s set-up and its tear-down are not counted."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        if steps < 2:
            raise ValueError(f"steps must be >= 2 to time a step. Received: steps={steps!r}")
        self.steps = steps
        self.seconds = 0.0
        self._start = 0.0

    def window_open(self) -> None:
        """Hook: called when the timed window opens (end of batch 0)."""

    def window_close(self) -> None:
        """Hook: called when the timed window closes (end of the last batch)."""

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if batch == 0:
            self.window_open()
            self._start = time.perf_counter()
        elif batch == self.steps - 1:
            self.seconds = time.perf_counter() - self._start
            self.window_close()

    @property
    def per_step(self) -> float:
        """Seconds per step inside the window."""
        return self.seconds / (self.steps - 1)


class StepLosses(keras.callbacks.Callback):
    """Keeps every step's loss in `losses`, for comparing policies step by step.

    Keras logs the epoch's running mean, weighted by batch size: with batches of one size,
    a step's loss is `(batch + 1) * mean - batch * previous mean`. So it needs equal batches
    (the data a whole number of batches) and one step per callback call
    (`steps_per_execution=1`, checked: it raises otherwise), in a one-epoch `fit`.
    """

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.losses: list[float] = []
        self._previous = 0.0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if batch != len(self.losses):
            raise ValueError(
                "StepLosses needs one callback call per step (steps_per_execution=1) and a "
                f"one-epoch fit. Received: batch {batch} after {len(self.losses)} steps"
            )
        mean = float((logs or {})["loss"])
        self.losses.append((batch + 1) * mean - batch * self._previous)
        self._previous = mean


def time_fit(
    model: keras.Model,
    dataset: tf.data.Dataset,
    steps: int,
    callbacks: Sequence[Any] = (),
    timer: StepTimer | None = None,
) -> StepTimer:
    """Runs `fit` for `steps` steps; returns the timer (its `per_step` is the figure)."""
    timer = timer or StepTimer(steps)
    with epochs_closed(model):  # a fit that raised frees its data iterator with the error
        model.fit(
            dataset,
            epochs=1,
            steps_per_epoch=steps,
            verbose=0,
            shuffle=False,
            callbacks=list(callbacks) + [timer],  # last: runs after the others for each batch
        )
    return timer


def _variant(
    model: str,
    policy: str,
    stack: str,
    size: int,
    hardware: Any,
    steps_batch: tuple[int, int],
    float16_steps_batch: tuple[int | None, int | None],
) -> dict[str, Any]:
    """One compiled model to time, with the steps and batch it runs at."""
    resolved = choose_policy(hardware).name if policy == "auto" else policy
    with policy_scope(resolved):
        keras.utils.set_random_seed(0)
        cls = MixedPrecisionModel if stack == "tfmixprec" else keras.Model
        net = build_model(model, size, cls)
        net.compile(optimizer=keras.optimizers.Adam(1e-4), loss="sparse_categorical_crossentropy")
    n, b = steps_batch
    # float16 on a CPU is slow only in a few kernels, which tfmixprec routes around
    # (`cpu_float16`); plain Keras keeps them, so its float16 runs are cut short.
    routed = stack == "tfmixprec" and cpu_float16.applies(resolved, hardware)
    slow_float16 = not hardware.gpus and not hardware.tpus
    if resolved == "mixed_float16" and slow_float16 and not routed:
        n = float16_steps_batch[0] or n
        b = float16_steps_batch[1] or b
    return dict(policy=policy, resolved=resolved, stack=stack, net=net, steps=n, batch=b)


def _with_data(variant: dict[str, Any], dataset: tf.data.Dataset) -> dict[str, Any]:
    return {**variant, "data": dataset}


def run_bench(
    model: str = "mlp",
    policies: Sequence[str] = ("float32", "mixed_bfloat16", "auto"),
    stacks: Sequence[str] = ("tfmixprec",),
    size: int = 1024,
    batch: int = 256,
    steps: int = 20,
    repeats: int = 3,
    float16_steps: int | None = None,
    float16_batch: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[BenchResult]:
    """Times `fit` steps for each (policy, stack), alternating runs; returns medians.

    Args:
        model: String. One of `MODELS`.
        policies: List of policy names (`"auto"` allowed).
        stacks: List of `"keras"` (plain `keras.Model` + `compile`) and/or `"tfmixprec"`
            (`MixedPrecisionModel`, whose optimizer is a tfmixprec `LossScaleOptimizer`).
        size: Int. Model width (see `build_model`).
        batch: Int. Batch size.
        steps: Int. Steps per timed run.
        repeats: Int. Timed runs per variant (the median is reported).
        float16_steps: Int. Steps per run for plain-Keras float16 variants on a machine
            without a GPU (some of TensorFlow's float16 CPU kernels are many times slower
            than float32, benchmarks/RESULTS.md 2b; tfmixprec's stack routes around them and
            runs at full size); defaults to `steps`.
        float16_batch: Int. Batch size for those variants (their samples/s is per sample, but
            a smaller batch is less efficient, so it flatters float16 no more than float32);
            defaults to `batch`.
        progress: Callable taking one line, or None. Told each variant's warm-up step time,
            then an estimate of the time left after each timed run (the command prints it).

    Returns:
        List of `BenchResult`, in the order of `policies` x `stacks`; names that resolve to
        one policy (`"auto"` and what it picks) share one result (`distinct_policies`).
    """
    _check_counts(policies, steps, repeats, batch)
    hardware = detect_hardware()
    groups = distinct_policies(policies, hardware)  # "auto" and what it picks: one model
    check_bench_memory(model, size, batch, len(groups) * len(stacks))
    datasets: dict[int, tf.data.Dataset] = {}

    def dataset_for(n: int) -> tf.data.Dataset:
        if n not in datasets:
            x, y = builtin_data(model, n, size)
            datasets[n] = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(2)
        return datasets[n]

    float16_steps_batch = (float16_steps, float16_batch)
    sized = f"--model {model} --size {size} --batch-size {batch}: training"
    with out_of_memory(sized, "Pass a smaller --size or --batch-size."):
        variants = [
            {
                **_variant(
                    model, asked[0], stack, size, hardware, (steps, batch), float16_steps_batch
                ),
                "asked": asked,
            }
            for asked in groups
            for stack in stacks
        ]
        variants = [_with_data(v, dataset_for(v["batch"])) for v in variants]
        runs = _timed_runs(variants, repeats, progress or (lambda line: None))
    return [_result(model, v, runs[i]) for i, v in enumerate(variants)]


def _check_counts(policies: Sequence[str], steps: int, repeats: int, batch: int | None) -> None:
    """Raises `ValueError` for a policy name that is not one, fewer than 2 steps (a step is
    timed from the end of the first to the end of the last), or fewer than 1 repeat or
    sample, before anything is built."""
    for policy in policies:
        check_policy_name(policy)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(
            "steps must be an integer >= 2 (a step is timed from the end of the first to the "
            f"end of the last). Received: steps={steps!r}"
        )
    check_int_at_least_one("repeats", repeats)
    if batch is not None:
        check_int_at_least_one("batch", batch)


def _timed_runs(
    variants: list[dict[str, Any]],
    repeats: int,
    say: Callable[[str], None],
    notes: Sequence[str] = (),
) -> dict[int, list[float]]:
    """Each variant warmed up, then timed `repeats` times in alternating order: seconds per
    step, per variant. `say` hears each warm-up with the time left in all (the warm-ups still
    to come included: a zoo model's take minutes), then the `notes`, and the time left after
    each round. Nothing before the first warm-up is done, so a model that cannot train under
    its first policy fails on one line."""
    warm: list[float] = []
    walls: list[float] = []
    for i, variant in enumerate(variants):
        start = time.perf_counter()
        timer = time_fit(variant["net"], variant["data"], max(2, variant["steps"] // 4))
        walls.append(time.perf_counter() - start)
        warm.append(timer.per_step)
        say(
            f"warmed up {i + 1}/{len(variants)}: {_label(variant)} "
            f"{1000 * timer.per_step:.1f} ms/step ({walls[-1]:.0f} s with tracing), about "
            f"{_duration(_time_left(variants, repeats, warm, walls))} left in all"
        )
    for note in notes:
        say(note)
    left = sum(repeats * v["steps"] * warm[i] for i, v in enumerate(variants))
    say(f"timing {repeats} runs of each: about {_duration(left)}")
    runs: dict[int, list[float]] = {i: [] for i in range(len(variants))}
    start = time.perf_counter()
    for repeat in range(repeats):
        order = range(len(variants)) if repeat % 2 == 0 else reversed(range(len(variants)))
        for i in order:
            v = variants[i]
            runs[i].append(time_fit(v["net"], v["data"], v["steps"]).per_step)
        # The rounds measured so far, fit's own set-up in each included, time the rest.
        left = (repeats - repeat - 1) * (time.perf_counter() - start) / (repeat + 1)
        say(f"run {repeat + 1}/{repeats} of each done, about {_duration(left)} left")
    return runs


def _time_left(
    variants: list[dict[str, Any]], repeats: int, warm: list[float], walls: list[float]
) -> float:
    """Seconds left after the warm-ups done so far: the warm-ups to come, each taken as long
    as the mean of those done, and every timed run, a variant not warmed up yet taken at the
    mean step time of those that are."""
    per_step = [warm[i] if i < len(warm) else statistics.mean(warm) for i in range(len(variants))]
    timed = sum(repeats * v["steps"] * per_step[i] for i, v in enumerate(variants))
    return (len(variants) - len(walls)) * statistics.mean(walls) + timed


def _label(variant: dict[str, Any]) -> str:
    asked = variant.get("asked") or (variant["policy"],)
    return f"{_policy_label(variant['resolved'], asked)}, {variant['stack']}"


def _duration(seconds: float) -> str:
    """`12 s` or `3.5 min`: an estimate for people."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _result(model: str, variant: dict[str, Any], runs: list[float]) -> BenchResult:
    step_s = statistics.median(runs)
    return BenchResult(
        model=model,
        policy=variant["policy"],
        resolved_policy=variant["resolved"],
        stack=variant["stack"],
        batch=variant["batch"],
        step_ms=1000 * step_s,
        samples_per_s=variant["batch"] / step_s,
        runs_ms=[1000 * r for r in runs],
        asked=tuple(variant.get("asked", (variant["policy"],))),
    )


def format_table(results: Sequence[BenchResult]) -> str:
    """A side-by-side table with the throughput ratio to float32 of the same stack (or of the
    one float32 row a model has): the median over the repeats of each repeat's ratio, and
    their range (`paired_ratios`), with a line that says how to read them."""
    header = (
        f"{'model':12} {'policy':26} {'stack':10} {'batch':>6} {'ms/step':>10} "
        f"{'samples/s':>10} {'vs float32':>10} {'min-max':>11}"
    )
    lines = [header, "-" * len(header)]
    spread = False
    for r in results:
        ratios = paired_ratios(r, results)
        ratio = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        shown = ""
        if len(ratios) > 1 and r.resolved_policy != "float32":
            shown, spread = f"{min(ratios):.2f}-{max(ratios):.2f}x", True
        lines.append(
            f"{r.model:12} {r.label:26} {r.stack:10} {r.batch:6d} {r.step_ms:10.2f} "
            f"{r.samples_per_s:10.1f} {ratio:>10} {shown:>11}".rstrip()
        )
    if spread:
        lines.append(SPREAD_NOTE)
    return "\n".join(lines)


SPREAD_NOTE = (
    "vs float32: the median of the repeats' ratios (each repeat times every row once, back to "
    "back); min-max: their range. A wide range means the machine's speed changed during the "
    "run (other work, clocks): rerun with more --repeats before trusting one figure."
)


def paired_ratios(result: BenchResult, results: Sequence[BenchResult]) -> list[float]:
    """`result`'s throughput over float32's in each repeat, paired by repeat (the runs of
    one repeat are timed back to back), against the float32 row of the same model and stack,
    or the one float32 row of the model; empty where there is none."""
    float32 = [r for r in results if r.model == result.model and r.resolved_policy == "float32"]
    same = [r for r in float32 if r.stack == result.stack]
    base = (same or float32 or [None])[0]
    if base is None:
        return []
    return [
        (result.batch / ms) / (base.batch / base_ms)
        for ms, base_ms in zip(result.runs_ms, base.runs_ms)
    ]


@contextlib.contextmanager
def process_kept() -> Iterator[None]:
    """Within the block bench sets the global policy and may turn grappler's remapper off
    (float16 without a GPU, `cpu_float16`); after it both are as they were, also when it
    raises: a bench leaves the process as it found it."""
    policy = keras.config.dtype_policy()
    with cpu_float16.process_state_kept():
        try:
            yield
        finally:
            keras.config.set_dtype_policy(policy)


def describe_machine() -> dict[str, Any]:
    """The facts a benchmark result needs next to it."""
    hw = detect_hardware()
    return {
        "cpu": hw.cpu_name,
        "cores": os.cpu_count(),
        "gpus": [g.describe() for g in hw.gpus],
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The policy `recommend` picks from measured results.

    Attributes:
        policy: String. The policy to train with.
        stack: String. `"keras"` or `"tfmixprec"` (its CPU routes), as measured.
        speedup: Float. Its throughput over float32's.
        text: String. The printed line.
    """

    policy: str
    stack: str
    speedup: float
    text: str


def recommend(results: Sequence[BenchResult], margin: float = 1.05) -> Recommendation:
    """The fastest measured policy, or float32 when no other ran `margin` times faster: by
    the figure the table shows, the median of the repeats' paired ratios (`paired_ratios`).

    Args:
        results: `BenchResult`s of one model, a float32 one among them.
        margin: Float. How much faster than float32 a low precision must run to be
            recommended over it (its rounding is not free).

    Raises:
        ValueError: If no result is float32, or none is under another policy.
    """
    base = [r for r in results if r.resolved_policy == "float32"]
    if not base:
        raise ValueError("recommend needs a float32 result to compare with; bench float32 too.")
    others = [r for r in results if r.resolved_policy != "float32"]
    if not others:
        raise ValueError("recommend needs a result under another policy than float32 too.")
    speedups = [statistics.median(paired_ratios(r, results)) for r in others]
    speedup = max(speedups)
    best = others[speedups.index(speedup)]
    auto = choose_policy(detect_hardware()).name
    if speedup < margin:
        ran = f" (best: {best.resolved_policy}, {best.stack}, {speedup:.3f}x)"  # 1.045x < 1.05
        text = f"recommended: float32: no other policy ran {margin:.2f}x float32 or faster{ran}"
        if auto != "float32":
            text += f"; set_policy('auto') picks {auto} here, but for this model use float32"
        return Recommendation("float32", base[0].stack, 1.0, text + ".")
    how = " through tfmixprec" if best.stack == "tfmixprec" else ""
    text = f"recommended: {best.resolved_policy}{how}, {speedup:.2f}x float32"
    if auto != best.resolved_policy:
        text += f"; set_policy('auto') picks {auto} here"
    return Recommendation(best.resolved_policy, best.stack, speedup, text + ".")


def run_model_bench(
    spec: str,
    policies: Sequence[str] = MODEL_POLICIES,
    batch: int | None = None,
    steps: int = 10,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[BenchResult]:
    """Times `fit` steps of a zoo model or of your own under each policy, side by side.

    Args:
        spec: String. A zoo name (`tfmixprec.zoo.MODELS`), or `MODULE:FUNCTION` /
            `FILE.py:FUNCTION`: a function that builds and compiles your model under the
            global policy it finds, returning the model (bench makes `synthetic_inputs` and
            targets its loss accepts) or `(model, x, y)` / `(model, x, y, sample_weight)`. It
            is called once per variant.
        policies: List of policy names (`"auto"` allowed); float32 is what ratios compare to.
        batch: Int. Batch size for a function's model (default 32); a zoo model uses its own.
        steps: Int. Steps per timed run.
        repeats: Int. Timed runs per variant (the median is reported).
        progress: Callable taking one line, or None (as in `run_bench`).

    Returns:
        List of `BenchResult`, for `recommend`.
    """
    _check_counts(policies, steps, repeats, batch)
    hardware = detect_hardware()
    source = model_source(spec, batch)
    notes: list[str] = []
    distinct = distinct_policies(policies, hardware)
    variants = [
        {**variant, "asked": asked}
        for asked in distinct
        for variant in source_variants(source, asked[0], steps, hardware, notes)
    ]
    with user_code(spec, "training its model (on made-up data unless it returns (model, x, y))"):
        runs = _timed_runs(variants, repeats, progress or (lambda line: None), notes)
    return [_result(source.name, v, runs[i]) for i, v in enumerate(variants)]
