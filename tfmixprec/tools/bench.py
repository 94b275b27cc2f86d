"""Training step time and throughput per policy, measured side by side in one process.

Used by `tfmixprec bench` and `benchmarks/speedup.py`. Runs alternate between the variants
(A, B, C, A, B, C, ...) so that drift in the machine hits all alike; the figure is the median.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import math
import os
import platform
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._common.layers import iter_layers
from tfmixprec._common.targets import made_up_targets
from tfmixprec._common.validate import check_int_at_least_one
from tfmixprec.fit.training import MixedPrecisionModel, route_slow_cpu_kernels
from tfmixprec.precision import cpu_float16
from tfmixprec.precision.cpu_route import route_of
from tfmixprec.precision.hardware import detect_hardware
from tfmixprec.precision.policy import (
    check_policy_name,
    choose_policy,
    float32_outputs,
    policy_scope,
)
from tfmixprec.tools import zoo

# Internal module (used by `tfmixprec bench` and benchmarks/): the package exports nothing from it.
__all__: list[str] = []

MODELS = ("mlp", "cnn", "transformer")


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


def _data(model: str, batch: int, size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if model == "mlp":
        x = rng.normal(size=(batch, size)).astype("float32")
    elif model == "cnn":
        x = rng.normal(size=(batch, 32, 32, 3)).astype("float32")
    else:
        x = rng.normal(size=(batch, 64, size)).astype("float32")
    y = rng.integers(0, 10, size=(batch,)).astype("int32")
    return x, y


def build_model(model: str, size: int, cls: type = keras.Model) -> keras.Model:
    """A benchmark model whose matmuls dominate its step time.

    Args:
        model: String. `"mlp"` (4 Dense layers of width `size`), `"cnn"` (3 conv blocks on
            32x32x3 with `size // 8` filters) or `"transformer"` (one encoder block, sequence
            64, model width `size`, 4 heads, feed-forward 4x).
        size: Int. The width.
        cls: `keras.Model` or `MixedPrecisionModel`.

    Returns:
        An uncompiled functional model with a float32 softmax output.
    """
    _check_model_size(model, size)
    layers = keras.layers
    if model == "mlp":
        inputs = keras.Input((size,))
        h = inputs
        for _ in range(4):
            h = layers.Dense(size, activation="relu")(h)
    elif model == "cnn":
        inputs = keras.Input((32, 32, 3))
        h = inputs
        filters = max(size // 8, 8)
        for _ in range(3):
            h = layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
            h = layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
            h = layers.MaxPooling2D()(h)
            filters *= 2
        h = layers.GlobalAveragePooling2D()(h)
    else:
        inputs = keras.Input((64, size))
        attended = layers.MultiHeadAttention(4, key_dim=size // 4)(inputs, inputs)
        h = layers.LayerNormalization()(inputs + attended)
        ff = layers.Dense(4 * size, activation="relu")(h)
        h = layers.LayerNormalization()(h + layers.Dense(size)(ff))
        h = layers.GlobalAveragePooling1D()(h)
    outputs = layers.Dense(10, activation="softmax")(h)
    built = cls(inputs, outputs)
    float32_outputs(built)
    return built


def _check_model_size(model: str, size: int) -> None:
    """Raises `ValueError` for a built-in model name not in `MODELS`, or a width it cannot
    have (the transformer's 4 heads need a width of 4 or more)."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}. Received: model={model!r}")
    if model == "transformer" and size < 4:
        raise ValueError(
            "The transformer's width must be at least 4 (4 attention heads of width "
            f"size // 4). Received: size={size!r}; pass --size 4 or more."
        )


def _footprint(model: str, size: int) -> tuple[int, int]:
    """A built-in model's parameters, and the values one sample's training step keeps (its
    input and each layer's output), from its width: what `_check_bench_memory` counts."""
    _check_model_size(model, size)
    if model == "mlp":
        return 4 * size * (size + 1) + 10 * (size + 1), 5 * size
    if model == "cnn":
        f = max(size // 8, 8)
        convolutions = [(3, f), (f, f), (f, 2 * f), (2 * f, 2 * f), (2 * f, 4 * f), (4 * f, 4 * f)]
        parameters = sum(9 * a * b + b for a, b in convolutions) + 10 * (4 * f + 1)
        return parameters, 32 * 32 * 3 + 4032 * f  # convolutions and poolings, 32x32 to 4x4
    heads = 4 * (size // 4)  # 4 heads of key_dim size // 4
    attention = 3 * (size * heads + heads) + heads * size + size
    feed_forward = size * 4 * size + 4 * size + 4 * size * size + size
    parameters = attention + 2 * 2 * size + feed_forward + 10 * (size + 1)
    return parameters, 64 * 15 * size + 4 * 64 * 64  # sequence 64; the scores of 4 heads


def _free_memory() -> int | None:
    """Bytes of memory free for new work here: Linux's MemAvailable (or the physical memory),
    at most what a cgroup v2 limit leaves; None where none of them can be read."""
    free = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    if free is None:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(OSError, ValueError):
        cgroup = Path("/sys/fs/cgroup")
        limit = int((cgroup / "memory.max").read_text())  # "max": no limit, a ValueError
        left = limit - int((cgroup / "memory.current").read_text())
        free = left if free is None else min(free, left)
    return free


def _bytes_text(count: float) -> str:
    """`22.9 GB`: a memory size for people (powers of 1000)."""
    for unit in ("bytes", "kB", "MB", "GB", "TB", "PB"):
        if count < 1000 or unit == "PB":
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def _too_large(what: str, needed: int, free: int, fix: str) -> ValueError:
    return ValueError(
        f"{what} needs at least {_bytes_text(needed)} of memory, more than the "
        f"{_bytes_text(free)} free here. {fix}"
    )


def _check_memory(needed: int, what: str, fix: str) -> None:
    """Raises `ValueError` when `needed` bytes are more than `_free_memory()`: before bench
    allocates them, where running out would end the process or raise deep inside TensorFlow.

    Args:
        needed: Int. The bytes the work needs at least.
        what: String. The work and the values that size it, to start the message.
        fix: String. What to do instead, to end it.
    """
    free = _free_memory()
    if free is not None and needed > free:
        raise _too_large(what, needed, free, fix)


def _bench_bytes(model: str, size: int, batch: int, models: int) -> int:
    """At least the memory `models` built-in models side by side take to train: each
    parameter in float32 with its gradient and Adam's two moments, and a batch's values
    kept for the backward pass with their gradients."""
    parameters, values = _footprint(model, size)
    return models * (16 * parameters + 8 * batch * values)


def _largest_size(model: str, size: int, batch: int, models: int, free: int) -> int:
    """The largest width below `size` whose models fit in `free` bytes; 0 if none does."""
    smallest = 4 if model == "transformer" else 1
    low, high = smallest - 1, size  # the answer is in [low, high)
    while high - low > 1:
        middle = (low + high) // 2
        if _bench_bytes(model, middle, batch, models) <= free:
            low = middle
        else:
            high = middle
    return low if low >= smallest else 0


def _check_bench_memory(model: str, size: int, batch: int, models: int) -> None:
    """Refuses a built-in model too large for this machine's memory before building it,
    with the largest `size` that fits (or, if none does, a smaller batch to pass).

    Raises:
        ValueError: If `models` models of `size` training on `batch` samples need more than
            `_free_memory()`.
    """
    needed = _bench_bytes(model, size, batch, models)
    free = _free_memory()
    if free is None or needed <= free:
        return
    largest = _largest_size(model, size, batch, models, free)
    what = (
        f"--model {model} --size {size} --batch-size {batch} "
        f"({_footprint(model, size)[0]:.2g} parameters a model, {models} models side by side)"
    )
    fix = f"Pass --size {largest} or less." if largest else "Pass a smaller --batch-size."
    raise _too_large(what, needed, free, fix)


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
    _check_bench_memory(model, size, batch, len(groups) * len(stacks))
    datasets: dict[int, tf.data.Dataset] = {}

    def dataset_for(n: int) -> tf.data.Dataset:
        if n not in datasets:
            x, y = _data(model, n, size)
            datasets[n] = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(2)
        return datasets[n]

    float16_steps_batch = (float16_steps, float16_batch)
    sized = f"--model {model} --size {size} --batch-size {batch}: training"
    with _out_of_memory(sized, "Pass a smaller --size or --batch-size."):
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


# ------------------------------------------------------------------ the user's own model
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


# Benched for a model of the user's when no policies are given.
MODEL_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
_SPEC_HELP = (
    "Pass a built-in model (mlp, cnn, transformer), a zoo model (gpt2, llama, gemma, mistral, "
    "bert, vit, resnet, mobilenet), or a function that builds and compiles yours: "
    "MODULE:FUNCTION or FILE.py:FUNCTION"
)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A model to bench, built afresh under each policy.

    Attributes:
        name: String. The model's name in the table.
        build: Callable `build() -> (model, dataset, batch)`: a compiled model, built under
            the current global policy, and a repeated `tf.data.Dataset` of its batches.
    """

    name: str
    build: Callable[[], tuple[keras.Model, tf.data.Dataset, int]]


def load_function(spec: str) -> Callable[[], Any]:
    """The function `MODULE:FUNCTION` or `FILE.py:FUNCTION` names (a file is run as a module).

    Raises:
        ValueError: If `spec` has another form, or names no importable function.
    """
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise ValueError(f"Unknown model {spec!r}. {_SPEC_HELP}.")
    if where.endswith(".py") and not Path(where).is_file():
        raise ValueError(f"No file {where!r} (from --model {spec!r}). {_SPEC_HELP}.")
    with _user_code(spec, f"importing {where!r}"):
        module = _import(where)
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"{where!r} has no function {name!r} (from --model {spec!r}).")
    return function


def _import(where: str) -> Any:
    """A file run as a module, or a module imported as `python -m` would: from the current
    folder first (a console script does not put it on the path)."""
    if where.endswith(".py"):
        path = Path(where)
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(where)
    finally:
        if added:
            sys.path.remove(os.getcwd())


_FIX_THERE = "Fix it there (run it in Python for the traceback)."
_RETURN_DATA = "Return (model, x, y) from your function."
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Keras's bold in its call errors
# TensorFlow's and Keras's wrapping around a message: the graph's traceback, the node and op.
_WRAPPING = re.compile(
    r"^(Graph execution error:|Detected at node |\s*File \"|Exception encountered when "
    r"calling |Arguments received by |\s+\u2022 |\s*\[\[\{\{node )"
)
_TF_NAMES = re.compile(r"\{\{function_node [^}]*\}\}\s*|\s*\[Op:[^\]]*\](\s*name:.*)?")


def _error_line(error: BaseException, limit: int = 300) -> str:
    """`error`'s message in one line: its first paragraph without TensorFlow's graph traceback,
    node and op names, Keras's call wrapping or terminal colours, cut at `limit` characters;
    "" if nothing is left."""
    text = _TF_NAMES.sub("", _ANSI.sub("", str(error)))
    paragraph: list[str] = []
    for line in text.splitlines():
        if _WRAPPING.match(line):
            continue
        if line.strip():
            paragraph.append(line.strip())
        elif paragraph:
            break
    line = " ".join(paragraph)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _raised(error: BaseException) -> str:
    """`RuntimeError: no GPU quota.`: what a user's code raised, as a sentence."""
    line = _error_line(error)
    text = f"{type(error).__name__}: {line}" if line else type(error).__name__
    return text if text.endswith(".") else text + "."


@contextlib.contextmanager
def _out_of_memory(doing: str, fix: str) -> Iterator[None]:
    """TensorFlow or NumPy running out of memory in the block, as one `ValueError` that says
    what ran out (`doing`: the values that sized it, then the work) and what to do (`fix`)."""
    try:
        yield
    except (tf.errors.ResourceExhaustedError, MemoryError) as error:
        raise ValueError(f"{doing} ran out of memory ({_error_line(error)}). {fix}") from None


@contextlib.contextmanager
def _user_code(spec: str, doing: str, fix: str = _FIX_THERE) -> Iterator[None]:
    """The user's code (their function, their model) failing, as a `ValueError` of one line
    that names it, says what it was doing and what to do (the traceback: run it in Python)."""
    smaller = "Build a smaller model, or pass a smaller --batch-size."
    with _out_of_memory(f"--model {spec!r}: {doing}", smaller):
        try:
            yield
        except ModuleNotFoundError as error:
            raise ValueError(
                f"Cannot import {error.name!r} (from --model {spec!r}): {error}"
            ) from None
        except (tf.errors.ResourceExhaustedError, MemoryError):
            raise  # said by _out_of_memory
        except Exception as error:  # noqa: BLE001 (the user's code may raise anything)
            raise ValueError(f"--model {spec!r}: {doing} raised {_raised(error)} {fix}") from None


def _input_bytes(source: str, spec: Any, batch: int) -> int:
    """The bytes of a batch of made-up data for the symbolic input `spec` (float64 as drawn);
    a `ValueError` that names `source` if bench cannot make it (an unknown dimension, not a
    number)."""
    shape, dtype = (batch, *spec.shape[1:]), str(spec.dtype)
    if None in shape:
        raise ValueError(
            f"{source}: its model's input {spec.name!r} has shape {tuple(spec.shape)}: bench "
            "cannot make data for it. Return (model, x, y) from your function."
        )
    if not any(kind in dtype for kind in ("int", "bool", "float")):
        raise ValueError(
            f"{source}: its model's input {spec.name!r} has dtype {dtype}: bench makes "
            "numbers only. Return (model, x, y) from your function."
        )
    return 8 * math.prod(shape)


def synthetic_inputs(model: keras.Model, batch: int, seed: int = 0, source: str = "bench") -> Any:
    """One batch of inputs for `model`, in its inputs' structure: floats from N(0, 1) and
    integer inputs of ones (a valid token and a full mask).

    Args:
        model: `keras.Model`. A functional or `Sequential` model.
        batch: Int. The batch size.
        seed: Int. The floats' seed.
        source: String. Where the model comes from (`--model 'my.py:build'`), to start an
            error's message.

    Raises:
        ValueError: If the model has no symbolic inputs (a subclassed model), one with an
            unknown dimension or of another dtype than numbers, or the batch would not fit
            in memory.
    """
    inputs = _symbolic_inputs(source, model)
    needed = sum(_input_bytes(source, spec, batch) for spec in keras.tree.flatten(inputs))
    what = f"{source} --batch-size {batch}: a batch of made-up inputs for its model"
    _check_memory(needed, what, "Pass a smaller --batch-size.")
    rng = np.random.default_rng(seed)

    def value(spec: Any) -> np.ndarray:
        shape, dtype = (batch, *spec.shape[1:]), str(spec.dtype)
        if "int" in dtype or "bool" in dtype:
            return np.ones(shape, dtype)
        return rng.normal(size=shape).astype(dtype)

    with _out_of_memory(what, "Pass a smaller --batch-size."):
        return keras.tree.map_structure(value, inputs)


def synthetic_targets(model: keras.Model, x: Any) -> tuple[Any, Any, str]:
    """`model`'s outputs on `x` (one inference call: the model's own code runs, so call it
    where its errors are the user's), targets its compiled loss accepts (`made_up_targets`:
    integer labels for a sparse loss, ...) and what they are in words."""
    outputs = model(x, training=False)
    return outputs, *made_up_targets(model, outputs)


def _symbolic_inputs(source: str, model: keras.Model) -> Any:
    """A functional model's inputs in their structure (a dict for KerasHub's), a
    `Sequential`'s input tensor."""
    try:
        return model.input
    except (AttributeError, ValueError):
        inputs = getattr(model, "inputs", None)  # a Sequential has these only
    if not inputs:
        raise ValueError(
            f"{source}: its model {model.name!r} has no symbolic inputs (a subclassed model): "
            "bench cannot make data for it. Return (model, x, y) from your function."
        )
    return inputs[0] if len(inputs) == 1 else inputs


def _tuples(value: Any) -> Any:
    """Lists as tuples, nested: `tf.data` reads a list as one tensor, a tuple as a structure
    (a model with several inputs)."""
    if isinstance(value, list | tuple):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def _model_and_batches(
    spec: str, returned: Any, batch: int
) -> tuple[keras.Model, tf.data.Dataset, int]:
    model, *data = returned if isinstance(returned, tuple) else (returned,)
    if not isinstance(model, keras.Model) or len(data) not in (0, 2, 3):
        raise TypeError(
            f"{spec} must return a compiled keras.Model, or (model, x, y) or (model, x, y, "
            f"sample_weight). Received: {type(returned).__name__}"
        )
    if not model.compiled:
        raise ValueError(
            f"{spec} returned model {model.name!r} not compiled: compile it in the function "
            "(model.compile(optimizer=..., loss=...)), as you train it."
        )
    if not data:
        x = synthetic_inputs(model, batch, source=f"--model {spec!r}")
        made_up = "calling its model on made-up inputs (floats from N(0, 1), integers of ones)"
        with _user_code(spec, made_up, _RETURN_DATA):
            outputs, y, what = synthetic_targets(model, x)
        with _user_code(spec, f"computing its loss on made-up targets ({what})", _RETURN_DATA):
            model.compute_loss(x, y, outputs)
        return model, tf.data.Dataset.from_tensors(_tuples((x, y))).repeat(), batch
    data = _tuples(data)
    _check_samples(spec, data, batch)
    batches = tf.data.Dataset.from_tensor_slices(tuple(data)).batch(batch, drop_remainder=True)
    return model, batches.repeat(), batch


def _check_samples(spec: str, data: tuple[Any, ...], batch: int) -> None:
    """Raises `ValueError` unless each array a function returned (x, y, sample_weight, nested)
    has the same number of samples along its first dimension, `batch` or more."""
    arrays = keras.tree.flatten(data)
    counts = sorted({np.shape(array)[0] if np.ndim(array) else 0 for array in arrays})
    if 0 in counts:
        kinds = sorted({type(a).__name__ for a in arrays if not np.ndim(a) or not len(a)})
        raise ValueError(
            f"{spec} returned data without samples (a {', '.join(kinds)}): return x and y "
            "(and sample_weight) as arrays with one row a sample."
        )
    if len(counts) > 1:
        raise ValueError(
            f"{spec} returned arrays of {' and '.join(map(str, counts))} samples: return x and "
            "y (and sample_weight) with as many rows each."
        )
    if counts[0] < batch:
        raise ValueError(
            f"{spec} returned {counts[0]} samples, fewer than the batch size {batch}: return "
            "more, or pass a smaller --batch-size."
        )


def model_source(spec: str, batch: int | None = None) -> ModelSource:
    """What `run_model_bench` benches for `spec`: a zoo model at its `"bench"` size, or the
    model a function builds (`load_function`), with its data or made-up inputs
    (`synthetic_inputs`) and targets its loss accepts."""
    if spec in zoo.MODELS:

        def build_zoo() -> tuple[keras.Model, tf.data.Dataset, int]:
            entry = zoo.build(spec, size="bench")
            entry.model.compile(optimizer="adam", loss=entry.loss)
            return entry.model, entry.dataset(4), entry.batch_size

        return ModelSource(spec, build_zoo)
    function = load_function(spec)
    size = 32 if batch is None else batch

    def build_function() -> tuple[keras.Model, tf.data.Dataset, int]:
        with _user_code(spec, "calling it"):
            returned = function()
        return _model_and_batches(spec, returned, size)

    return ModelSource(spec.rpartition(":")[2], build_function)


def _source_variants(
    source: ModelSource, policy: str, steps: int, hardware: Any, notes: list[str]
) -> list[dict[str, Any]]:
    """One variant per stack: float32 once; each low precision plain and through tfmixprec's
    CPU routes, the latter only where a route changes a layer (else it is the same step, and
    a line in `notes` says so); float16 on a CPU only through the routes (plain Keras float16
    there takes minutes a step, benchmarks/RESULTS.md 2b)."""
    resolved = choose_policy(hardware).name if policy == "auto" else check_policy_name(policy)
    stacks = ["keras", "tfmixprec"]
    if resolved == "float32":
        stacks = ["keras"]
    elif resolved == "mixed_float16" and not hardware.gpus and not hardware.tpus:
        stacks = ["tfmixprec"]
    variants = []
    for stack in stacks:
        with warnings.catch_warnings():
            # float16 without a GPU: bench measures it on purpose (set_policy's warning).
            warnings.filterwarnings("ignore", "mixed_float16 without a GPU", UserWarning)
            with policy_scope(resolved, hardware):
                keras.utils.set_random_seed(0)
                net, data, batch = source.build()
        if stack == "tfmixprec":
            route_slow_cpu_kernels(net)
            if variants and not any(route_of(layer) for layer in iter_layers(net)):
                notes.append(
                    f"{resolved}, tfmixprec: no layer to route here, the same step as keras"
                )
                continue
        variant = dict(policy=policy, resolved=resolved, stack=stack, net=net, steps=steps)
        variants.append({**variant, "batch": batch, "data": data})
    return variants


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
        for variant in _source_variants(source, asked[0], steps, hardware, notes)
    ]
    with _user_code(spec, "training its model (on made-up data unless it returns (model, x, y))"):
        runs = _timed_runs(variants, repeats, progress or (lambda line: None), notes)
    return [_result(source.name, v, runs[i]) for i, v in enumerate(variants)]
