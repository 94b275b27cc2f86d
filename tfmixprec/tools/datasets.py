"""Small data sets that ship with tfmixprec's dependencies, for the demo, examples and notebooks.

Nothing is downloaded: the digits images are part of scikit-learn's wheel. The layout is
Keras's own (`keras.datasets.mnist.load_data()`): `(x_train, y_train), (x_test, y_test)`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_digits"]


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[Any, Any]:
    """Loads scikit-learn's 1797 handwritten digits (8x8 grey images, 10 classes), shuffled
    and split into a training and a test set.

    Args:
        test_fraction: Float. The share of images held out for testing, in (0, 1).
        seed: Int. The seed of the shuffle; the same seed gives the same split.

    Returns:
        `(x_train, y_train), (x_test, y_test)`: images as float32 arrays of shape
        `(n, 8, 8, 1)` scaled to [0, 1], labels as int32 arrays of shape `(n,)`.

    Raises:
        ValueError: If `test_fraction` is not in (0, 1).

    Example:

    >>> (x_train, y_train), (x_test, y_test) = tfmixprec.datasets.load_digits()
    >>> x_train.shape, x_test.shape
    ((1437, 8, 8, 1), (360, 8, 8, 1))
    """
    number = isinstance(test_fraction, (int, float)) and not isinstance(test_fraction, bool)
    if not (number and 0.0 < test_fraction < 1.0):
        raise ValueError(
            "test_fraction must be a number in (0, 1), e.g. 0.2 for a fifth of the images. "
            f"Received: test_fraction={test_fraction!r}"
        )
    import numpy as np
    from sklearn import datasets as sklearn_datasets

    digits = sklearn_datasets.load_digits()
    x = (digits.images[..., None] / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int((1.0 - test_fraction) * len(x))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])
