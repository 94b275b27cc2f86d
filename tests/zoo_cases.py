"""The zoo tests, shared by `test_zoo_decoders.py` and `test_zoo_encoders.py` (two files, so that
pytest-xdist's `--dist loadfile` runs them in both processes). Each test reads the `ZooRun` of
one model under one policy (`zoo_checks.run`, once per module and case).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import zoo_checks

from tfmixprec.precision.hardware import detect_hardware
from tfmixprec.scaling.attribution import OverflowReport

POLICIES = ("mixed_float16", "mixed_bfloat16")
# What `float32_outputs` must change: the classifiers' heads compute in the policy's dtype; the
# causal LMs' logits are float32 already (their tied embedding's reverse projection).
HEADS = {"bert": ["logits"], "vit": ["predictions"], "resnet": ["predictions"]}


def make_fixtures(names: tuple[str, ...]):
    """The module's fixtures: `zoo_run` (one per model and policy) and `float32_losses`."""

    @pytest.fixture(scope="module", params=[(n, p) for n in names for p in POLICIES], ids=str)
    def zoo_run(request, tmp_path_factory):
        name, policy = request.param
        folder = tmp_path_factory.mktemp(f"{name}-{policy}")
        return zoo_checks.run(name, policy, folder)

    @pytest.fixture(scope="module")
    def float32_losses():
        cache = {}

        def losses(name):
            if name not in cache:
                cache[name] = zoo_checks.train_losses(name, "float32")
            return cache[name]

        return losses

    return zoo_run, float32_losses


def test_every_audit_error_is_true_and_float32_outputs_fixes_it(zoo_run):
    """The only errors are model outputs a real call returns in float16/bfloat16 (the
    classifiers' heads); the causal LMs have none; no softmax inside is flagged."""
    errors = [(f.code, f.layer) for f in zoo_run.audit_before.errors]
    heads = HEADS.get(zoo_run.name, [])
    assert errors == [("low-precision-output", head) for head in heads]
    assert [c.layer for c in zoo_run.float32_changes] == heads
    assert zoo_run.audit_after.errors == []


def test_no_warnings_the_tiny_models_products_are_too_small_for_alignment(zoo_run):
    """Tensor Core sizes are the audit's only warnings, and only for products whose N and K
    are both 128 or more (`audit.LARGE_PRODUCT`): the tiny zoo models have none (their
    grouped-query projections of 2 or 1 heads of 8 and their 10-class heads among them), so
    no warning, nor an alignment info on a machine without a GPU."""
    assert zoo_run.audit_before.warnings == []
    assert [f for f in zoo_run.audit_before.findings if f.code == "tensor-core-alignment"] == []


def test_fit_with_every_callback(zoo_run):
    out = zoo_run.callbacks_out
    assert len(zoo_run.losses) == zoo_checks.STEPS and all(map(math.isfinite, zoo_run.losses))
    assert zoo_run.guard.stopped_step is None
    if zoo_run.dtype == "float16":
        assert "LossScaleMonitor replaced the keras.optimizers.LossScaleOptimizer" in out
        assert zoo_run.overflow_steps == 0  # no skipped step at 2^15 for these models
        assert zoo_run.monitor.diagnoses == []  # so nothing to replay
    else:
        assert "no loss scaling needed" in out and "it computes in bfloat16" in out
    assert zoo_run.gradient_stats is not None and zoo_run.gradient_stats.count > 0


def test_overflow_report_and_explain_overflow(zoo_run):
    if zoo_run.dtype == "float16":
        assert isinstance(zoo_run.report, OverflowReport) and zoo_run.report.overflow_steps == 0
    else:  # Keras's compile gives a bfloat16 model no loss scaling: nothing is attributed
        assert isinstance(zoo_run.report, TypeError)
        assert "needs no loss scaling" in str(zoo_run.report)
    diagnosis = zoo_run.diagnosis
    # A bfloat16 model keeps gradients below 2^-24: never an `underflow` verdict there.
    allowed = ("none", "underflow") if zoo_run.dtype == "float16" else ("none",)
    assert diagnosis.cause in allowed, diagnosis
    assert all(math.isfinite(row.max_abs) for row in diagnosis.layers)


def test_cpu_float16_route(zoo_run):
    route = zoo_run.cpu_route
    if zoo_run.dtype == "float16":
        # Its convolutions and attention with dropout; its Dense and EinsumDense only on a CPU
        # without AVX512_FP16 (with it, a decoder without dropout may have none to route).
        assert route["layers"] or detect_hardware().cpu_float16
        # float32 products rounded to float16: a few float16 roundings apart.
        assert route["distance"] <= 8 * zoo_checks.EPSILON["float16"]
    else:
        assert route == {"layers": [], "distance": 0.0}


def test_saved_file_loads_and_audits(zoo_run):
    """`tfmixprec audit FILE` tells the truth about the file: a KerasHub task rebuilds its head
    from its own arguments, so the float32 head set by `float32_outputs` is float16/bfloat16
    again after loading (and `float32_outputs` warned of it); calling it again after loading
    gives the trained model's predictions bit for bit."""
    saved, heads = zoo_run.saved, HEADS.get(zoo_run.name, [])
    assert saved.exit_code == (1 if heads else 0), saved.audit_out
    for head in heads:
        assert f"ERROR   low-precision-output [{head}]" in saved.audit_out
        assert any("config does not record layer dtypes" in w for w in zoo_run.float32_warnings)
    assert saved.changes_after_loading == heads
    assert saved.same_predictions


def test_loss_within_rounding_of_float32(zoo_run, float32_losses):
    reference = float32_losses(zoo_run.name)
    tolerance = zoo_checks.loss_tolerance(zoo_run.dtype, zoo_checks.STEPS)
    distance = zoo_checks.relative_distance(zoo_run.losses, reference)
    assert distance <= tolerance, (zoo_run.losses, reference)
    assert np.isfinite(zoo_run.losses).all()
