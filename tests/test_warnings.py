"""Warnings a person reads: at most two sentences, then the guide that explains them, by its
title and its path (a pip install has no docs folder)."""

import re
from pathlib import Path

import keras
import pytest
import tensorflow as tf

import tfmixprec
from tfmixprec._common.text import GUIDE_TITLES, docs_page
from tfmixprec.precision.hardware import HardwareInfo

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(
    r' See the tfmixprec guide "([^"]+)" \((docs/[\w/-]+\.md) in the tfmixprec repository\)\.$'
)


def _title(path):
    """The page's H1: its first line, without the `# `."""
    first = (ROOT / path).read_text().splitlines()[0]
    assert first.startswith("# "), (path, first)
    return first[2:]


def _sentences(text):
    """Sentences of `text`: a full stop, then a space and a capital letter, ends one."""
    return [part for part in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text) if part]


def _check(message):
    link = LINK.search(message)
    assert link, f"no docs link at the end: {message!r}"
    assert (ROOT / link.group(2)).is_file(), link.group(2)
    assert link.group(1) == _title(link.group(2))
    body = message[: link.start()]
    assert len(_sentences(body)) <= 2, _sentences(body)


@pytest.mark.parametrize("enabled", [True, False])
def test_mixed_float16_without_a_gpu(enabled):
    if not enabled:
        tfmixprec.cpu_float16.disable()
    try:
        note = tfmixprec.policy.float16_without_gpu_note(HardwareInfo(cpu_name="Test CPU"))
        _check(note)
        assert len(note) <= 400, note  # set_policy's warning, read on one line
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


def test_each_guide_title_a_warning_names_is_the_pages_h1():
    """`docs_page` names a guide by the title in GUIDE_TITLES: it must be the page's H1, for
    every guide (a renamed or added guide fails here)."""
    guides = {f"guides/{path.stem}" for path in (ROOT / "docs" / "guides").glob("*.md")}
    assert set(GUIDE_TITLES) == guides
    for page, title in GUIDE_TITLES.items():
        assert title == _title(f"docs/{page}.md"), page
        _check(f"A warning. {docs_page(page)}")
    with pytest.raises(ValueError, match=r"page must be one of .*Received: page='guides/nope'"):
        docs_page("guides/nope")


def test_every_page_the_package_names_is_a_guide():
    """The pages named in the package's source (`docs_page("...")`, a default `page`, a
    `_PAGE` constant) are all in GUIDE_TITLES, so no warning raises instead of warning."""
    pages = set()
    for path in (ROOT / "tfmixprec").rglob("*.py"):
        pages.update(re.findall(r'["\'](guides/[\w-]+)["\']', path.read_text()))
    assert pages and pages <= set(GUIDE_TITLES), pages - set(GUIDE_TITLES)
