"""KerasHub's BERT and ViT classifiers and a ResNet under mixed_float16 and mixed_bfloat16 (the
checks of `zoo_cases`), and what only some models show: `diagnose=` on a KerasHub task model
that overflows, `keras.applications`' MobileNetV3 audited.
"""

import sys

import keras
import pytest
from zoo_cases import *  # noqa: F403  (the shared tests)
from zoo_cases import make_fixtures

import tfmixprec
from tfmixprec.tools import zoo

zoo_run, float32_losses = make_fixtures(("bert", "vit", "resnet"))


# ------------------------------------------------------------------ only some models show it
def test_diagnose_on_a_kerashub_task_model_that_overflows(capsys):
    """GPT-2 compiled the Keras way, its LossScaleOptimizer started at 2^40: the first step's
    gradients overflow; the callback adopts the optimizer, keeps the batch through the task's
    own train_step and replays it."""
    with tfmixprec.policy_scope("mixed_float16"):
        entry = zoo.build("gpt2")
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(), 2.0**40)
        entry.model.compile(optimizer=optimizer, loss=entry.loss)
    x, y, weights = entry.data(2)
    monitor = tfmixprec.LossScaleMonitor(verbose=1, update_freq=100, diagnose=1)
    entry.model.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=entry.batch_size,
        shuffle=False,
        verbose=0,
        callbacks=[monitor],
    )
    ((step, diagnosis),) = monitor.diagnoses
    assert (step, diagnosis.cause, diagnosis.loss_scale) == (0, "backward-overflow", 2.0**40)
    assert diagnosis.halvings >= 1 and diagnosis.finite_scale == 2.0**40 / 2**diagnosis.halvings
    assert diagnosis.layer is not None  # the first layer whose gradients overflowed
    printed = capsys.readouterr().out
    assert "overflow step 0 (0-based, skipped steps counted): backward-overflow in layer" in printed
    # No keeping after the fit (the step keeps the state guard of the adopted optimizer).
    assert not hasattr(vars(entry.model)["train_step"], "_tfmixprec_replaced_step")
    assert vars(entry.model)["train_step"].tfmixprec_guarded


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mobilenet_v3_audit(policy):
    """keras.applications' MobileNetV3Small: its softmax output is the one error (its
    hard-sigmoid squeeze-and-excitation gates inside are not flagged); its convolutions are
    too small for their Tensor Core alignment to matter (`audit.LARGE_PRODUCT`)."""
    with tfmixprec.policy_scope(policy):
        model = zoo.build("mobilenet").model
    report = tfmixprec.audit(model)
    assert [(f.code, f.layer) for f in report.errors] == [("low-precision-softmax", "predictions")]
    assert report.warnings == []
    assert [c.layer for c in tfmixprec.float32_outputs(model)] == ["predictions"]
    assert tfmixprec.audit(model).errors == []


def test_zoo_bad_input(monkeypatch):
    with pytest.raises(
        ValueError, match=r"Unknown zoo model. Valid names: gpt2, .*Received: 'gpt3'"
    ):
        zoo.build("gpt3")
    with pytest.raises(ValueError, match=r"Valid sizes: tiny, bench. Received: 'huge'"):
        zoo.build("gpt2", size="huge")
    with pytest.raises(ValueError, match=r"Received: \['gpt2'\]"):
        zoo.build(["gpt2"])
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # as if keras-hub were not installed
    with pytest.raises(ImportError, match=r"'bert' is a KerasHub model: pip install keras-hub"):
        zoo.build("bert")
    assert zoo.build("mobilenet").model.name == "MobileNetV3Small"  # keras.applications
