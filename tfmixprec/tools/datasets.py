"""Small data sets that ship inside tfmixprec, for the demo, examples and notebooks.

Nothing is downloaded: the digits images are a file of the package (`tools/data/`, the copy
scikit-learn ships, with its source in `tools/data/README.md`). The layout is Keras's own
(`keras.datasets.mnist.load_data()`): `(x_train, y_train), (x_test, y_test)`.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

__all__ = ["load_digits"]

_DIGITS_FILE = Path(__file__).resolve().parent / "data" / "digits.csv.gz"


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[Any, Any]:
    """Loads 1797 handwritten digits (8x8 grey images, 10 classes), shuffled and split into a
    training and a test set: the UCI "Optical Recognition of Handwritten Digits" test set,
    the images scikit-learn's `load_digits` gives.

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

    with gzip.open(_DIGITS_FILE, "rt") as rows:
        table = np.loadtxt(rows, delimiter=",")  # 64 pixels (0 to 16), then the label
    x = (table[:, :-1].reshape(-1, 8, 8, 1) / 16.0).astype("float32")
    y = table[:, -1].astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int((1.0 - test_fraction) * len(x))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])
