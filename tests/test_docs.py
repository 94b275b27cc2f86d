"""The documentation runs: every Python block of the README, in order, as a reader runs them
(one session, like a notebook), and every docstring example of the package."""

import contextlib
import doctest
import importlib
import io
import pkgutil
import re
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmixprec

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_python_blocks():
    """`(line, source, shown)` of each ```python block of the README; `shown` is the ```text
    block right after it (what it prints, `...` for lines left out), or None."""
    text = README.read_text()
    blocks = []
    pattern = r"^```python\n(.*?)^```\n(?:\n```text\n(.*?)^```\n)?"
    for match in re.finditer(pattern, text, re.S | re.M):
        blocks.append((text.count("\n", 0, match.start()) + 2, match.group(1), match.group(2)))
    return blocks


def test_readme_python_blocks_run_in_order(tmp_path, monkeypatch):
    """The README's Python blocks, top to bottom in one namespace: each defines what it uses
    or uses what an earlier block defined, and prints what a ```text block after it shows.
    Files they write (TensorBoard runs) go to a temporary folder."""
    blocks = readme_python_blocks()
    assert len(blocks) >= 13 and any(shown for _, _, shown in blocks)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__readme__"}
    checker = doctest.OutputChecker()
    for line, source, shown in blocks:
        code = compile(source, f"README.md (block at line {line})", "exec")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            try:
                exec(code, namespace)
            except Exception as err:
                raise AssertionError(f"README.md block at line {line} failed: {err!r}") from err
        if shown is not None:
            assert checker.check_output(shown, printed.getvalue(), doctest.ELLIPSIS), (
                f"README.md block at line {line} printed:\n{printed.getvalue()}"
            )


# ----------------------------------------------------------------------------- docstrings


def _docstring_tests():
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = {}
    for info in pkgutil.iter_modules(tfmixprec.__path__):
        if info.name == "__main__":  # importing it runs the command
            continue
        module = importlib.import_module(f"tfmixprec.{info.name}")
        for test in finder.find(module, f"tfmixprec.{info.name}"):
            if test.examples:
                found[test.name] = test
    return found


DOCSTRING_TESTS = _docstring_tests()


class _Checker(doctest.OutputChecker):
    """An example that shows no output may print anything (a progress bar, a `History`); one
    that shows output must match it."""

    def check_output(self, want, got, optionflags):
        return not want or super().check_output(want, got, optionflags)


def _context():
    """The names docstring examples use without defining: data, a compiled float32 model
    (784 -> 16 -> 10, mean squared error), a fresh optimizer, a loss, a dataset, gradients."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.random((128, 784), dtype=np.float32)
    y = rng.random((128, 10), dtype=np.float32)

    def build_model():
        inputs = keras.Input((784,))
        hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
        outputs = keras.layers.Dense(10, dtype="float32", name="out")(hidden)
        model = tfmixprec.MixedPrecisionModel(inputs, outputs)
        model.compile(optimizer="adam", loss="mse", jit_compile=False)
        return model

    return {
        "tfmixprec": tfmixprec,
        "keras": keras,
        "tf": tf,
        "np": np,
        "x": x,
        "y": y,
        "build_model": build_model,
        "model": build_model(),
        "opt": tfmixprec.LossScaleOptimizer(keras.optimizers.Adam()),
        "loss_fn": keras.losses.MeanSquaredError(),
        "dataset": tf.data.Dataset.from_tensor_slices((x, y)).batch(32),
        "grads": [tf.ones((784, 16)), tf.ones((16,))],
    }


def test_docstring_examples_are_collected():
    assert len(DOCSTRING_TESTS) >= 23
    assert "tfmixprec.optimizer.LossScaleOptimizer" in DOCSTRING_TESTS


@pytest.mark.parametrize("name", sorted(DOCSTRING_TESTS))
def test_docstring_example_runs(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write (TensorBoard) write here
    test = DOCSTRING_TESTS[name]
    test.globs = _context()
    runner = doctest.DocTestRunner(checker=_Checker(), optionflags=doctest.ELLIPSIS)
    report = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()):
        result = runner.run(test, out=report.write, clear_globs=True)
    assert result.failed == 0, report.getvalue()
