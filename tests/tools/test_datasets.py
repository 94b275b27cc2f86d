"""Tests of the bundled data: tfmixprec.datasets.load_digits."""

import numpy as np
import pytest
from sklearn.datasets import load_digits

import tfmixprec


def test_load_digits_shapes_values_and_split():
    (x_train, y_train), (x_test, y_test) = tfmixprec.datasets.load_digits()
    assert (x_train.shape, x_test.shape) == ((1437, 8, 8, 1), (360, 8, 8, 1))
    assert (y_train.shape, y_test.shape) == ((1437,), (360,))
    assert (x_train.dtype, y_train.dtype) == (np.float32, np.int32)
    assert x_train.min() == 0.0 and x_train.max() == 1.0
    assert sorted(set(y_train.tolist())) == list(range(10))
    # a shuffle of scikit-learn's images: together, each image once
    digits = load_digits()
    both = np.concatenate([x_train, x_test])[..., 0] * 16.0
    order = np.lexsort(both.reshape(1797, -1).T)
    expected = np.lexsort(digits.images.reshape(1797, -1).T)
    assert np.array_equal(both[order], digits.images[expected])


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
