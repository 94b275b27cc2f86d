"""Around the library: the benchmark runner, the `tfmixprec` command's subcommands, test
helpers (`testing`), the model zoo and the bundled data.

What it offers, by module (each module's `__all__`).
"""

from tfmixprec.tools import datasets, testing, zoo

__all__ = [
    "datasets",
    "zoo",
    "testing",
]
