"""The batches of overflow steps, kept on the device from inside the training step.

`explain_overflow` (the callbacks' `diagnose=`) and `PrecisionRepair` replay the batch of an
overflow step after it ran. The step keeps it in variables on the device, where the host
waits for nothing: no host copy, and no branch on a device value.

- Each tensor of the batch `(x, y, sample_weight)` has one variable of rows, in the tensor's
  own dtype (a uint8 image stays uint8): one row a slot, the batches of the first `limit`
  overflow steps since the keeper was (re)started and, where asked for (`PrecisionRepair`),
  the newest overflow step's, and one row more. Every step writes its batch with one scatter
  into the row no slot holds (the scratch row), and its step, scale and shapes into the same
  row of a small table; an overflow step moves the count of kept steps on, and with it the
  scratch row (`_scratch_row`: which row is which follows from the count alone), so the row
  written becomes a slot's. A step costs one device copy of its batch, however many slots,
  and whoever keeps.
- The rows grow, in the step, where a batch is larger than any before: one branch for every
  tensor, decided by shapes alone, which the host knows without waiting for the device. A
  smaller batch (a ragged last batch) is padded, and its own shape kept beside it.
- XLA compiles a variable's size into the step, so under `jit_compile=True` the keeper
  compiles the model's step with XLA itself and keeps the batch just outside it
  (`_keras.fit.make_train_function` builds Keras's train function around it without XLA).
  Where Keras builds the train function itself with XLA (a `compile()` after
  `keep_overflow_batches`), the keeper runs inside XLA with rows of fixed size: a batch larger
  than any before is not kept (`missed`, said in a warning), and `poll` grows the rows.
- Each replica keeps its own batch (sync-on-read variables), for `PrecisionRepair`, which
  replays them all.

The host reads the slots only when a callback acts on them: `poll` (the callbacks call it
after a step, with the counts read in the one read they share) grows the rows where a batch
did not fit; `kept` and `latest` copy a kept batch to the host, and only its values. Between
fits a callbacks' keeper is dormant and holds rows of one value each (`release`).
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfmixprec._common.text import docs_page
from tfmixprec._keras.fit import (
    STEP_COMPILES_ITSELF,
    in_xla_context,
    make_train_function,
    replace_train_step,
)
from tfmixprec.scaling.unscaling import replica_variable

__all__ = ["KeptBatch", "OverflowBatches"]


@dataclasses.dataclass(frozen=True)
class KeptBatch:
    """The batch of one overflow step, copied to the host for a replay.

    Attributes:
        step: Int. The step (0-based, skipped steps counted, as the loss-scale counters).
        scale: Float. The loss scale that step used.
        batch: Tuple `(x, y, sample_weight)` of NumPy arrays (`sample_weight` may be None).
    """

    step: int
    scale: float
    batch: tuple


def _fitted(value: tf.Tensor, shape: tf.Tensor) -> tf.Tensor:
    """`value` cut or zero-padded to `shape` (the same rank)."""
    have = tf.shape(value, out_type=shape.dtype)
    take = tf.minimum(have, shape)
    return _padded(tf.slice(value, tf.zeros_like(take), take), shape, take)


def _padded(value: tf.Tensor, shape: tf.Tensor, have: tf.Tensor) -> tf.Tensor:
    """`value` (of shape `have`) zero-padded to `shape`, which holds it."""
    return tf.pad(value, tf.stack([tf.zeros_like(have), shape - have], axis=1))


def _scratch_row(count: Any, limit: int, latest: bool, vector: bool = False) -> Any:
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


class _Slots:
    """One tensor of the batch: its rows (one a kept batch, and a scratch row), kept in the
    tensor's own dtype, and the largest shape an XLA step has seen. Which row holds which slot
    follows from the keeper's count (`_scratch_row`); the shape each slot holds is in the
    keeper's table (`columns`). A step writes one row."""

    def __init__(self, spec: tf.TensorSpec, slots: int, column: int) -> None:
        # The sizes the trace declares; 1 where unknown (a scatter needs a row of one value).
        known = [max(d or 1, 1) for d in spec.shape.as_list()]
        self.dtype, self.rows, self.rank = spec.dtype, slots + 1, len(known)
        self.columns = slice(column, column + len(known))  # its shape, in the keeper's table
        self.data = replica_variable(
            tf.zeros([self.rows, *known], spec.dtype), shape=tf.TensorShape(None)
        )
        self.wanted = replica_variable(tf.zeros([len(known)], tf.int64))

    def held(self) -> tf.Tensor:
        """The rows' shape (`[rows, *row]`, int64), from the variable's metadata: reading its
        value would hold its buffer, and the scatter would then copy every row first (copy on
        write)."""
        return tf.raw_ops.VariableShape(input=self.data.handle, out_type=tf.int64)

    def room_for(self, value: tf.Tensor, shape: Any, zeros: tf.Tensor, axis: tf.Tensor) -> tuple:
        """Outside XLA: `value` (of `shape`) as the row it is written as (`[1, *room]`, zero
        padded to the rows, or to `shape` where larger), and the padding that grows the rows
        to hold it (nonzero where they must grow; `zeros`: a column of the rank + 1, `axis`:
        the constant 0). Shapes alone, computed on the host: no device value, no wait on a
        GPU."""
        # Each shape as a padding's second column, beside `zeros` (nothing before): the room
        # less a shape pads it to the room.
        with tf.device("/cpu:0"):
            held = tf.stack([zeros, self.held()], axis=1)
            if isinstance(shape, np.ndarray):  # known when tracing: one constant
                target = np.stack([np.zeros(self.rank + 1, np.int64), [self.rows, *shape]], 1)
                target = tf.constant(target, tf.int64)
            else:
                target = tf.concat([tf.constant([self.rows], tf.int64), shape], axis)
                target = tf.stack([zeros, target], axis=1)
            room = tf.maximum(held, target)  # the rows' dimension: theirs
            padding, growth = room - target, room - held  # growth > 0 where the rows grow
        row = tf.pad(tf.expand_dims(value, axis), padding)
        row.set_shape([1] + [None] * self.rank)  # one row: the pad of the first dimension is 0
        return row, growth

    def fitted_to(self, value: tf.Tensor, shape: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Inside XLA, whose step keeps a variable's size: `value` cut or padded to the rows
        (`[1, *row]`), and whether it fits there; the largest shape seen is noted for `poll`,
        which grows the rows between steps."""
        with tf.device("/cpu:0"):
            held = tf.slice(self.held(), [1], [self.rank])
            fits = tf.reduce_all(tf.less_equal(shape, held))
        self.wanted.assign(tf.maximum(self.wanted, shape))
        return tf.expand_dims(_fitted(value, held), 0), fits

    def write(self, row: tf.Tensor, update: tf.Tensor) -> None:
        """`update` (`[1, *row]`) into `row` (a vector of one index: the scratch row). One row
        a step: the device copies the batch once."""
        # The op itself: a sync-on-read variable has no `scatter_update` in replica context,
        # where its `handle` is this replica's copy's. `ResourceScatterUpdate` has a kernel
        # for every dtype on CPUs and GPUs (bool and the narrow integers included).
        tf.raw_ops.ResourceScatterUpdate(resource=self.data.handle, indices=row, updates=update)

    def grow(self) -> bool:
        """Between steps: every copy's rows grown to the largest shape any replica saw."""
        wanted = np.max([w.numpy() for w in _local(self.wanted)], axis=0)
        size = tf.shape(_local(self.data)[0]).numpy()
        if (wanted <= size[1:]).all():
            return False
        size = tf.constant([size[0], *np.maximum(wanted, size[1:])])
        for copy in _local(self.data):
            copy.assign(_fitted(tf.convert_to_tensor(copy), size))
        return True

    def release(self) -> None:
        """Between fits, for a dormant keeper: every copy's rows back to one value each (the
        step grows them again where it keeps), so that no device memory is held for the
        largest batch ever seen."""
        for copy in _local(self.data):
            copy.assign(tf.zeros([self.rows] + [1] * self.rank, self.dtype))
        for copy in _local(self.wanted):
            copy.assign(tf.zeros_like(copy))

    def read(self, copy: int, row: int, shape: np.ndarray) -> np.ndarray:
        """Replica `copy`'s batch of `shape` held in `row`: only its values copied to the host."""
        data = _local(self.data)[copy]
        return tf.slice(data, [row] + [0] * len(shape), [1, *shape])[0].numpy()


def _shape(value: tf.Tensor) -> Any:
    """`value`'s shape (int64): NumPy where known when tracing (no op), else a tensor."""
    if value.shape.is_fully_defined():
        return np.array(value.shape.as_list(), np.int64)
    return tf.shape(value, out_type=tf.int64)


def _grow_rows(growths: list[tuple[Any, tf.Tensor]]) -> None:
    """The rows of each `(slots, padding)` padded (where they grow, by 0 elsewhere)."""
    for slots, padding in growths:
        slots.data.assign(tf.pad(tf.convert_to_tensor(slots.data), padding))


def _local(variable: Any) -> tuple:
    """Each replica's copy of a sync-on-read variable (one without a strategy)."""
    values = getattr(variable, "values", None)
    return tuple(values) if values is not None else (variable,)


# The counts each step adds to: overflow steps kept, steps whose batch did not fit the rows,
# and overflow steps whose batch did not fit (not kept). `fit.reader` reads them with the
# optimizer's state, in one copy, under these names.
_KEPT, _UNFIT, _MISSED = 0, 1, 2
# The columns of the table, a row beside each row of the batches: what the optimizer says of
# the step written there, its scale's bits, then the shape of each tensor (`_Slots.columns`).
_ITERATION, _OVERFLOWS, _SCALE, _SHAPES = 0, 1, 2, 3
KEEPER_COUNTS = ("kept", "unfit", "missed")


class OverflowBatches:
    """Keeps the batches of the first `limit` overflow steps, and the newest overflow step's
    (one a replica; `latest=True`), in variables on the device, from inside the training step.
    `MixedPrecisionModel.keep_overflow_batches` puts one in the step.

    A clean step reads no value on the host and branches on none: it writes its batch into a
    scratch row. `poll` (after each batch, from the callbacks and `MixedPrecisionModel.fit`)
    reads the counts and grows the rows where a batch did not fit; `kept` and `latest` copy
    batches to the host.

    Args:
        limit: Int >= 0. How many overflow steps' batches to keep (from the first).
        owner: String. `"user"` (`keep_overflow_batches`) or `"callbacks"` (a `diagnose=`
            switch or `PrecisionRepair`, for the length of a `fit`).
        latest: Bool. Also keep the newest overflow step's batch (`latest`), one a replica.
    """

    def __init__(self, limit: int, owner: str = "user", latest: bool = True) -> None:
        self.limit = limit
        self.owner = owner
        self.keeps_latest = latest  # fixed, as `limit`, once a traced step made the slots
        self.fit: Any = None  # for the callbacks' keeper: the `fit` it keeps for
        # A callbacks' keeper is dormant between fits (`stop_keeping_for_callbacks`): nobody
        # reads it, and the train function traced with it (`traced`) is reused by the next fit.
        self.active = True
        self.traced: Any = None
        self.unkept: str | None = None  # why the traced step keeps nothing (said once)
        self.stale = False  # a trace met another batch structure: `poll(model)` traces again
        self._counts: tf.Variable | None = None  # `_KEPT`, `_UNFIT`, `_MISSED`
        self._unfit_seen = 0  # `_UNFIT` when the rows were last grown
        self._missed_said = 0  # `_MISSED` when last said
        # Per row: `last_overflow_iteration`, `overflow_steps`, the scale's bits, the shapes.
        self._table: tf.Variable | None = None
        self._slots: list[_Slots | None] = []  # per tensor of the flattened batch
        self._spec: Any = None
        self._lock = threading.Lock()  # replicas trace in threads

    @property
    def _size(self) -> int:
        return self.limit + int(self.keeps_latest)

    # ------------------------------------------------------------ in the step
    def keep_if_overflow(self, data: Any, overflowed: tf.Tensor, optimizer: Any) -> None:
        """In the step, after `apply`: writes the batch into the scratch row, and on an
        overflow step the slots it fills (the next of the first `limit`, and the newest) note
        it in the table, with its scale and step. No host copy, and no branch on a device
        value: outside XLA the rows grow in the step where the batch is larger (one branch on
        shapes, decided on the host); inside XLA, whose step keeps a variable's size, `poll`
        grows them."""
        batch = keras.utils.unpack_x_y_sample_weight(data)
        flat = tf.nest.flatten(batch)
        if not self._ready(batch, flat):
            return
        slots = [(x, s) for x, s in zip(flat, self._slots) if s is not None]
        shapes = [_shape(tensor) for tensor, _ in slots]
        axis = tf.constant(0)  # one constant for every axis 0
        if in_xla_context():  # the rows as they are: the batch may not fit
            updates, fits = zip(*[s.fitted_to(x, n) for (x, s), n in zip(slots, shapes)])
            fits = tf.reduce_all(tf.stack(fits))
            kept = tf.logical_and(overflowed, fits)
        else:
            updates, fits, kept = self._room_for(slots, shapes, axis), None, overflowed
        # `_KEPT` (at index 0, `axis`) alone: one op, on the variable's device.
        count = tf.raw_ops.ResourceGather(
            resource=self._counts.handle, indices=axis, dtype=tf.int64
        )
        row = _scratch_row(count, self.limit, self.keeps_latest, vector=True)
        for (_, tensor_slots), update in zip(slots, updates):
            tensor_slots.write(row, update)
        self._note(row, shapes, optimizer, axis)
        if fits is None:  # only kept steps to count: `_KEPT` (at index 0, `axis`) += kept
            tf.raw_ops.ResourceScatterAdd(
                resource=self._counts.handle, indices=axis, updates=tf.cast(kept, tf.int64)
            )
        else:  # kept, unfit, missed
            unfit = tf.logical_not(fits)
            added = tf.cast(tf.stack([kept, unfit, tf.logical_and(overflowed, unfit)]), tf.int64)
            self._counts.assign_add(added)

    def _room_for(self, slots: list, shapes: list, axis: tf.Tensor) -> list[tf.Tensor]:
        """Outside XLA: each tensor as the row it is written as, the rows grown first where
        the batch is larger than they are (one branch for every tensor, on shapes alone)."""
        zeros: dict[int, tf.Tensor] = {}  # one constant a rank
        made, larger = [], []
        for (tensor, tensor_slots), shape in zip(slots, shapes):
            rank = tensor_slots.rank + 1
            if rank not in zeros:
                zeros[rank] = tf.zeros([rank], tf.int64)
            row, growth = tensor_slots.room_for(tensor, shape, zeros[rank], axis)
            made.append((row, tensor_slots, growth))
            larger.append(growth)
        with tf.device("/cpu:0"):  # the largest growth, nonzero where the rows grow
            larger = tf.concat(larger, axis) if len(larger) > 1 else larger[0]
            larger = tf.cast(tf.reduce_max(larger), tf.bool)
        growths = [(tensor_slots, growth) for _, tensor_slots, growth in made]
        with tf.name_scope("keeper_rows_grow"):
            tf.cond(larger, lambda: _grow_rows(growths), lambda: None)
        return [row for row, _, _ in made]

    def _note(self, row: tf.Tensor, shapes: list, optimizer: Any, axis: tf.Tensor) -> None:
        """Notes the step beside its batch, in the same `row` of the table: the optimizer's
        `last_overflow_iteration` and `overflow_steps` (the step, as `step_number` counts it),
        the scale's bits, and the batch's shapes. On an overflow step they are the step's own;
        the row is a slot's once the count moves on, as the batch's row (`_scratch_row`)."""
        scale = tf.bitcast(tf.convert_to_tensor(optimizer.last_overflow_scale), tf.int32)
        numbers = [
            tf.cast(tf.convert_to_tensor(value), tf.int64)
            for value in (optimizer.last_overflow_iteration, optimizer.overflow_steps, scale)
        ]
        if all(isinstance(shape, np.ndarray) for shape in shapes):  # known: one constant
            shapes = [np.concatenate(shapes)]
        record = tf.concat([tf.stack(numbers), *shapes], axis)
        # Into `row` alone, as the batch: a sync-on-read variable's own copy (its `handle`).
        tf.raw_ops.ResourceScatterUpdate(
            resource=self._table.handle,
            indices=row,
            updates=tf.expand_dims(record, axis),
            name="keeper_record",
        )

    def _ready(self, batch: Any, flat: list[Any]) -> bool:
        """Creates the variables at the first trace (a tensor each); False where the batch
        cannot be kept: said once where it is not dense; another structure than the first
        trace's makes the keeper `stale` (`poll(model)` traces the step again)."""
        with self._lock:
            if self.unkept is not None or self.stale:
                return False
            kinds = [x for x in flat if x is not None and not isinstance(x, tf.Tensor)]
            if kinds:
                return self._cannot(f"a {type(kinds[0]).__name__} in the batch")
            spec = tf.nest.map_structure(_spec_of, batch)
            if self._counts is None:
                with tf.init_scope():
                    self._create(spec, flat)
            elif not _same_structure(self._spec, spec):
                self.stale = True
                if self.owner == "user":
                    warnings.warn(
                        "tfmixprec: batches are not kept: a batch of another structure or "
                        "dtype than the first. MixedPrecisionModel.fit starts the keeper again "
                        "after the next overflow step, and the batches kept so far are "
                        "dropped; in a loop of your own, call keep_overflow_batches again. "
                        f"{docs_page('guides/why-overflow')}",
                        stacklevel=5,
                    )
                return False
        return True

    def _create(self, spec: Any, flat: list[Any]) -> None:
        self._counts = replica_variable(tf.zeros([3], tf.int64))
        self._unfit_seen = self._missed_said = 0
        self._slots, column = [], _SHAPES
        for x in flat:
            self._slots.append(None if x is None else _Slots(_spec_of(x), self._size, column))
            column += 0 if x is None else self._slots[-1].rank
        self._table = replica_variable(tf.zeros([self._size + 1, column], tf.int64))  # a row each
        self._spec = spec

    def _cannot(self, why: str) -> bool:
        self.unkept = f"batches are not kept: {why} (only dense tensors are kept)"
        warnings.warn(f"tfmixprec: {self.unkept}. {docs_page('guides/why-overflow')}", stacklevel=5)
        return False

    # ------------------------------------------------------------ on the host
    def counts_variable(self) -> tf.Variable | None:
        """The counts `poll` reads (the first replica's), for a reader that reads them with
        other values in one copy; None before a traced step made them."""
        return None if self._counts is None else _local(self._counts)[0]

    def poll(self, model: Any = None, counts: dict[str, int] | None = None) -> int:
        """Between steps: reads the counts (one small read; none where `counts`, read with
        other values, are given: `KEEPER_COUNTS`), grows the rows where a step's batch did
        not fit, and, given the `model` whose step holds this keeper, traces that step again
        where it met another batch structure. Returns `seen`."""
        if self.stale and model is not None and current_keeper(model) is self:
            self.forget()
            set_keeper(model, self)
        if self._counts is None:
            return 0
        if counts is not None and all(name in counts for name in KEEPER_COUNTS):
            counts = [counts[name] for name in KEEPER_COUNTS]
        else:
            counts = _local(self._counts)[0].numpy()
        if counts[_MISSED] > self._missed_said:
            self._missed_said = int(counts[_MISSED])
            warnings.warn(
                f"tfmixprec: {self._missed_said} overflow step(s) not kept for a replay: the "
                "batch keeper ran inside an XLA step that Keras built itself (a compile() after "
                "keep_overflow_batches, say), which keeps the rows' size, and the batch was "
                "larger than any before; they are grown now. Call keep_overflow_batches again "
                f"after compile(). {docs_page('guides/why-overflow')}",
                RuntimeWarning,
                stacklevel=2,
            )
        if counts[_UNFIT] > self._unfit_seen:
            self._unfit_seen = int(counts[_UNFIT])
            for slots in self._slots:
                if slots is not None:
                    slots.grow()
        return int(counts[_KEPT])

    @property
    def seen(self) -> int:
        """Overflow steps kept since the keeper (re)started (`poll`)."""
        return self.poll()

    @property
    def missed(self) -> int:
        """Overflow steps since the keeper (re)started whose batch was larger than the rows
        then (an unknown batch size in the first step, or a larger batch): not kept."""
        return 0 if self._counts is None else int(_local(self._counts)[0].numpy()[_MISSED])

    @property
    def kept(self) -> list[KeptBatch]:
        """The batches of the first `limit` overflow steps, copied to the host (the first
        replica's)."""
        return self.kept_from(0)

    def kept_from(self, first: int, seen: int | None = None) -> list[KeptBatch]:
        """`kept[first:]`: only those batches copied (`seen`: the count, if read already)."""
        seen = self.seen if seen is None else seen
        return [self._read(0, slot) for slot in range(first, min(seen, self.limit))]

    @property
    def latest(self) -> list[KeptBatch]:
        """The newest overflow step's batch, one a replica (empty before the first, or when
        the keeper does not keep it)."""
        if not self.keeps_latest or not self.seen:
            return []
        return [self._read(copy, self.limit) for copy in range(len(_local(self._counts)))]

    @property
    def nbytes(self) -> int:
        """The bytes the rows hold on the device, every replica's copies together (one
        small host read a tensor of the batch)."""
        total = 0
        for slots in (s for s in self._slots if s is not None):
            for copy in _local(slots.data):
                total += int(np.prod(tf.shape(copy).numpy())) * slots.dtype.size
        return total

    @property
    def traced_once(self) -> bool:
        """Whether a traced step has created the slots (their number is fixed from then)."""
        return self._counts is not None

    def forget(self) -> None:
        """Drops the slots: the next traced step makes them again (for another `limit`, the
        newest batch or another batch structure), and keeps from there."""
        self._counts = self._table = self._spec = None
        self._slots, self.unkept, self.stale = [], None, False

    def restart(self) -> None:
        """Keeps from the next overflow step on as if new (the rows are reused)."""
        if self._counts is not None:
            for copy in _local(self._counts):
                copy.assign(tf.zeros([3], tf.int64))
            self._unfit_seen = self._missed_said = 0

    def _read(self, copy: int, slot: int) -> KeptBatch:
        if slot < self.limit:
            row = slot
        else:  # the newest: the row written at the last count
            count = _local(self._counts)[copy].numpy()[_KEPT] - 1
            row = int(_scratch_row(tf.constant(count), self.limit, self.keeps_latest))
        noted = _local(self._table)[copy][row].numpy()  # that row alone
        arrays = iter([s.read(copy, row, noted[s.columns]) for s in self._slots if s is not None])
        flat = [None if s is None else next(arrays) for s in self._slots]
        batch = tuple(tf.nest.pack_sequence_as(self._spec, flat))
        iteration, overflows = int(noted[_ITERATION]), int(noted[_OVERFLOWS])
        scale = float(noted[_SCALE : _SCALE + 1].astype(np.int32).view(np.float32)[0])
        # The step as `loss_scale.step_number` counts it: applied steps before it, and
        # overflow steps before it.
        return KeptBatch(iteration + overflows - 1, scale, batch)

    def release(self) -> None:
        """Between fits (a dormant keeper): the rows back to one value each, so no device
        memory is held for the largest batch seen; the next step that keeps grows them."""
        for slots in self._slots:
            if slots is not None:
                slots.release()


def _spec_of(value: Any) -> Any:
    return None if value is None else tf.TensorSpec.from_tensor(tf.convert_to_tensor(value))


def _same_structure(first: Any, spec: Any) -> bool:
    try:
        tf.nest.assert_same_structure(first, spec)
    except (TypeError, ValueError):
        return False
    pairs = zip(tf.nest.flatten(first), tf.nest.flatten(spec))
    return all((a is None) == (b is None) and (a is None or a.dtype == b.dtype) for a, b in pairs)


# ------------------------------------------------------------------ keeping in the step
# Any Keras model's step can keep its overflow batches: the step is wrapped for the next trace
# (`_keras.fit.replace_train_step`), and the wrapper writes the batch into the keeper's rows
# after the model's own step, inside the train function Keras builds (with XLA or without).


def cannot_keep_batches(model: Any, replicas_ok: bool = False) -> str | None:
    """Why `model`'s step cannot keep the batch of an overflow step, or None (`replicas_ok`:
    each replica's batch is kept, for `PrecisionRepair`, which replays them all)."""
    replicas = model.distribute_strategy.num_replicas_in_sync
    if replicas > 1 and getattr(model, "jit_compile", False):
        return (
            f"keeping the batch of an overflow step under a strategy with {replicas} replicas "
            "needs a step without XLA (Keras's default jit_compile='auto' compiles none under "
            f"a strategy). Received: jit_compile={model.jit_compile!r}"
        )
    if replicas > 1 and not replicas_ok:
        return (
            "keeping the batch of an overflow step is not supported under a strategy with "
            f"{replicas} replicas yet; call tfmixprec.explain_overflow(model, batch) on the "
            "batch yourself."
        )
    steps = getattr(getattr(model, "optimizer", None), "accumulation_steps", 1)
    if steps > 1:
        return (
            "with gradient accumulation an overflow is known only at the window's end, after "
            "the micro-batch that caused it; keeping batches is not supported there yet. "
            f"Received: accumulation_steps={steps}"
        )
    return None


def current_keeper(model: Any) -> OverflowBatches | None:
    """The `OverflowBatches` `model`'s step keeps overflow batches in, or None."""
    return getattr(model, "_tfmixprec_overflow_batches", None)


def set_keeper(model: Any, keeper: OverflowBatches | None) -> OverflowBatches | None:
    """From the next traced step on, `model`'s step (any Keras model, compiled with a
    tfmixprec `LossScaleOptimizer`) keeps the batches of its overflow steps in `keeper`; None
    stops keeping. Either way the train function is traced again."""
    model._tfmixprec_overflow_batches = keeper
    replace_train_step(model, None if keeper is None else _keeping(model, keeper))
    make_train_function(model)
    return keeper


def _keeping(model: Any, keeper: OverflowBatches) -> Callable[[Any], Callable]:
    def make(step: Callable) -> Callable:
        def keeping_step(data: Any) -> Any:
            # Under XLA: XLA's step, as Keras would compile it, where Keras was told to leave
            # it to this wrapper (`make_train_function`), and the batch kept outside it, where
            # the rows can grow. A function of this trace's own: a repair's new policies trace
            # it anew. In a train function Keras built itself with XLA, the step as it is.
            if model.jit_compile and not in_xla_context():
                logs = tf.function(step, jit_compile=True, reduce_retracing=True)(data)
            else:
                logs = step(data)
            optimizer = model.optimizer  # read while tracing: the adopted one, if adopted
            # The optimizer's flag (its finite check's, where that ran in this graph), not a
            # log: a step may log an "overflow" of its own.
            keeper.keep_if_overflow(data, optimizer.skipped(), optimizer)
            return logs

        # The state guard wraps a step once: the keeping wrapper says whether what it wraps
        # is guarded already (`_adoption`), so a later adoption does not guard it twice.
        keeping_step.tfmixprec_guarded = getattr(step, "tfmixprec_guarded", False)
        setattr(keeping_step, STEP_COMPILES_ITSELF, True)
        keeping_step.__wrapped__ = step
        return keeping_step

    return make


def keep_for_callbacks(
    model: Any,
    limit: int,
    who: str,
    fit: Any = None,
    latest: bool = False,
    what: str = "diagnose=",
    page: str = "guides/why-overflow",
) -> OverflowBatches | None:
    """For the callbacks' `diagnose=` and `PrecisionRepair`: the batches kept already (the
    user's, or another callback's in this `fit`), else a keeper for this `fit`; None, with a
    warning naming `who`, where batches cannot be kept (training goes on without the replay).

    `fit` is what marks one `fit` (the `params` dict Keras gives every callback of a `fit`):
    a callbacks' keeper left by an earlier `fit` that raised (Keras then skips
    `on_train_end`) is replaced, not reused full. `latest` (for `PrecisionRepair`, which reads
    the newest overflow step's batches, one a replica) allows any number of replicas. A
    keeper not traced yet takes the largest `limit` asked for in its `fit`, and the newest
    batch if any callback asks (every callback starts before the first step is traced); a
    traced one without the newest batch makes its slots again with it, in a new trace."""
    current = current_keeper(model)
    if current is not None and current.owner == "callbacks" and current.fit is not fit:
        if _can_wake(model, current, limit, latest):
            return _wake(model, current, fit)
        current.active = False  # left by an earlier fit (one that raised): read no more
        current = None
    if current is not None and not current.traced_once:
        current.limit = max(current.limit, limit)
        current.keeps_latest = current.keeps_latest or latest
    if current is not None and (current.keeps_latest or not latest):
        return current
    reason = cannot_keep_batches(model, replicas_ok=latest)
    if current is not None and reason is None:  # traced without the newest batch: again
        current.forget()
        current.keeps_latest = True
        return set_keeper(model, current)
    if reason is not None:
        if current_keeper(model) is not None:  # an earlier fit's: it keeps no more
            set_keeper(model, None)
        link = docs_page(page)
        warnings.warn(f"{who}: {what} is off for this fit: {reason} {link}", RuntimeWarning, 3)
        return None
    keeper = OverflowBatches(limit, "callbacks", latest)
    keeper.fit = fit
    return set_keeper(model, keeper)


def stop_keeping_for_callbacks(model: Any) -> None:
    """Ends the callbacks' keeping (a user's `keep_overflow_batches` is left alone).

    The keeper goes dormant rather than away: nobody reads it from now on, and the class's
    step is back for any new trace (a `compile` traces again without it), but the train
    function traced with it stays, so the next `fit` with a callback that keeps batches
    reuses it instead of tracing again (`fit` called in a loop, one epoch each). Its rows
    shrink to one value each (the step grows them again)."""
    current = current_keeper(model)
    if current is not None and current.owner == "callbacks":
        current.active = False
        current.traced = getattr(model, "train_function", None)
        current.release()  # no memory held for the largest batch seen
        replace_train_step(model, None)


def _can_wake(model: Any, keeper: OverflowBatches, limit: int, latest: bool) -> bool:
    """Whether a dormant keeper's traced train function is still the model's, and usable."""
    if keeper.active or keeper.traced is None or keeper.limit < limit:
        return False
    if latest and not keeper.keeps_latest:
        return False
    traced = getattr(model, "train_function", None)
    return traced is keeper.traced and cannot_keep_batches(model, replicas_ok=latest) is None


def _wake(model: Any, keeper: OverflowBatches, fit: Any) -> OverflowBatches:
    """A dormant keeper kept for this `fit`, as a new one would, in the same traced step."""
    keeper.restart()
    keeper.fit = fit
    replace_train_step(model, _keeping(model, keeper))  # for a later trace; none now
    keeper.active, keeper.traced = True, None
    return keeper
