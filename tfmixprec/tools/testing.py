"""Tools for testing mixed-precision training: faults on chosen steps, and a local cluster.

`FaultInjector` decides, once, which steps are faulty (chosen ones or a random fraction), and
corrupts those steps' gradients or inputs with NaN or Inf, in the graph, by step index.
`run_workers` runs one command as every worker of a `MultiWorkerMirroredStrategy` cluster on
127.0.0.1 (its own `TF_CONFIG` each, free ports), bounded in time and always cleaned up.
`host_waits` lists what one step of a model's `fit` makes the host wait for, from the graph
Keras traced; `step_ops` counts that graph's ops by type.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf

from tfmixprec._common.validate import check_int_at_least_one
from tfmixprec._keras.fit import compiled_with_xla, traced_train_functions

Batch = TypeVar("Batch")  # a tensor or a nest of tensors, returned in the same structure

__all__ = [
    "FaultInjector",
    "HostWait",
    "WorkerResult",
    "host_waits",
    "local_cluster",
    "run_workers",
    "step_ops",
]


class FaultInjector:
    """Makes chosen or random steps non-finite.

    Args:
        total_steps: Int. How many steps the schedule covers (steps beyond it are clean).
        steps: Iterable of ints. The 0-based steps to corrupt.
        rate: Float in [0, 1]. Instead of `steps`: corrupt each step with this probability
            (drawn once, with `seed`).
        seed: Int. Seed for `rate`.
        value: Float. `nan`, `inf` or `-inf`: what the corrupted values become.

    Raises:
        ValueError: For a bad count, rate, step or value, or both/neither of `steps`/`rate`.

    Example:

    >>> faults = tfmixprec.testing.FaultInjector(1000, rate=0.1, seed=0)
    >>> grads = faults.corrupt_gradients(grads)          # in a custom training step
    >>> dataset = faults.corrupt_dataset(dataset)        # or the inputs, for model.fit
    """

    def __init__(
        self,
        total_steps: int,
        steps: Iterable[int] | None = None,
        rate: float | None = None,
        seed: int = 0,
        value: float = float("nan"),
    ) -> None:
        total_steps = check_int_at_least_one("total_steps", total_steps)
        if (steps is None) == (rate is None):
            raise ValueError(
                "Pass exactly one of steps (which steps to corrupt) or rate (a random "
                f"fraction). Received: steps={steps!r}, rate={rate!r}"
            )
        if not isinstance(value, (int, float)) or math.isfinite(value):
            raise ValueError(f"value must be nan, inf or -inf. Received: value={value!r}")
        schedule = np.zeros(total_steps, dtype=bool)
        if steps is not None:
            steps = list(steps)
            bad = [
                s for s in steps if not isinstance(s, (int, np.integer)) or not 0 <= s < total_steps
            ]
            if bad:
                raise ValueError(
                    f"steps must be integers in [0, {total_steps}). Received: steps "
                    f"containing {bad[0]!r}"
                )
            schedule[steps] = True
        else:
            if not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
                raise ValueError(f"rate must be in [0, 1]. Received: rate={rate!r}")
            schedule = np.random.default_rng(seed).random(total_steps) < rate
        self.total_steps = total_steps
        self.value = float(value)
        self.schedule = schedule
        self._schedule = tf.constant(np.concatenate([schedule, [False]]))
        self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="fault_step")

    @property
    def injected_steps(self) -> list[int]:
        """The 0-based steps that are corrupted."""
        return [int(s) for s in np.flatnonzero(self.schedule)]

    def is_faulty(self, step: int) -> bool:
        """Whether 0-based `step` is corrupted."""
        return 0 <= step < self.total_steps and bool(self.schedule[step])

    def _flag(self, step: tf.Tensor) -> tf.Tensor:
        index = tf.minimum(tf.cast(step, tf.int64), self.total_steps)
        return tf.gather(self._schedule, index)

    def _poison(self, tensor: Any, flag: tf.Tensor) -> Any:
        if isinstance(tensor, tf.IndexedSlices):
            return tf.IndexedSlices(
                self._poison(tensor.values, flag), tensor.indices, tensor.dense_shape
            )
        tensor = tf.convert_to_tensor(tensor)
        if not tensor.dtype.is_floating:
            return tensor
        bad = tf.fill(tf.shape(tensor), tf.constant(self.value, tensor.dtype))
        return tf.where(flag, bad, tensor)

    def corrupt_gradients(self, grads: Sequence[Any]) -> list[Any]:
        """Returns `grads` with the first gradient made non-finite on a faulty step.

        Each call is one step (an internal counter advances, in the graph).

        Args:
            grads: List of gradients (tensors, `tf.IndexedSlices` or `None`).

        Returns:
            The list, corrupted or not.
        """
        flag = self._flag(self._step.assign_add(1) - 1)
        grads = list(grads)
        for i, grad in enumerate(grads):
            if grad is not None:
                grads[i] = self._poison(grad, flag)
                break
        return grads

    def corrupt_inputs(self, x: Batch, step: Any) -> Batch:
        """Returns the batch `x` (a tensor or nest), all float values non-finite on a faulty
        `step`.

        Args:
            x: Tensor or nest of tensors. One batch of inputs.
            step: Int tensor. The 0-based step of this batch.
        """
        flag = self._flag(step)
        return tf.nest.map_structure(lambda t: self._poison(t, flag), x)

    def corrupt_dataset(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """Corrupts the inputs of the faulty batches of a batched `(x, y, ...)` dataset.

        Args:
            dataset: `tf.data.Dataset` of batches whose first element is the inputs.

        Returns:
            A dataset with the same structure.
        """

        def corrupt(step, batch):
            if isinstance(batch, tuple):
                return (self.corrupt_inputs(batch[0], step),) + batch[1:]
            return self.corrupt_inputs(batch, step)

        return dataset.enumerate().map(corrupt)

    def reset(self) -> None:
        """Starts counting steps from 0 again (for `corrupt_gradients`)."""
        self._step.assign(0)


# ------------------------------------------------------------------ a local cluster
def local_cluster(num_workers: int = 2) -> list[dict[str, Any]]:
    """The `TF_CONFIG` of each worker of a cluster on 127.0.0.1, on free ports.

    Args:
        num_workers: Int >= 1. How many workers.

    Returns:
        One dict a worker, `{"cluster": {"worker": [...]}, "task": {"type": "worker",
        "index": i}}`: set `os.environ["TF_CONFIG"] = json.dumps(config)` in worker `i`.

    Example:

    >>> configs = tfmixprec.testing.local_cluster(2)
    >>> configs[1]["task"]
    {'type': 'worker', 'index': 1}
    """
    num_workers = check_int_at_least_one("num_workers", num_workers)
    sockets = [socket.socket() for _ in range(num_workers)]
    try:
        for sock in sockets:  # all bound at once: distinct ports
            sock.bind(("127.0.0.1", 0))
        workers = [f"127.0.0.1:{sock.getsockname()[1]}" for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
    return [
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        for index in range(num_workers)
    ]


@dataclasses.dataclass
class WorkerResult:
    """How one worker of `run_workers` ended.

    Attributes:
        index: Int. The worker's task index.
        returncode: Int. Its exit status (negative: killed by that signal; -9 when
            `run_workers` killed it because another worker failed or time ran out).
        stdout: String. What it printed.
        stderr: String. What it printed to stderr.
    """

    index: int
    returncode: int
    stdout: str
    stderr: str


def run_workers(
    command: Sequence[str],
    num_workers: int = 2,
    timeout: float = 300.0,
    grace: float = 20.0,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> list[WorkerResult]:
    """Runs `command` once for each worker of a local cluster (`local_cluster`), in parallel.

    Each process gets its own `TF_CONFIG` (and `TF_CPP_MIN_LOG_LEVEL=2` unless `env` sets
    it). Once a worker fails, the others (which then wait for it in a collective) get `grace`
    seconds to end, then are killed; so is every worker still running after `timeout`.
    Nothing is left running when it returns or raises.

    Args:
        command: List of strings. The program and its arguments, e.g.
            `[sys.executable, "train.py"]`.
        num_workers: Int >= 1. How many workers.
        timeout: Float. Seconds for the whole run.
        grace: Float. Seconds the other workers get after one fails.
        env: Optional dict. The environment (default: this process's).
        cwd: Optional string. The working directory.

    Returns:
        A `WorkerResult` a worker, in task order. Check each `returncode`.

    Raises:
        TimeoutError: If a worker was still running after `timeout` seconds; its message
            holds the end of every worker's stderr.
    """
    num_workers = check_int_at_least_one("num_workers", num_workers)
    base = dict(os.environ if env is None else env)
    base.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with tempfile.TemporaryDirectory(prefix="tfmixprec-workers-") as folder:
        procs: list[Any] = []
        try:
            for index, config in enumerate(local_cluster(num_workers)):
                worker_env = {**base, "TF_CONFIG": json.dumps(config)}
                procs.append(_start_worker(command, worker_env, cwd, folder, index))
            timed_out = _wait_for_workers(procs, timeout, grace)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        results = [_result(proc, folder, index) for index, proc in enumerate(procs)]
    if timed_out:
        tails = "\n".join(f"--- worker {r.index} stderr:\n{r.stderr[-2000:]}" for r in results)
        raise TimeoutError(
            f"The {num_workers} workers of {list(command)!r} were still running after "
            f"timeout={timeout!r} seconds and were killed.\n{tails}"
        )
    return results


def _start_worker(
    command: Sequence[str], env: dict[str, str], cwd: str | None, folder: str, index: int
) -> Any:
    """Starts one worker, its output going to files in `folder` (no pipe to fill up)."""
    with open(os.path.join(folder, f"{index}.out"), "w") as out:
        with open(os.path.join(folder, f"{index}.err"), "w") as err:
            return subprocess.Popen(list(command), env=env, cwd=cwd, stdout=out, stderr=err)


def _result(proc: Any, folder: str, index: int) -> WorkerResult:
    with open(os.path.join(folder, f"{index}.out")) as out:
        with open(os.path.join(folder, f"{index}.err")) as err:
            return WorkerResult(index, proc.returncode, out.read(), err.read())


def _wait_for_workers(procs: list[Any], timeout: float, grace: float) -> bool:
    """Waits until every process ended; True if some were still running at `timeout`. After a
    failure the rest get `grace` seconds (then the caller kills them)."""
    deadline = time.monotonic() + timeout
    failed = False
    while any(proc.poll() is None for proc in procs):
        if not failed and any(proc.poll() not in (None, 0) for proc in procs):
            failed = True
            deadline = min(deadline, time.monotonic() + grace)
        if time.monotonic() > deadline:
            return not failed
        time.sleep(0.1)
    return False


# ------------------------------------------------------------------ host waits
# Ops that make the host wait for a device value when they run outside an XLA cluster (inside
# one, XLA keeps them on the device): a conditional or a loop reads its predicate on the host;
# a Python function and a host-side check copy their inputs there; an op whose output size
# depends on its values reads that size. On a CPU the wait costs nothing; on a GPU the step
# stalls until the device has computed the value.
HOST_WAIT_OPS = {
    "If": "conditional",
    "StatelessIf": "conditional",
    "Case": "conditional",
    "StatelessCase": "conditional",
    "While": "loop",
    "StatelessWhile": "loop",
    "EagerPyFunc": "py_function",
    "PyFunc": "py_function",
    "PyFuncStateless": "py_function",
    "Assert": "host check",
    "Print": "host check",
    "PrintV2": "host check",
    "Where": "data-dependent shape",
    "Unique": "data-dependent shape",
    "UniqueV2": "data-dependent shape",
    "DynamicPartition": "data-dependent shape",
}
# tfmixprec names the scope of each conditional it builds by what it decides.
PURPOSES = {
    "apply_or_skip": "applies the step or skips it (the finite check)",
    "accumulation_window": "applies at the end of an accumulation window",
    "unscaled_record": "reads the unscaling record (get_unscaled_gradients)",
}
_FUNCTION_ATTRS = ("f", "then_branch", "else_branch", "body", "cond", "branches")
# A predicate computed from tensor shapes alone needs no device value: TensorFlow knows a
# tensor's shape on the host once the op that makes it is launched. Shape ops end the walk.
_SHAPES = frozenset({"Shape", "ShapeN", "VariableShape", "Size", "Rank", "Const"})
_ON_SHAPES = frozenset(
    {
        "Identity", "StridedSlice", "Slice", "Pack", "ConcatV2", "Reshape", "Cast",
        "Sub", "Add", "AddV2", "Maximum", "Minimum", "Max", "Min", "Sum", "Any", "All",
        "Greater", "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual",
        "LogicalAnd", "LogicalOr", "LogicalNot",
    }
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class HostWait:
    """One op of a traced step that makes the host wait for a device value.

    Attributes:
        op: String. The op type (`"If"`, `"EagerPyFunc"`, ...).
        kind: String. `"conditional"`, `"loop"`, `"py_function"`, `"host check"` or
            `"data-dependent shape"`.
        where: String. The node's name, after the names of the function calls that lead to it.
        purpose: String. What it decides, where known.
    """

    op: str
    kind: str
    where: str
    purpose: str


def host_waits(model: Any) -> tuple[HostWait, ...]:
    """What one step of `model.fit` makes the host wait for: the ops of the train function
    Keras traced last that need a device value on the host, outside XLA clusters.

    Call it after a `fit` (the train function is traced then). Conditionals and loops inside
    an XLA-compiled function (`jit_compile=True`) stay on the device and are not listed, nor is
    a conditional whose predicate is computed from tensor shapes alone (the host knows a
    tensor's shape without waiting for its value; tfmixprec's batch keeper grows its rows
    that way). With `steps_per_execution > 1`, the ops of every step the execution unrolls
    are listed.

    Args:
        model: `keras.Model`. A model that has run `fit` (not with `run_eagerly=True`).

    Returns:
        A tuple of `HostWait`, in the order the graph holds them.

    Raises:
        ValueError: If the model's train function has not been traced.

    Example:

    >>> model.fit(x, y, epochs=1)
    >>> [wait.purpose for wait in tfmixprec.testing.host_waits(model)]
    ['applies the step or skips it (the finite check)']
    """
    graph, library = _traced_step(model, "host_waits")
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    walk = _Walk(library, getattr(inner, "name", None))
    xla = compiled_with_xla(traced_train_functions(model)[-1])  # Keras 3.16: the step alone
    walk.nodes(graph.node, "", xla, "")
    return tuple(walk.found)


def step_ops(model: Any) -> dict[str, int]:
    """The ops of the train function Keras traced last for `model.fit`, counted by op type.

    Every node counts: the traced function's own and those of every function it calls, each
    function once (the step's body, both branches of each conditional, a loop's condition and
    body), whether or not a branch runs on a given step. Without XLA each op that computes is
    a kernel launch on a GPU. Call it after a `fit`; compare two models by the same count
    (`benchmarks/step_ops.py` compares tfmixprec's step with Keras's own).

    Args:
        model: `keras.Model`. A model that has run `fit` (not with `run_eagerly=True`).

    Returns:
        A dict from op type (`"ReadVariableOp"`, ...) to its count, sorted by op type.

    Raises:
        ValueError: If the model's train function has not been traced.

    Example:

    >>> model.fit(x, y, epochs=1)
    >>> tfmixprec.testing.step_ops(model)["If"]  # apply or skip: the step's one conditional
    1
    """
    graph, library = _traced_step(model, "step_ops")
    counts: Counter = Counter()
    todo, seen = [graph.node], set()
    while todo:
        for node in todo.pop():
            counts[node.op] += 1
            for name in _called(node.attr):
                if name in library and name not in seen:
                    seen.add(name)
                    todo.append(library[name].node_def)
    return dict(sorted(counts.items()))


def _traced_step(model: Any, caller: str) -> tuple[Any, dict[str, Any]]:
    """The `GraphDef` of the train function Keras traced last, and its functions by name."""
    traced = traced_train_functions(model)
    if not traced:
        raise ValueError(
            f"model {getattr(model, 'name', model)!r} has no traced train function: call "
            f"fit() first (without run_eagerly=True), then {caller}(model)."
        )
    graph = traced[-1].graph.as_graph_def()
    return graph, {function.signature.name: function for function in graph.library.function}


class _Walk:
    """Walks a graph's nodes and the functions they call, noting the host waits."""

    def __init__(self, library: dict[str, Any], optimizer: str | None) -> None:
        self.library, self.optimizer, self.found = library, optimizer, []

    def nodes(self, nodes: Any, path: str, xla: bool, parent: str) -> None:
        by_name = {node.name: node for node in nodes}
        for node in nodes:
            attrs = node.attr
            compiled = xla or ("_XlaMustCompile" in attrs and attrs["_XlaMustCompile"].b)
            where = f"{path}/{node.name}"
            purpose = parent
            if not compiled and _waits(node) and not _decided_by_shapes(node, by_name):
                purpose = self.purpose(node, parent)
                kind = HOST_WAIT_OPS[node.op]
                self.found.append(HostWait(node.op, kind, where.lstrip("/"), purpose))
            for name in _called(attrs):
                function = self.library.get(name)
                if function is not None:
                    inside = compiled or (
                        "_XlaMustCompile" in function.attr and function.attr["_XlaMustCompile"].b
                    )
                    self.nodes(function.node_def, where, inside, purpose)

    def purpose(self, node: Any, parent: str) -> str:
        for scope in reversed(node.name.split("/")):  # the innermost named scope
            if scope in PURPOSES:
                return PURPOSES[scope]
        if node.op == "EagerPyFunc" or node.op.startswith("PyFunc"):
            return "copies values to the host (a Python function)"
        if self.optimizer and any(self._updates(name) for name in _called(node.attr)):
            return "applies the step or skips it (the finite check)"
        return f"inside: {parent}" if parent else "unknown"

    def _updates(self, name: str) -> bool:
        """Whether a called function holds the optimizer's update (its name scope)."""
        function = self.library.get(name)
        marker = f"{self.optimizer}"
        return function is not None and any(
            part == marker or part.startswith(marker + "_")
            for node in function.node_def
            for part in node.name.split("/")
        )


def _decided_by_shapes(node: Any, by_name: dict[str, Any]) -> bool:
    """Whether a conditional's predicate is computed from tensor shapes alone."""
    if HOST_WAIT_OPS.get(node.op) != "conditional":
        return False
    todo, seen = [_data_inputs(node)[0]], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        source = by_name.get(name)
        if source is None or not (source.op in _SHAPES or source.op in _ON_SHAPES):
            return False  # a function argument, or an op on values
        if source.op in _ON_SHAPES:
            todo += _data_inputs(source)
    return True


def _data_inputs(node: Any) -> list[str]:
    """The names of the nodes a node's data inputs come from (`node:output:index`)."""
    return [i.split(":")[0] for i in node.input if not i.startswith("^")]


def _waits(node: Any) -> bool:
    if node.op not in HOST_WAIT_OPS:
        return False
    return not (node.op == "Where" and len([i for i in node.input if not i.startswith("^")]) > 1)


def _called(attrs: Any) -> list[str]:
    names = []
    for key in _FUNCTION_ATTRS:
        if key in attrs:
            value = attrs[key]
            names += (
                [value.func.name] if value.HasField("func") else [f.name for f in value.list.func]
            )
    return names
