"""What the zoo tests run on each real model (`tfmixprec.zoo`), once per model and policy.

One `ZooRun` per (model, policy) does the work a user does: build, audit, `float32_outputs`,
compile with `"adam"` the Keras way, `fit` with every tfmixprec callback (`diagnose=`
included), `overflow_report`, `explain_overflow`, the float16 CPU route, save as `.keras`,
load and audit the file with the command; the tests then assert on what it recorded. Sizes
are tiny (`zoo.build(size="tiny")`) so the zoo stays a small share of the suite.
"""

from __future__ import annotations

import dataclasses
import io
import math
import warnings
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import keras
import numpy as np

import tfmixprec
from tfmixprec.tools import bench, cli, zoo

STEPS = 3  # training steps of every run (the parity compares each of them)

# Machine epsilon of each compute dtype (2^-(mantissa bits)).
EPSILON = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}


def loss_tolerance(dtype: str, steps: int) -> float:
    """How far (relative) a model's loss in `dtype` may be from its float32 loss, step by step,
    after `steps` training steps from the same weights and data.

    Each step's forward pass rounds every activation to `dtype` (relative error about eps per
    layer, averaging out over a batch's many values); each applied step then moves the weights
    by Adam's `lr * m / sqrt(v)`, which rounding changes by about `lr * eps`. So the distance
    grows like eps times the steps: 2 eps per step taken, plus 2 eps for the first forward
    pass. That is 3.1% for bfloat16 and 0.4% for float16 after 3 steps; measured on the tiny
    zoo at most 0.6% and 0.07% (an AMD EPYC with AVX512_BF16); a model that computes a layer
    wrongly is off by far more (its loss is another number entirely).
    """
    return 2.0 * EPSILON[dtype] * (1 + steps)


@dataclasses.dataclass
class ZooRun:
    """What one model under one policy did (see the module docstring)."""

    name: str
    policy: str
    audit_before: tfmixprec.AuditReport
    float32_changes: list
    float32_warnings: list[str]
    audit_after: tfmixprec.AuditReport
    losses: list[float]
    callbacks_out: str
    monitor: Any
    guard: Any
    overflow_steps: int
    report: Any
    diagnosis: Any
    gradient_stats: Any
    cpu_route: dict
    saved: Any

    @property
    def dtype(self) -> str:
        return keras.DTypePolicy(self.policy).compute_dtype


def train_losses(name: str, policy: str) -> list[float]:
    """The per-step losses of `STEPS` steps of `fit` (Adam) from the zoo's seed: the reference
    the tests compare with. Its optimizer's variables are made before `fit` (as Keras makes
    them under a distribution strategy): left to `fit`, its first trace makes them and
    TensorFlow traces the step again. The losses are the same."""
    with tfmixprec.policy_scope(policy):
        entry = zoo.build(name)
        entry.model.compile(optimizer="adam", loss=entry.loss)
        entry.model.optimizer.build(entry.model.trainable_variables)
    x, y, weights = entry.data(STEPS)
    record = bench.StepLosses()
    keras.utils.set_random_seed(1)  # the same dropout masks under every policy
    entry.model.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=entry.batch_size,
        shuffle=False,
        verbose=0,
        callbacks=[record],
    )
    return record.losses


def run(name: str, policy: str, folder: Path) -> ZooRun:
    """Everything the tests check on one zoo model under one policy (see the module
    docstring)."""
    with tfmixprec.policy_scope(policy):
        entry = zoo.build(name)
        model = entry.model
        audit_before = tfmixprec.audit(model)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            changes = tfmixprec.float32_outputs(model)
        audit_after = tfmixprec.audit(model)
        model.compile(optimizer="adam", loss=entry.loss)
        if not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
            # As `train_losses` (the step traced once); the callbacks make the variables of
            # the tfmixprec optimizer they put in place of Keras's before `fit` themselves.
            model.optimizer.build(model.trainable_variables)
    x, y, weights = entry.data(STEPS)
    batch = _first_batch(entry, x, y, weights)
    cpu_route = _cpu_route(model, batch)
    monitor = tfmixprec.LossScaleMonitor(verbose=1, update_freq=1, diagnose=1)
    guard = tfmixprec.OverflowGuard(patience=50, max_consecutive=50)
    board = tfmixprec.TensorBoard(str(folder / "logs"), update_freq=1, diagnose=1)
    ranges = tfmixprec.GradientRangeMonitor(batch, update_freq=2)
    record = bench.StepLosses()
    printed = io.StringIO()
    keras.utils.set_random_seed(1)  # the same dropout masks as `train_losses`
    with redirect_stdout(printed):
        model.fit(
            x,
            y,
            sample_weight=weights,
            batch_size=entry.batch_size,
            shuffle=False,
            verbose=0,
            callbacks=[record, monitor, guard, board, ranges],
        )
    try:
        report = tfmixprec.overflow_report(model)
    except TypeError as err:  # no loss scaling (bfloat16 with Keras's compile): nothing kept
        report = err
    state = model.optimizer.read_state() if hasattr(model.optimizer, "read_state") else {}
    return ZooRun(
        name=name,
        policy=policy,
        audit_before=audit_before,
        float32_changes=changes,
        float32_warnings=[str(w.message) for w in said],
        audit_after=audit_after,
        losses=record.losses,
        callbacks_out=printed.getvalue(),
        monitor=monitor,
        guard=guard,
        overflow_steps=int(state.get("overflow_steps", 0)),
        report=report,
        diagnosis=tfmixprec.explain_overflow(model, batch),
        gradient_stats=ranges.weight_stats,
        cpu_route=cpu_route,
        saved=_save_and_audit(model, policy, folder, batch),
    )


def _first_batch(entry: Any, x: Any, y: Any, weights: Any) -> tuple:
    n = entry.batch_size
    first = keras.tree.map_structure(lambda a: a[:n], x)
    return (first, y[:n]) if weights is None else (first, y[:n], weights[:n])


def _cpu_route(model: Any, batch: tuple) -> dict:
    """The float16 CPU route (`cpu_float16.fast_float16_layers`), as a user of a plain model
    takes it before training: the layers it changes and the largest distance of the
    predictions from the model's own, relative to their largest magnitude."""
    before = np.asarray(model(batch[0], training=False), "float32")
    routed = tfmixprec.cpu_float16.fast_float16_layers(model)
    after = np.asarray(model(batch[0], training=False), "float32")
    scale = max(float(np.abs(before).max()), 1e-6)
    return {"layers": routed, "distance": float(np.abs(after - before).max()) / scale}


@dataclasses.dataclass
class Saved:
    """The `.keras` file of a trained zoo model: `tfmixprec audit FILE`'s exit code and output,
    the loaded model's changes from `float32_outputs` and whether its predictions then equal
    the trained model's."""

    exit_code: int
    audit_out: str
    changes_after_loading: list
    same_predictions: bool


def _save_and_audit(model: Any, policy: str, folder: Path, batch: tuple) -> Saved:
    path = folder / f"{model.name}.keras"
    model.save(path)
    printed = io.StringIO()
    with redirect_stdout(printed):
        code = cli.main(["audit", str(path)])
    with tfmixprec.policy_scope(policy), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras's own, about a KerasHub task's custom compile
        loaded = keras.models.load_model(path)
        changes = tfmixprec.float32_outputs(loaded)  # as after training: warns again
    # As after training: the callbacks in `fit` routed the trained model (fit/adoption.py).
    tfmixprec.cpu_float16.fast_float16_layers(loaded)
    tfmixprec.cpu_bfloat16.fast_bfloat16_layers(loaded)
    same = all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(
            keras.tree.flatten(model(batch[0], training=False)),
            keras.tree.flatten(loaded(batch[0], training=False)),
        )
    )
    return Saved(code, printed.getvalue(), [c.layer for c in changes], same)


def relative_distance(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference) if math.isfinite(a))
