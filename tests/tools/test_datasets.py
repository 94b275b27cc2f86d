"""Tests of the bundled data: tfmixprec.datasets.load_digits."""

import hashlib
import re
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

import tfmixprec
from tfmixprec.tools import datasets

ROOT = Path(__file__).resolve().parents[2]

# SHA-256 of scikit-learn 1.9.1's `sklearn/datasets/data/digits.csv.gz`, which the package
# carries (tools/data/README.md), and of the 1797 rows (64 pixels in 0..16, then the label, as
# uint8) that scikit-learn's `load_digits()` gives, sorted: taken with scikit-learn installed.
SKLEARN_FILE = "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22"
SKLEARN_ROWS = "f67d6a29d0e1f70e7f0cd9dcf25816b694881f4b8f27f5cc1db59551f0499fb8"


def _sorted_rows(images, labels):
    rows = np.concatenate([images.reshape(len(images), -1), labels[:, None]], axis=1)
    assert np.array_equal(rows, np.round(rows))
    rows = rows.astype("uint8")
    return rows[np.lexsort(rows.T[::-1])]


def test_load_digits_shapes_values_and_split():
    (x_train, y_train), (x_test, y_test) = tfmixprec.datasets.load_digits()
    assert (x_train.shape, x_test.shape) == ((1437, 8, 8, 1), (360, 8, 8, 1))
    assert (y_train.shape, y_test.shape) == ((1437,), (360,))
    assert (x_train.dtype, y_train.dtype) == (np.float32, np.int32)
    assert x_train.min() == 0.0 and x_train.max() == 1.0
    assert sorted(set(y_train.tolist())) == list(range(10))
    # a shuffle of scikit-learn's images and labels: together, each image once
    rows = _sorted_rows(np.concatenate([x_train, x_test]) * 16.0, np.concatenate([y_train, y_test]))
    assert hashlib.sha256(rows.tobytes()).hexdigest() == SKLEARN_ROWS


def test_the_digits_file_is_scikit_learns_and_needs_no_scikit_learn():
    assert hashlib.sha256(datasets._DIGITS_FILE.read_bytes()).hexdigest() == SKLEARN_FILE
    readme = (datasets._DIGITS_FILE.parent / "README.md").read_text()
    assert SKLEARN_FILE in readme and "CC BY 4.0" in readme
    required = [r for r in metadata.requires("tfmixprec") if "extra ==" not in r]
    assert [re.split(r"[<>=!~ ;\[]", r)[0] for r in required] == [
        "tensorflow",
        "keras",
        "numpy",
        "tensorboard",
    ]
    shipped = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1]
    assert '"tfmixprec.tools.data" = ["digits.csv.gz", "README.md"]' in shipped


def test_load_digits_seed_and_fraction():
    (a, _), _ = tfmixprec.datasets.load_digits(seed=0)
    (b, _), _ = tfmixprec.datasets.load_digits(seed=0)
    (c, _), _ = tfmixprec.datasets.load_digits(seed=1)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    (x_train, _), (x_test, _) = tfmixprec.datasets.load_digits(test_fraction=0.5)
    assert (len(x_train), len(x_test)) == (898, 899)


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, True, "0.2", None])
def test_load_digits_rejects_bad_fractions(bad):
    with pytest.raises(ValueError, match=rf"test_fraction must be a number in \(0, 1\).*={bad!r}"):
        tfmixprec.datasets.load_digits(test_fraction=bad)


def test_the_demo_split_is_unchanged():
    """The split the demo, examples, notebooks and benchmarks trained on before the move."""
    (_, y_train), (_, y_test) = tfmixprec.datasets.load_digits()
    assert y_train[:10].tolist() == [6, 6, 6, 2, 5, 6, 6, 2, 2, 1]
    assert y_test[:10].tolist() == [0, 8, 8, 9, 8, 3, 7, 5, 0, 6]
