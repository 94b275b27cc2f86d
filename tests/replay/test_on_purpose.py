"""Values that are not finite on purpose (a float32 `-inf` key mask) are not the overflow,
and an underflow to 0 before a `log` is named as one: `explain_overflow`, `calibrate` and
`PrecisionRepair` alike."""

import re

import keras
import numpy as np
import pytest
from masked_models import log_softmax_model, masked_data, masked_model

import tfmixprec
from tfmixprec._common.layers import layer_names
from tfmixprec.replay.calibration import Replayer, float32_set

WIDE = (
    "256 NaN/Inf in its output; its outputs reach 1e+05 in float32, past float16's 65504; it "
    'would be finite in float32 and bfloat16. Run it in float32 (dtype="float32" on the '
    "layer), or use mixed_bfloat16."
)


@pytest.mark.parametrize("fill", [-np.inf, -1e9])
def test_a_minus_inf_mask_is_not_the_overflow(fill):
    """The mask is `-inf` in float32 too, and the loss and gradients are finite there: the
    overflow is `wide`'s, as with a finite `-1e9` mask (the `-inf` mask was blamed: "not
    finite even in float32 ... diverge", and nothing was moved)."""
    model = masked_model(fill)
    batch = masked_data()
    diagnosis = tfmixprec.explain_overflow(model, batch)
    assert (diagnosis.cause, diagnosis.layer, diagnosis.message) == (
        "forward-overflow",
        "wide",
        WIDE,
    )
    mask = next(row for row in diagnosis.layers if row.layer == "mask")
    assert (mask.inf, mask.float32_max_abs) == ((32, np.inf) if fill < -1e9 else (0, 1e9))


@pytest.mark.parametrize("fill", [-np.inf, -1e9])
def test_calibrate_moves_past_a_minus_inf_mask(fill):
    """`calibrate` and `float32_set` (`PrecisionRepair`'s verdict): `wide` and `down`, as with
    a finite mask (the `-inf` mask was "not-precision": nothing to move)."""
    model = masked_model(fill)
    batch = masked_data()
    report = tfmixprec.calibrate(model, batch, steps=1)
    assert (report.cause, report.float32_layers, report.problem) == (
        "forward-overflow",
        ("wide", "down"),
        None,
    )
    found = float32_set(Replayer(model, [(*batch, None)], keras.losses.MeanSquaredError()))
    names = layer_names(model)
    assert [names[id(layer)] for layer, _ in found.layers] == ["wide", "down"]


def test_a_value_not_finite_in_float32_that_breaks_the_loss_is_still_a_divergence():
    """The mask's `-inf` reaching the loss (no softmax after it): not finite in float32 and
    the loss with it, so not the precision's."""
    model = masked_model()
    with tfmixprec.policy_scope("mixed_float16"):
        mask = model.get_layer("mask")
        diverging = keras.Model(model.input, mask.output)
        diverging.compile("sgd", "mse")
    x, _ = masked_data()
    diagnosis = tfmixprec.explain_overflow(diverging, (x, np.zeros((16, 4), "float32")))
    assert (diagnosis.cause, diagnosis.layer) == ("forward-overflow", "mask")
    assert "not finite even in float32: the weights or the model diverge" in diagnosis.message
    report = tfmixprec.calibrate(diverging, (x, np.zeros((16, 4), "float32")), steps=1)
    assert (report.cause, report.float32_layers) == ("not-precision", ())
    assert report.problem.startswith("layer 'mask' is not finite even in float32")


@pytest.mark.parametrize(
    "model_class, jit_compile",
    [(keras.Model, False), (tfmixprec.MixedPrecisionModel, False), (keras.Model, True)],
)
def test_precision_repair_repairs_past_a_minus_inf_mask(model_class, jit_compile):
    """`PrecisionRepair` judged the run `not-precision` and repaired nothing, and the loss
    stayed NaN; now `wide` and `down` move to float32 and the steps after are finite."""
    model = masked_model(model_class=model_class, jit_compile=jit_compile)
    repair = tfmixprec.PrecisionRepair(verbose=0)
    x, y = masked_data(160)
    steps = []
    applied = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: steps.append(int(model.optimizer.iterations))
    )
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0, callbacks=[repair, applied])
    [judgment] = repair.judgments
    repaired = ("wide", "down")
    assert (judgment.step, judgment.cause, judgment.layers) == (3, "forward-overflow", repaired)
    assert [model.get_layer(name).compute_dtype for name in repaired] == ["float32"] * 2
    assert np.isfinite(model.evaluate(x, y, verbose=0))
    assert steps == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6]  # the six steps after the repair applied


UNDERFLOW = (
    "a value inside it underflows to 0 in float16 (a softmax's smallest probabilities, say), "
    "then Log makes -inf of that 0 (log(0), at {where}): an underflow, not a value past "
    "float16's range; its output is finite in float32 (max |x| 26.5). Take the log of a "
    "softmax as keras.ops.log_softmax (or tf.nn.log_softmax), which never forms the 0, or "
    'compute that layer in float32 (dtype="float32" on the layer).'
)


# The line of `LogProbabilities.call` in masked_models.py, where the Log runs.
UNDERFLOW_PATTERN = re.escape(UNDERFLOW).replace(re.escape("{where}"), r"\S*masked_models\.py:\d+")


@pytest.mark.parametrize("model_class", [keras.Model, tfmixprec.MixedPrecisionModel])
def test_log_of_a_softmax_is_named_an_underflow(model_class):
    """Seven probabilities of eight round to 0 in float16 and their log is -inf; the largest
    |x| in float32 is 26.5. It was "a value inside it passes float16's 65504"."""
    model = log_softmax_model(model_class)
    batch = masked_data()
    diagnosis = tfmixprec.explain_overflow(model, batch)
    assert (diagnosis.cause, diagnosis.layer) == ("forward-overflow", "log_probs")
    assert re.fullmatch("112 NaN/Inf in its output; " + UNDERFLOW_PATTERN, diagnosis.message)
    report = tfmixprec.calibrate(model, batch, steps=1)
    assert (report.cause, report.float32_layers, report.problem) == (
        "forward-overflow",
        ("log_probs",),
        None,
    )
    assert re.fullmatch(UNDERFLOW_PATTERN, report.reasons[0])
