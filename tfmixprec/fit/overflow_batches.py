"""The batches of overflow steps, kept on the device from inside the training step.

`explain_overflow` (the callbacks' `diagnose=`) and `PrecisionRepair` replay the batch of an
overflow step after it ran. The step keeps it in a variable on the device, where the host
waits for nothing: no host copy, and no branch on a device value.

- A batch `(x, y, sample_weight)` is kept as its bytes in one row of one variable, in 4-byte
  words (float32 bit patterns, which every strategy can broadcast): the step's record (its
  step and scale), each tensor's shape, each tensor's bytes (a uint8 image one byte a value,
  a float32 four; padded to a whole word). One row a slot, the batches of the first `limit`
  overflow steps since the keeper was (re)started and, where asked for (`PrecisionRepair`),
  the newest overflow step's, and one row more. Every step writes its batch with one scatter
  into the row no slot holds (the scratch row); an overflow step moves the count of kept
  steps on, and with it the scratch row (`fit/kept_rows.py`, `scratch_row`: which row is
  which follows from the count alone), so the row written becomes a slot's. One device copy
  of the batch a step, however many slots, and whoever keeps.
- The rows grow, in the step, where a batch is larger than any before: one branch, decided
  by shapes alone, which the host knows without waiting for the device. A smaller batch (a
  ragged last batch) is padded, and its own shapes kept in its row.
- XLA compiles a variable's size into the step, so under `jit_compile=True` the keeper
  compiles the model's step with XLA itself and keeps the batch just outside it
  (`_keras.fit.make_train_function` builds Keras's train function around it without XLA).
  Where Keras builds the train function itself with XLA (a `compile()` after
  `keep_overflow_batches`), the keeper runs inside XLA with rows of fixed size: a batch larger
  than any before is not kept (`missed`, said in a warning), and `poll` grows the rows.
- Each replica keeps its own batch (a sync-on-read variable), for `PrecisionRepair`, which
  replays them all.

The host reads the rows only when a callback acts on them: `poll` (the callbacks call it
after a step, with the counts read in the one read they share) grows the rows where a batch
did not fit; `kept` and `latest` copy a kept batch to the host, and only its values. Between
fits a callbacks' keeper is dormant and holds rows of one word each (`release`).
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
from tfmixprec.fit.kept_rows import (
    Rows,
    local_copies,
    scratch_row,
    shape_of,
    words,
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


# Kept as their bytes: these floats, integers, complex numbers, bools, strings (`_keepable`).
_FLOATS = (tf.bfloat16, tf.float16, tf.float32, tf.float64)
# A row: the step's record in 5 words (two int64 and a float32: `_line`), each tensor's shape
# (int64, 2 words a dimension), then each tensor's bytes, padded to a whole word.
_RECORD_WORDS = 5


# The counts each step adds to: overflow steps kept, steps whose batch did not fit the rows,
# and overflow steps whose batch did not fit (not kept). `fit.reader` reads them with the
# optimizer's state, in one copy, under these names.
_KEPT, _UNFIT, _MISSED = 0, 1, 2
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
        self.renewed = False  # a callbacks' trace took another structure: `poll(model)` too
        self._counts: tf.Variable | None = None  # `_KEPT`, `_UNFIT`, `_MISSED`
        self._unfit_seen = 0  # `_UNFIT` when the rows were last grown
        self._missed_said = 0  # `_MISSED` when last said
        self._rows: Rows | None = None
        self._spec: Any = None  # the first trace's batch: `TensorSpec`s (None where absent)
        self._lock = threading.Lock()  # replicas trace in threads

    @property
    def _size(self) -> int:
        return self.limit + int(self.keeps_latest)

    # ------------------------------------------------------------ in the step
    def keep_if_overflow(self, data: Any, overflowed: tf.Tensor, optimizer: Any) -> None:
        """In the step, after `apply`: writes the batch, with the step's record, into the
        scratch row; on an overflow step the count moves on and the row is a slot's (the next
        of the first `limit`, or the newest). No host copy, and no branch on a device value:
        outside XLA the rows grow in the step where the batch is larger (one branch on
        shapes, decided on the host); inside XLA, whose step keeps a variable's size, `poll`
        grows them."""
        batch = keras.utils.unpack_x_y_sample_weight(data)
        flat = tf.nest.flatten(batch)
        if not self._ready(batch, flat):
            return
        axis = tf.constant(0)  # one constant for every axis 0
        line = self._line([x for x in flat if x is not None], optimizer, axis)
        length = shape_of(line)
        if in_xla_context():  # the rows as they are: the batch may not fit
            update, fits = self._rows.fitted_to(line, length)
            kept = tf.logical_and(overflowed, fits)
        else:
            update, fits, kept = self._room_for(line, length, axis), None, overflowed
        # `_KEPT` (at index 0, `axis`) alone: one op, on the variable's device.
        count = tf.raw_ops.ResourceGather(
            resource=self._counts.handle, indices=axis, dtype=tf.int64
        )
        self._rows.write(scratch_row(count, self.limit, self.keeps_latest, vector=True), update)
        if fits is None:  # only kept steps to count: `_KEPT` (at index 0, `axis`) += kept
            tf.raw_ops.ResourceScatterAdd(
                resource=self._counts.handle, indices=axis, updates=tf.cast(kept, tf.int64)
            )
        else:  # kept, unfit, missed
            unfit = tf.logical_not(fits)
            added = tf.cast(tf.stack([kept, unfit, tf.logical_and(overflowed, unfit)]), tf.int64)
            self._counts.assign_add(added)

    def _line(self, tensors: list[tf.Tensor], optimizer: Any, axis: tf.Tensor) -> tf.Tensor:
        """The row's words: the step's record, the optimizer's `last_overflow_iteration`,
        `overflow_steps` and the scale the step used (`last_overflow_scale` on an overflow
        step, the row a slot's once the count moves on), then each tensor's shape, then each
        tensor's bytes (`_RECORD_WORDS`)."""
        vector = tf.constant([-1])  # a scalar scale and each tensor of rank 2 or more
        numbers = (optimizer.last_overflow_iteration, optimizer.overflow_steps)
        record = [tf.cast(tf.convert_to_tensor(value), tf.int64) for value in numbers]
        scale = optimizer.scale_used()  # read before the step's branch: not read again
        scale = optimizer.last_overflow_scale if scale is None else scale
        record.append(tf.cast(tf.convert_to_tensor(scale), tf.float32))
        tensors = [_serialized(x) if x.dtype == tf.string else x for x in tensors]
        shapes = [shape_of(x) for x in tensors]
        if all(isinstance(shape, np.ndarray) for shape in shapes):  # known: one constant
            shapes = [tf.constant(np.concatenate([[], *shapes]).astype(np.int64).view(np.float32))]
        else:
            shapes = [words(tf.concat(shapes, axis), vector)]
        parts = [words(value, vector) for value in record] + shapes
        return tf.concat(parts + [words(x, vector) for x in tensors], axis)

    def _room_for(self, line: tf.Tensor, length: Any, axis: tf.Tensor) -> tf.Tensor:
        """Outside XLA: the batch's words as the row they are written as, the rows grown
        first where the batch is longer than they are (one branch, on shapes alone)."""
        rows = self._rows
        row, growth = rows.room_for(line, length, tf.zeros([2], tf.int64), axis)
        with tf.device("/cpu:0"):  # the largest growth, nonzero where the rows grow
            larger = tf.cast(tf.reduce_max(growth), tf.bool)
        with tf.name_scope("keeper_rows_grow"):
            tf.cond(larger, lambda: rows.grow_in_step(growth), lambda: None)
        return row

    def _ready(self, batch: Any, flat: list[Any]) -> bool:
        """Makes the rows and counts at the first trace; False where the batch cannot be kept
        (said once). Another structure makes a user's keeper `stale` (`poll(model)` traces the
        step again); a callbacks' keeper keeps it from there (`renewed`)."""
        with self._lock:
            if self.unkept is not None or self.stale:
                return False
            kinds = [x for x in flat if x is not None and not isinstance(x, tf.Tensor)]
            if kinds:
                return self._cannot(f"a {type(kinds[0]).__name__} in the batch")
            odd = [x for x in flat if x is not None and not _keepable(x)]
            if odd:
                return self._cannot(f"a {odd[0].dtype.name} tensor of shape {odd[0].shape}")
            spec = tf.nest.map_structure(_spec_of, batch)
            if self._spec is None:
                if not self._slots_made():  # none made before the trace: made in it
                    with tf.init_scope():
                        self._make_slots()
                self._spec = spec
            elif not _same_structure(self._spec, spec):
                if self.owner == "callbacks":  # another fit's batches: kept from this step
                    with tf.init_scope():  # the rows hold words of any structure
                        self.restart()
                    self._spec, self.renewed = spec, True  # `poll`: no trace of the old one
                    return True
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

    def make_slots_now(self, model: Any) -> None:
        """Before the step's first trace: the counts and rows made now, under `model`'s
        strategy, as the trace would make them (they hold no batch's shape). TensorFlow traces
        a step again where its first trace made a variable; with them made first, one trace.
        Made again where `limit` or `keeps_latest` changed since; nothing once traced."""
        if self._spec is None and not self._slots_made():
            with model.distribute_strategy.scope():
                self._make_slots()

    def _slots_made(self) -> bool:
        return self._rows is not None and self._rows.rows == self._size + 1

    def _make_slots(self) -> None:
        self._counts = replica_variable(tf.zeros([3], tf.int64))
        self._unfit_seen = self._missed_said = 0
        self._rows = Rows(self._size + 1)  # a row a slot, and the scratch row

    def _cannot(self, why: str) -> bool:
        kept = "only dense tensors of numbers, bools or strings, of a known rank, are kept"
        self.unkept = f"batches are not kept: {why} ({kept})"
        warnings.warn(f"tfmixprec: {self.unkept}. {docs_page('guides/why-overflow')}", stacklevel=5)
        return False

    # ------------------------------------------------------------ on the host
    def counts_variable(self) -> tf.Variable | None:
        """The counts `poll` reads (the first replica's), for a reader that reads them with
        other values in one copy; None before a traced step made them."""
        return None if self._counts is None else local_copies(self._counts)[0]

    def poll(self, model: Any = None, counts: dict[str, int] | None = None) -> int:
        """Between steps: reads the counts (one small read; none where `counts`, read with
        other values, are given: `KEEPER_COUNTS`), grows the rows where a step's batch did
        not fit, and, given the `model` whose step holds this keeper, traces that step again
        where it met another batch structure. Returns `seen`."""
        if self.renewed and model is not None and current_keeper(model) is self:
            self.renewed = False
            set_keeper(model, self)  # the same rows, in a train function of its own
        if self.stale and model is not None and current_keeper(model) is self:
            self.forget()
            set_keeper(model, self)
        if self._counts is None:
            return 0
        if counts is not None and all(name in counts for name in KEEPER_COUNTS):
            counts = [counts[name] for name in KEEPER_COUNTS]
        else:
            counts = local_copies(self._counts)[0].numpy()
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
            self._rows.grow()
        return int(counts[_KEPT])

    @property
    def seen(self) -> int:
        """Overflow steps kept since the keeper (re)started (`poll`)."""
        return self.poll()

    @property
    def missed(self) -> int:
        """Overflow steps since the keeper (re)started whose batch was larger than the rows
        then (an unknown batch size in the first step, or a larger batch): not kept."""
        return 0 if self._counts is None else int(local_copies(self._counts)[0].numpy()[_MISSED])

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
        return [self._read(copy, self.limit) for copy in range(len(local_copies(self._counts)))]

    @property
    def nbytes(self) -> int:
        """The bytes the rows hold on the device, every replica's copies together (one
        small host read a copy)."""
        if self._rows is None:
            return 0
        return sum(int(np.prod(tf.shape(c).numpy())) * 4 for c in local_copies(self._rows.data))

    @property
    def traced_once(self) -> bool:
        """Whether a step was traced with the slots (their number is fixed from then)."""
        return self._spec is not None

    def forget(self) -> None:
        """Drops the slots: the next traced step makes them again (for another `limit`, the
        newest batch or another batch structure), and keeps from there."""
        self._counts = self._rows = self._spec = None
        self.unkept, self.stale, self.renewed = None, False, False

    def restart(self) -> None:
        """Keeps from the next overflow step on as if new (the rows are reused)."""
        if self._counts is not None:
            for copy in local_copies(self._counts):
                copy.assign(tf.zeros([3], tf.int64))
            self._unfit_seen = self._missed_said = 0

    def _read(self, copy: int, slot: int) -> KeptBatch:
        if slot < self.limit:
            row = slot
        else:  # the newest: the row written at the last count
            count = local_copies(self._counts)[copy].numpy()[_KEPT] - 1
            row = int(scratch_row(tf.constant(count), self.limit, self.keeps_latest))
        specs = [_as_kept(spec) for spec in tf.nest.flatten(self._spec)]  # None: absent
        ranks = [spec.shape.rank for spec in specs if spec is not None]
        head = self._rows.read(copy, row, 0, _RECORD_WORDS + 2 * sum(ranks))  # record, shapes
        iteration, overflows = (int(n) for n in head[:4].view(np.int64))
        scale = float(head[4])
        shapes, start = head[_RECORD_WORDS:].view(np.int64), len(head)
        flat = []
        for spec in specs:  # each tensor's words alone, as the tensor
            if spec is not None:
                shape, shapes = shapes[: spec.shape.rank], shapes[spec.shape.rank :]
                dtype = np.dtype(spec.dtype.as_numpy_dtype)
                size = int(np.prod(shape)) * dtype.itemsize  # in bytes; in words, rounded up
                words = self._rows.read(copy, row, start, -(-size // 4))
                value = words.view(np.uint8)[:size].view(dtype).reshape(shape)
                if spec.name == "string":  # its `TensorProto`'s bytes (`_serialized`)
                    value = tf.io.parse_tensor(value.tobytes(), tf.string).numpy()
                flat.append(value)
                start += len(words)
            else:
                flat.append(None)
        batch = tuple(tf.nest.pack_sequence_as(self._spec, flat))
        # The step as `loss_scale.step_number` counts it: applied steps before it, and
        # overflow steps before it.
        return KeptBatch(iteration + overflows - 1, scale, batch)

    def release(self) -> None:
        """Between fits (a dormant keeper): the rows back to one word each, so no device
        memory is held for the largest batch seen; the next step grows them."""
        if self._rows is not None:
            self._rows.release()


def _keepable(value: tf.Tensor) -> bool:
    kind = value.dtype
    numbers = kind.is_bool or kind.is_complex or kind in _FLOATS or kind.is_integer
    return kind == tf.string or (value.shape.rank is not None and numbers)


def _serialized(value: tf.Tensor) -> tf.Tensor:
    """A tensor of strings as the bytes of its `TensorProto` (uint8, on the host: a device
    holds no strings); `_read` parses them back."""
    return tf.io.decode_raw(tf.io.serialize_tensor(value), tf.uint8)


def _as_kept(spec: Any) -> Any:
    """The spec of what a row holds for a tensor of `spec`: a string tensor's bytes (named
    "string", for `_read`), else the tensor."""
    if spec is None or spec.dtype != tf.string:
        return spec
    return tf.TensorSpec([None], tf.uint8, name="string")


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
    stops keeping. Either way the train function is traced again, after the keeper's slots
    are made (`make_slots_now`: not in the trace, which would trace the step twice)."""
    if keeper is not None:
        keeper.make_slots_now(model)
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
        current.make_slots_now(model)  # again where the limit or the newest batch changed
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
