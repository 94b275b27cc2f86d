"""The rows the batch keeper (`fit/overflow_batches.py`) writes a step's batch into, on the
device: one variable of 4-byte words (float32 bit patterns, which every strategy can
broadcast), a row a slot and one scratch row; which row is which follows from the keeper's
count alone (`scratch_row`). The helpers turn a batch's tensors into words (`words`), fit a
row to the rows' width, and read each replica's copy (`local_copies`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from tfmixprec.scaling.unscaling import replica_variable

__all__: list[str] = []  # private module: nothing here is part of the package's API

WORD = tf.float32  # the rows' words: 4 bytes, moved as bits (a copy does no arithmetic)


def fitted(value: tf.Tensor, shape: tf.Tensor) -> tf.Tensor:
    """`value` cut or zero-padded to `shape` (the same rank)."""
    have = tf.shape(value, out_type=shape.dtype)
    take = tf.minimum(have, shape)
    return padded(tf.slice(value, tf.zeros_like(take), take), shape, take)


def padded(value: tf.Tensor, shape: tf.Tensor, have: tf.Tensor) -> tf.Tensor:
    """`value` (of shape `have`) zero-padded to `shape`, which holds it."""
    return tf.pad(value, tf.stack([tf.zeros_like(have), shape - have], axis=1))


def scratch_row(count: Any, limit: int, latest: bool, vector: bool = False) -> Any:
    """The row no slot holds after `count` overflow steps kept (an int64 tensor, in the step
    and on the host): a step writes its batch there. Slot `s < limit` holds row `s` (written
    at count `s`); the newest overflow step's batch is the row written at count `count - 1`,
    which from `count == limit` on alternates between rows `limit` and `limit + 1` (parity).
    Without the newest batch, row `limit` once the first `limit` are kept. No variable says
    which row is which: the count does, so the step reads nothing more to find it. `vector`:
    as a vector of one index (a scatter's), by a constant of that shape (no reshape)."""
    shape = [1] if vector else []
    if not latest:
        return tf.minimum(count, tf.constant(limit, tf.int64, shape))
    parity = tf.bitwise.bitwise_and(count, tf.constant(1, tf.int64))
    if limit % 2 == 0:  # limit + (count - limit) % 2
        bound = tf.constant(limit, tf.int64, shape) + parity
    else:
        bound = tf.constant(limit + 1, tf.int64, shape) - parity
    return tf.minimum(count, bound)


def words(value: tf.Tensor, vector: tf.Tensor) -> tf.Tensor:
    """`value`'s bytes as a vector of words (`vector`: the constant `[-1]`)."""
    if value.dtype.size < 4:  # bytes, padded to a whole word, four bytes a word
        value = tf.cast(value, tf.uint8) if value.dtype == tf.bool else value
        value = tf.bitcast(value, tf.uint8) if value.dtype != tf.uint8 else value
        value = tf.reshape(value, vector)
        size = value.shape.num_elements()
        extra = -size % 4 if size is not None else tf.math.floormod(-tf.size(value), 4)
        value = tf.pad(value, [[0, extra]])
        value = tf.reshape(value, [-1, 4])
    if value.dtype != WORD:
        value = tf.bitcast(value, WORD)  # a trailing axis of the item's words, where wider
    return value if value.shape.rank == 1 else tf.reshape(value, vector)


class Rows:
    """The kept batches' rows, one variable of words (a row a slot, and a scratch row: which
    is which follows from the keeper's count, `scratch_row`), and the longest row an XLA
    step has seen. A step writes one row."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.data = replica_variable(tf.zeros([rows, 1], WORD), shape=tf.TensorShape(None))
        self.wanted = replica_variable(tf.zeros([1], tf.int64))

    def held(self) -> tf.Tensor:
        """The rows' shape (`[rows, words]`, int64), from the variable's metadata: reading its
        value would hold its buffer, and the scatter would then copy every row first (copy on
        write)."""
        return tf.raw_ops.VariableShape(input=self.data.handle, out_type=tf.int64)

    def room_for(self, line: tf.Tensor, length: Any, zeros: tf.Tensor, axis: tf.Tensor) -> tuple:
        """Outside XLA: the batch's words `line` (of `length`, a vector of one) as the row it
        is written as (`[1, words]`, zero padded to the rows, or as it is where longer), and
        the padding that grows the rows to hold it (nonzero where they must grow; `zeros`:
        `[0, 0]`, `axis`: the constant 0). Shapes alone, computed on the host: no device
        value, no wait on a GPU."""
        with tf.device("/cpu:0"):  # shapes as a padding's second column, beside `zeros`
            held = tf.stack([zeros, self.held()], axis=1)
            if isinstance(length, np.ndarray):  # known when tracing: one constant
                target = tf.constant([[0, self.rows], [0, length[0]]], tf.int64)
            else:
                target = tf.concat([tf.constant([self.rows], tf.int64), length], axis)
                target = tf.stack([zeros, target], axis=1)
            room = tf.maximum(held, target)  # the rows' dimension: theirs
            padding, growth = room - target, room - held  # growth > 0 where the rows grow
        row = tf.pad(tf.expand_dims(line, axis), padding)
        row.set_shape([1, None])  # one row: the pad of the first dimension is 0
        return row, growth

    def fitted_to(self, line: tf.Tensor, length: Any) -> tuple[tf.Tensor, tf.Tensor]:
        """Inside XLA, whose step keeps a variable's size: `line` cut or padded to the rows
        (`[1, words]`), and whether it fits there; the longest seen is noted for `poll`,
        which grows the rows between steps."""
        with tf.device("/cpu:0"):
            held = tf.slice(self.held(), [1], [1])
            fits = tf.reduce_all(tf.less_equal(length, held))
        self.wanted.assign(tf.maximum(self.wanted, length))
        return tf.expand_dims(fitted(line, held), 0), fits

    def write(self, row: tf.Tensor, update: tf.Tensor) -> None:
        """`update` (`[1, words]`) into `row` (a vector of one index: the scratch row). One
        row a step: the device copies the batch once."""
        # The op itself: a sync-on-read variable has no `scatter_update` in replica context,
        # where its `handle` is this replica's copy's.
        tf.raw_ops.ResourceScatterUpdate(resource=self.data.handle, indices=row, updates=update)

    def grow_in_step(self, growth: tf.Tensor) -> None:
        """In the step's branch that grows them: the rows padded by `growth`."""
        self.data.assign(tf.pad(tf.convert_to_tensor(self.data), growth))

    def grow(self) -> bool:
        """Between steps: every copy's rows grown to the longest any replica saw."""
        wanted = max(int(w.numpy()[0]) for w in local_copies(self.wanted))
        have = int(tf.shape(local_copies(self.data)[0]).numpy()[1])
        if wanted <= have:
            return False
        for copy in local_copies(self.data):
            copy.assign(tf.pad(tf.convert_to_tensor(copy), [[0, 0], [0, wanted - have]]))
        return True

    def release(self) -> None:
        """Between fits, for a dormant keeper: every copy's rows back to one word each (the
        step grows them again where it keeps), so that no device memory is held for the
        largest batch ever seen."""
        for copy in local_copies(self.data):
            copy.assign(tf.zeros([self.rows, 1], WORD))
        for copy in local_copies(self.wanted):
            copy.assign(tf.zeros_like(copy))

    def read(self, copy: int, row: int, start: int, size: int) -> np.ndarray:
        """Replica `copy`'s words `[start, start + size)` of `row`, only those to the host."""
        return tf.slice(local_copies(self.data)[copy], [row, start], [1, size])[0].numpy()


def shape_of(value: tf.Tensor) -> Any:
    """`value`'s shape (int64): NumPy where known when tracing (no op), else a tensor."""
    if value.shape.is_fully_defined():
        return np.array(value.shape.as_list(), np.int64)
    return tf.shape(value, out_type=tf.int64)


def local_copies(variable: Any) -> tuple:
    """Each replica's copy of a sync-on-read variable (one without a strategy)."""
    values = getattr(variable, "values", None)
    return tuple(values) if values is not None else (variable,)
