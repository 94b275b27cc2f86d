"""One trace per `fit`: tfmixprec's models, callbacks and batch keepers trace the train
function once in a model's first `fit`, and a later `fit` with the same callbacks runs that
trace again (a new trace runs its first steps slower: benchmarks/RESULTS.md, section 1)."""

import importlib.util
import tempfile
import warnings
from pathlib import Path

import keras
import pytest

import tfmixprec  # noqa: F401 (the cases build with it)
from tfmixprec._keras.fit import traced_train_functions

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_waits.py"
_spec = importlib.util.spec_from_file_location("host_waits_cases", SCRIPT)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)


class _Traces(keras.callbacks.Callback):
    """At the end of each `fit`: the train function it ran, and how often it was traced."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def on_train_end(self, logs=None):
        function = self.model.train_function
        self.seen.append((function, len(traced_train_functions(self.model))))


def _traces_per_fit(case, jit_compile, fits=3):
    """The traces each of `fits` calls of `fit` added (one epoch each, same callbacks)."""
    _, build, with_callbacks = cases.CASES[case]
    model = build(jit_compile)
    seen = []
    with tempfile.TemporaryDirectory() as log_dir, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # adoption and min-scale lines: said elsewhere
        extra = cases.every_callback(log_dir) if with_callbacks else []
        for _ in range(fits):
            model.fit(cases.X, cases.Y, batch_size=32, verbose=0, callbacks=[*extra, _Traces(seen)])
    added, last = [], (None, 0)
    for function, count in seen:
        added.append(count - (last[1] if function is last[0] else 0))
        last = (function, count)
    return added


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("case", ["keras", "adopted", "MixedPrecisionModel", "float8"])
def test_one_trace_in_the_first_fit_and_none_after(case, jit_compile):
    assert _traces_per_fit(case, jit_compile) == [1, 0, 0]


def test_the_count_sees_a_new_trace():
    """A `fit` on batches of another size traces the same train function again."""
    _, build, _ = cases.CASES["MixedPrecisionModel"]
    model, seen = build(False), []
    for batch_size in (32, 16, 16):
        model.fit(cases.X, cases.Y, batch_size=batch_size, verbose=0, callbacks=[_Traces(seen)])
    assert [count for _, count in seen] == [1, 2, 2]
    assert seen[0][0] is seen[2][0]
