"""When a callback's read is due: every `update_freq` steps of a `fit`, counted by step.

Private: used by the callbacks (`LossScaleMonitor`, `OverflowGuard`, `fit`'s watch) and
`GradientRangeMonitor`, so that `update_freq` means steps everywhere, with any
`steps_per_execution` (Keras calls a callback once per execution, with the index of its last
step).
"""

from __future__ import annotations

__all__: list[str] = []  # private module: nothing here is part of the package's API


class Every:
    """Whether a read is due: every `n` batches (steps) of a `fit`, counted from the `batch`
    index Keras passes (with `steps_per_execution` > 1, the execution's last step), so an
    interval that ends inside an execution is read at the execution's end."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.start()

    def start(self) -> None:
        self._done, self._epoch_base, self._epoch_steps = 0, 0, 0

    def epoch_begin(self) -> None:
        self._epoch_base += self._epoch_steps
        self._epoch_steps = 0

    def due(self, batch: int) -> bool:
        self._epoch_steps = batch + 1
        total = self._epoch_base + self._epoch_steps
        due = total // self.n > self._done // self.n
        self._done = total
        return due

    @property
    def steps(self) -> int:
        """Steps counted so far in this `fit`."""
        return self._done

    @property
    def steps_in_epoch(self) -> int:
        """Steps counted so far in this epoch (the next step's `batch` index)."""
        return self._epoch_steps
