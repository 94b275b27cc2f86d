"""Keras's own LossScaleOptimizer tests, run against `tfmixprec.LossScaleOptimizer`.

Our class subclasses `keras.optimizers.LossScaleOptimizer` and promises to work wherever
Keras's class does. Keras ships the tests of its class inside the wheel
(`keras/src/optimizers/loss_scale_optimizer_test.py`); this file loads a private copy of that
module with its `LossScaleOptimizer` name pointing at our class and runs every test unchanged.
Tests that fail by design are strict expected failures naming the behavioural difference, so a
change in either class shows up here. Tests Keras skips on the TF backend (stateless) stay
skipped.
"""

import importlib.metadata
import importlib.util
import unittest
from unittest import mock

import keras
import pytest

import tfmixprec

_KERAS_TESTS = "keras.src.optimizers.loss_scale_optimizer_test"

# Keras tests that fail by design: test name -> the behavioural difference.
EXPECTED_FAILURES = {
    "test_init_dynamic_arg": "tfmixprec accepts dynamic=False (a fixed scale); Keras rejects it",
    "test_serialization": (
        "get_config adds tfmixprec's knobs (growth/backoff factors, min/max_scale, "
        "hysteresis, dynamic, on_min_scale, accumulation_steps) to Keras's 4 keys"
    ),
}


def _load_keras_tests():
    """A private copy of Keras's test module (not `sys.modules`'s), or None if not installed."""
    spec = importlib.util.find_spec(_KERAS_TESTS)
    if spec is None or spec.origin is None:
        return None
    private = importlib.util.spec_from_file_location("_keras_lso_peer_tests", spec.origin)
    module = importlib.util.module_from_spec(private)
    private.loader.exec_module(module)
    # The module's only reference to Keras's class (`from ... import LossScaleOptimizer`).
    module.LossScaleOptimizer = tfmixprec.LossScaleOptimizer
    return module


_keras_tests = _load_keras_tests()


def _nightly() -> bool:
    """Whether the installed Keras is a `keras-nightly` build: those wheels ship no test
    modules at all (none of the 277 `*_test.py` of keras 3.15.1 is in keras-nightly
    3.16.0.dev2026102704), so `.ci/nightly` runs without the peer tests."""
    try:
        importlib.metadata.version("keras-nightly")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_keras_tests_are_installed():
    if _keras_tests is None and _nightly():
        pytest.skip(f"keras-nightly {keras.__version__} ships no test modules")
    assert _keras_tests is not None, (
        f"Keras's test module {_KERAS_TESTS} is not in the installed keras "
        f"{keras.__version__} ({keras.__file__}); the peer tests in this file cannot run."
    )


def _mark_expected_failures(cls):
    for name, reason in EXPECTED_FAILURES.items():
        # The function belongs to our private copy of Keras's module: ours to mark.
        setattr(cls, name, pytest.mark.xfail(strict=True, reason=reason)(getattr(cls, name)))
    return cls


if _keras_tests is not None:

    @_mark_expected_failures
    class TestKerasLossScaleOptimizer(_keras_tests.LossScaleOptimizerTest):
        """Every test of Keras's LossScaleOptimizerTest, with tfmixprec's class."""

    def test_peer_tests_build_tfmixprec_optimizers():
        """Every LossScaleOptimizer the peer tests build is tfmixprec's, not Keras's."""
        keras_init = keras.optimizers.LossScaleOptimizer.__init__
        built = []

        def recording_init(self, *args, **kwargs):
            built.append(type(self))
            keras_init(self, *args, **kwargs)

        suite = unittest.defaultTestLoader.loadTestsFromTestCase(TestKerasLossScaleOptimizer)
        with mock.patch.object(keras.optimizers.LossScaleOptimizer, "__init__", recording_init):
            suite.run(unittest.TestResult())
        assert built, "the peer tests built no LossScaleOptimizer"
        classes = {f"{cls.__module__}.{cls.__name__}" for cls in built}
        assert set(built) == {tfmixprec.LossScaleOptimizer}, f"the peer tests built {classes}"
