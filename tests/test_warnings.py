"""Warnings a person reads: at most two sentences, then the docs page that explains them."""

import re
from pathlib import Path

import keras
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec.precision.hardware import HardwareInfo

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r" See (docs/[\w/-]+\.md)\.$")


def _sentences(text):
    """Sentences of `text`: a full stop, then a space and a capital letter, ends one."""
    return [part for part in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text) if part]


def _check(message):
    link = LINK.search(message)
    assert link, f"no docs link at the end: {message!r}"
    assert (ROOT / link.group(1)).is_file(), link.group(1)
    body = message[: link.start()]
    assert len(_sentences(body)) <= 2, _sentences(body)


@pytest.mark.parametrize("enabled", [True, False])
def test_mixed_float16_without_a_gpu(enabled):
    if not enabled:
        tfmixprec.cpu_float16.disable()
    try:
        _check(tfmixprec.policy.float16_without_gpu_note(HardwareInfo(cpu_name="Test CPU")))
    finally:
        tfmixprec.cpu_float16.enable()


def test_an_overflow_at_min_scale():
    opt = tfmixprec.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=1.0, on_min_scale="raise"
    )
    variable = keras.Variable(1.0)
    opt.build([variable])
    with pytest.raises(FloatingPointError) as raised:
        opt.apply([tf.constant(float("inf"))], [variable])
    _check(str(raised.value))


def test_float16_without_loss_scaling_and_a_dynamic_scale_for_bfloat16():
    with tfmixprec.policy_scope("mixed_bfloat16"):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.warns(UserWarning) as caught:
        model_compiled = tfmixprec.MixedPrecisionModel(model.inputs, model.outputs)
        model_compiled.compile(optimizer=tfmixprec.LossScaleOptimizer("sgd"), loss="mse")
    messages = [str(w.message) for w in caught if "bfloat16" in str(w.message)]
    assert messages
    for message in messages:
        _check(message)


def test_sentences_splits_where_a_reader_would():
    text = "Gradients were not finite at step 3 (0-based), e.g. a NaN: skipped. Fix the data."
    assert _sentences(text) == [
        "Gradients were not finite at step 3 (0-based), e.g. a NaN: skipped.",
        "Fix the data.",
    ]
