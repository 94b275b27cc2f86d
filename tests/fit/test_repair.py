"""PrecisionRepair: the right step and layers on a plain keras.Model, a MixedPrecisionModel, a
KerasHub model and 2 replicas; nothing repaired on bad data or when the scale suffices."""

import importlib.util
import json
import sys
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from overflow_models import loss_data, loss_model, overflowing, two_branches
from overflow_models import model as overflow_model
from tensorflow.python.framework import ops as tf_ops

import tfmixprec
from tfmixprec._common.layers import iter_layers, layer_names
from tfmixprec.tools.testing import run_workers

WORKERS = Path(__file__).resolve().parents[1] / "workers"

MESSAGE = "'big': its outputs reach 1.036e+05, past float16's 65504"
# Training goes on at 4096: the largest gradient of a float16 layer (`after`, 1.73 on step 4's
# batch) times 4096 stays 8x under 65504.
REPAIR = tfmixprec.Repair(4, ("big", "proj"), "forward-overflow", MESSAGE, 4096.0)


class _Weights(keras.callbacks.Callback):
    """The weights at the end of each batch, in the order the batches ran."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append([w.copy() for w in self.model.get_weights()])


def _fit(model, repair, epochs=2, data=None, **kwargs):
    x, y = data if data is not None else overflowing()
    watch = _Weights()
    history = model.fit(
        x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0, callbacks=[repair, watch]
    )
    return history, watch


@pytest.mark.parametrize(
    "kind, jit_compile",
    [
        ("keras", "auto"),  # Keras's default: XLA on a GPU (none on a CPU)
        ("mixed_precision_model", "auto"),
        ("keras", True),  # XLA: the same repair at the same step
    ],
)
def test_the_repair_comes_at_the_fifth_overflow_in_the_right_layers(kind, jit_compile, capsys):
    if kind == "keras":  # compiled the Keras way: Keras's own LossScaleOptimizer, adopted
        with tfmixprec.policy_scope("mixed_float16"):
            model = overflow_model("flows", optimizer=keras.optimizers.SGD(1e-6))
    else:
        model = overflow_model("flows", cls=tfmixprec.MixedPrecisionModel)
    if jit_compile is True:
        model.jit_compile = True
    start = model.get_weights()
    repair = tfmixprec.PrecisionRepair()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history, watch = _fit(model, repair)
    assert not [w for w in caught if "PrecisionRepair" in str(w.message)]  # on, not off
    assert model.jit_compile is (jit_compile is True)
    assert repair.repairs == repair.judgments == [REPAIR]
    assert str(REPAIR) in capsys.readouterr().out.splitlines()
    assert history.history["repairs"] == [1.0, 1.0]
    state = model.optimizer.read_state()
    assert (state["overflow_steps"], state["iterations"]) == (5, 11)  # none after the repair
    assert state["loss_scale"] == REPAIR.loss_scale  # restarted there, not left at 1024
    for weights in watch.seen[:5]:  # the skipped steps changed nothing
        assert all(a.tobytes() == b.tobytes() for a, b in zip(weights, start))
    assert all(np.isfinite(history.history["loss"]))
    policies = {layer.name: layer.compute_dtype for layer in model.layers}
    assert (policies["big"], policies["proj"], policies["after"]) == ("float32",) * 2 + ("float16",)


@pytest.fixture(scope="module")
def repaired_flows(tmp_path_factory):
    """One fit of the "flows" model over `overflowing()` (batches of 32, two epochs) with
    PrecisionRepair, tfmixprec's TensorBoard and a LossScaleMonitor: the saving, TensorBoard,
    audit and monitor tests and the one-device side of the 2-replica test each read what
    this one fit left."""
    log_dir = str(tmp_path_factory.mktemp("repair_board") / "run")
    model = overflow_model("flows")
    monitor = tfmixprec.LossScaleMonitor(update_freq=8)
    repair = tfmixprec.PrecisionRepair(verbose=0)
    callbacks = [repair, tfmixprec.TensorBoard(log_dir), monitor]
    model.fit(*overflowing(), batch_size=32, epochs=2, shuffle=False, verbose=0,
              callbacks=callbacks)  # fmt: skip
    return model, log_dir, monitor, repair


def test_a_repaired_model_saves_and_loads_its_policies(repaired_flows, tmp_path):
    model = repaired_flows[0]
    path = str(tmp_path / "repaired.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    policies = {layer.name: layer.dtype_policy.name for layer in loaded.layers[1:]}
    assert policies == {layer.name: layer.dtype_policy.name for layer in model.layers[1:]}
    assert policies == {"big": "float32", "proj": "float32"} | {
        "after": "mixed_float16",
        "out": "float32",
    }
    x = overflowing(32)[0]
    assert np.array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    assert np.isfinite(loaded.predict(x, verbose=0)).all()


def test_two_replicas_repair_as_one_device(two_cpu_strategy, repaired_flows):
    one, repair_one = repaired_flows[0], repaired_flows[3]
    two = overflow_model("flows", strategy=two_cpu_strategy)
    repair_two = tfmixprec.PrecisionRepair(verbose=0)
    _fit(two, repair_two)
    # Each replica's batch is replayed: the message names the first one's values.
    found = [(r.step, r.layers, r.cause) for r in repair_one.repairs + repair_two.repairs]
    assert found == [(4, ("big", "proj"), "forward-overflow")] * 2
    assert two.optimizer.read_state()["overflow_steps"] == 5
    for a, b in zip(one.get_weights(), two.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)  # 11 float32 SGD steps


def test_a_kerashub_model_compiled_the_ordinary_way():
    """GPT-2's first feed-forward kernel x3000: GELU's backward squares its ~340 inputs
    (past 65504) in float16, so those gradients are not finite at any scale."""
    pytest.importorskip("keras_hub")  # the minimum-versions run has no KerasHub
    with tfmixprec.policy_scope("mixed_float16"):
        zoo = tfmixprec.zoo.build("gpt2")
        model = zoo.model
        model.compile(keras.optimizers.SGD(1e-4), zoo.loss)
    end = "transformer_layer_0/feedforward_intermediate_dense"
    name = next(key for key in layer_names(model).values() if key.endswith(end))
    assert name.startswith(model.backbone.name)  # the backbone, its block, the layer
    layer = next(layer for layer in iter_layers(model) if layer_names(model)[id(layer)] == name)
    layer.kernel.assign(layer.kernel * 3000.0)
    x, y, weights = zoo.data(8)
    repair = tfmixprec.PrecisionRepair(verbose=0)
    model.fit(x, y, sample_weight=weights, batch_size=zoo.batch_size, epochs=1, shuffle=False,
              verbose=0, callbacks=[repair])  # fmt: skip
    assert [(r.step, r.layers, r.cause) for r in repair.repairs] == [
        (4, (name,), "backward-overflow")
    ]
    state = model.optimizer.read_state()
    assert (state["overflow_steps"], state["iterations"]) == (5, 3)


def test_bad_data_is_named_not_repaired(capsys):
    model = overflow_model("norm")
    x, y = overflowing(every=10**6)  # nothing passes 65504
    x[::8, 3] = np.nan
    repair = tfmixprec.PrecisionRepair()
    _fit(model, repair, epochs=1, data=(x, y))
    assert repair.repairs == []
    [judgment] = repair.judgments
    assert (judgment.step, judgment.cause, judgment.layers) == (4, "bad-data", ())
    assert str(judgment) == (
        "PrecisionRepair: step 4: not repaired (bad-data): the batch's inputs hold 4 NaN/Inf "
        "values: no float32 layer and no loss scale can fix this. Clean or filter the data "
        "(dataset.filter on tf.math.is_finite)."
    )
    said = capsys.readouterr().out.splitlines()
    # Where this machine routes float16 layers, the callbacks' route line comes first.
    assert [line for line in said if " routed " not in line] == [str(judgment)]
    assert all(layer.compute_dtype != "float32" for layer in model.layers[1:-1])


def test_nothing_is_repaired_when_the_scale_suffices(capsys):
    """Gradients past 65504 at 2^15 but finite lower down: 7 overflows in a row, judged once
    (the scale absorbs them), no repair; the judgment is recorded and printed, cause none."""
    model = overflow_model("norm")
    big = model.get_layer("big")
    big.kernel.assign(np.full(big.kernel.shape, 0.1, "float32"))
    x, _ = overflowing(every=10**6)
    repair = tfmixprec.PrecisionRepair()
    _fit(model, repair, epochs=1, data=(x, np.full((256, 1), 3.0, "float32")))
    assert repair.repairs == []
    none = tfmixprec.Repair(4, (), "none", tfmixprec.fit.repair.NONE_MESSAGE)
    assert repair.judgments == [none]
    assert str(none) == (
        "PrecisionRepair: step 4: not repaired (none): only the scaled gradients overflowed, "
        "which the dynamic loss scale absorbs"
    )
    assert str(none) in capsys.readouterr().out.splitlines()
    assert model.optimizer.read_state()["overflow_steps"] >= 5


def test_max_repairs_is_respected():
    x = 0.1 * np.random.default_rng(1).normal(size=(320, 8)).astype("float32")
    x[:160:8, 0] = 10.0  # batches 0-4 overflow big1, batches 5-9 big2
    x[160::8, 1] = 10.0
    y = np.zeros((320, 1), "float32")
    layers = []
    for most in (1, 2):
        repair = tfmixprec.PrecisionRepair(max_repairs=most, verbose=0)
        _fit(two_branches(), repair, epochs=1, data=(x, y))
        layers.append([r.layers for r in repair.repairs])
    assert layers == [[("big1", "proj1")], [("big1", "proj1"), ("big2", "proj2")]]


def test_armed_it_reads_one_count_a_batch_while_nothing_overflows(monkeypatch):
    """In the batches of a clean fit, one device-to-host read a batch beyond what a fit
    without it makes: the keeper's overflow count, after Keras's own read of the batch's logs
    (EagerTensor._numpy is behind .numpy(), float() and np.asarray). None inside the step:
    tests/fit/test_host_waits.py walks its graph."""
    counts = []
    original = tf_ops._EagerTensorBase._numpy
    for callbacks in ([], [tfmixprec.PrecisionRepair()]):
        model = overflow_model("norm")
        big = model.get_layer("big")
        big.kernel.assign(np.full(big.kernel.shape, 1e-3, "float32"))
        model.fit(*overflowing(every=10**6), epochs=1, verbose=0, callbacks=callbacks)  # traced
        reads = []

        def counting(tensor, reads=reads):
            reads.append(1)
            return original(tensor)

        class Window(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                if batch == 1:
                    monkeypatch.setattr(tf_ops._EagerTensorBase, "_numpy", counting)

            def on_train_batch_end(self, batch, logs=None):  # before the epoch's end reads
                if batch == 7:
                    monkeypatch.setattr(tf_ops._EagerTensorBase, "_numpy", original)

        model.fit(*overflowing(every=10**6), epochs=1, verbose=0, callbacks=[*callbacks, Window()])
        counts.append(len(reads))
    assert counts[1] == counts[0] + 7  # batches 1 to 7: one count each
    assert model.optimizer.read_state()["overflow_steps"] == 0


def test_config_round_trip_and_bad_arguments():
    repair = tfmixprec.PrecisionRepair(max_repairs=2, max_consecutive=7, verbose=0)
    again = tfmixprec.PrecisionRepair.from_config(repair.get_config())
    assert again.get_config() == {"max_repairs": 2, "max_consecutive": 7, "verbose": 0}
    for name in ("max_repairs", "max_consecutive"):
        with pytest.raises(ValueError, match=name):
            tfmixprec.PrecisionRepair(**{name: 0})


def test_without_loss_scaling_it_does_nothing():
    model = overflow_model("flows")
    model.compile(keras.optimizers.SGD(1e-6), "mse", auto_scale_loss=False)
    repair = tfmixprec.PrecisionRepair()
    _fit(model, repair, epochs=1)
    assert repair.judgments == []
    assert tfmixprec.overflow_batches.current_keeper(model) is None  # nothing kept in its step


@pytest.mark.slow
def test_two_workers_make_the_same_repair_at_the_same_step(tmp_path):
    """Only worker 1's shard passes 65504; worker 0's batch replays finite. The verdicts are
    summed over the workers, so both move the same layers at step 4, as one process does."""
    command = [sys.executable, str(WORKERS / "repair_worker.py"), "--out", str(tmp_path)]
    results = run_workers(command, num_workers=2, timeout=240)
    failed = [f"worker {r.index}: {r.stderr[-3000:]}" for r in results if r.returncode]
    assert not failed, "\n".join(failed)
    workers = [json.loads((tmp_path / f"repair-{i}.json").read_text()) for i in range(2)]
    spec = importlib.util.spec_from_file_location("repair_worker", WORKERS / "repair_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    model = overflow_model("flows", cls=tfmixprec.MixedPrecisionModel)
    repair = tfmixprec.PrecisionRepair(verbose=0)
    model.fit(worker.dataset(*worker.data()), epochs=2, shuffle=False, verbose=0,
              callbacks=[repair])  # fmt: skip
    one = worker.summary(model, repair)
    assert (
        workers[0]["repairs"] == workers[1]["repairs"] == [[4, ["big", "proj"], "forward-overflow"]]
    )
    assert one["repairs"] == workers[0]["repairs"]
    assert workers[0]["hash"] == workers[1]["hash"]
    assert workers[0]["dtypes"] == workers[1]["dtypes"]
    assert one["dtypes"]["big"] == workers[0]["dtypes"]["big"] == "float32"
    assert workers[0]["state"] == workers[1]["state"]
    for key in ("overflow_steps", "iterations"):  # the scale: from each worker's half batch
        assert workers[0]["state"][key] == one["state"][key]


def test_tensorboard_and_the_audit_speak_of_the_repair(repaired_flows):
    from tensorboard.backend.event_processing import event_accumulator

    repair_model, log_dir = repaired_flows[:2]
    events = event_accumulator.EventAccumulator(
        str(Path(log_dir) / "train"), size_guidance={"tensors": 0}
    )
    events.Reload()
    [written] = events.Tensors("mixed_precision/repairs")
    assert written.step == 4
    assert written.tensor_proto.string_val[0].decode() == REPAIR.to_markdown()
    [moved] = events.Tensors("mixed_precision/repaired_layers")
    assert (moved.step, tf.make_ndarray(moved.tensor_proto).item()) == (4, 2.0)
    [layout] = events.Tensors("custom_scalars__config__")[-1:]
    title = "Layers moved to float32 by PrecisionRepair (total)"
    assert title.encode() in tf.make_ndarray(layout.tensor_proto).item()
    charts = tfmixprec.dashboard_layout(repairs=True).category[0].chart
    assert [chart.title for chart in charts][0] == title  # listed last first: shown last
    info = [f for f in tfmixprec.audit(repair_model).findings if f.code == "float32-on-purpose"]
    assert [f.message for f in info] == [
        "2 layers compute in float32 on purpose: 'big' (PrecisionRepair at step 4 "
        "(forward-overflow)), 'proj' (PrecisionRepair at step 4 (forward-overflow))."
    ]


def test_the_monitor_says_the_overflows_were_repaired(repaired_flows):
    monitor = repaired_flows[2]
    assert monitor.events == [
        "5 overflows in steps 0-7, the last at step 4 (0-based, skipped steps counted), loss "
        "scale 32768 -> 4096; gradients not finite in: after, out; repaired at step 4: "
        "'big', 'proj' now float32"
    ]


def test_a_fit_in_a_loop_traces_the_step_once():
    """Between fits the keeper is dormant (keeps nothing) and the next fit reuses the train
    function traced with it: `fit` called once an epoch does not trace again each time."""
    model = overflow_model("flows")
    clean = overflowing(every=10**6)
    model.fit(*clean, epochs=1, verbose=0, callbacks=[tfmixprec.PrecisionRepair()])
    traced = model.train_function
    seen = []

    class Seen(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(self.model.train_function)

    repair = tfmixprec.PrecisionRepair(verbose=0)
    model.fit(*overflowing(), batch_size=32, shuffle=False, epochs=1, verbose=0,
              callbacks=[repair, Seen()])  # fmt: skip
    assert seen[0] is traced  # not traced again
    assert [(r.step, r.layers) for r in repair.repairs] == [(12, ("big", "proj"))]  # 8 before
    keeper = tfmixprec.overflow_batches.current_keeper(model)
    assert not keeper.active  # dormant again: it keeps nothing more


def test_a_fixed_scale_is_left_as_it_is():
    optimizer = tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(1e-6), 128, dynamic=False)
    model = overflow_model("flows", optimizer=optimizer)
    repair = tfmixprec.PrecisionRepair(verbose=0)
    _fit(model, repair, epochs=1)
    assert [(r.layers, r.loss_scale) for r in repair.repairs] == [(("big", "proj"), 0.0)]
    assert float(model.optimizer.loss_scale) == 128.0
    assert "loss scale goes on" not in str(repair.repairs[0])


@pytest.mark.usefixtures("fit_left_early")  # the fit raises: Keras's cycle
def test_a_fit_that_raised_leaves_no_keeping_behind():
    """Keras skips on_train_end when fit raises: the next fit's keeper replaces the stale one,
    which keeps nothing more, and the step is wrapped once (guarded once)."""
    model = overflow_model("flows")

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.fit(*overflowing(), verbose=0, callbacks=[tfmixprec.PrecisionRepair(), Boom()])
    stale = tfmixprec.overflow_batches.current_keeper(model)
    _fit(model, tfmixprec.PrecisionRepair(verbose=0), epochs=1)
    assert not stale.active and tfmixprec.overflow_batches.current_keeper(model) is not stale
    chain, step = [], model.train_step
    while step is not None:
        chain.append(getattr(step, "__name__", "?"))
        step = getattr(step, "__wrapped__", None)
    assert chain == ["guarded", "train_step"]  # the class's step, guarded once, no keeping


def test_sample_weights_in_a_later_fit_are_kept_too():
    """The keeper traced for `(x, y)` meets `(x, y, sample_weight)` in the next fit: the step
    is traced again for it, and the repair comes at the same step as without the change."""
    model = overflow_model("flows")
    clean = overflowing(every=10**6)
    model.fit(*clean, epochs=1, verbose=0, callbacks=[tfmixprec.PrecisionRepair()])
    x, y = overflowing()
    repair = tfmixprec.PrecisionRepair(verbose=0)
    model.fit(x, y, sample_weight=np.ones(len(x), "float32"), batch_size=32, shuffle=False,
              epochs=1, verbose=0, callbacks=[repair])  # fmt: skip
    assert [(r.step, r.layers) for r in repair.repairs] == [(12, ("big", "proj"))]  # 8 before


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_loss_that_overflows_in_its_own_dtype_is_repaired(replicas, request, capsys):
    strategy = request.getfixturevalue("two_cpu_strategy") if replicas == 2 else None
    model = loss_model(strategy=strategy)
    repair = tfmixprec.PrecisionRepair()
    x, y = loss_data(256)
    history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[repair])
    message = (
        "the loss overflows in float16: it computes in its own dtype (float16) and is inf on "
        "outputs that are finite, 1.592e+05 in float32"
    )
    # The fifth overflow in a row. Training goes on at 64: the loss's gradient, 2 x 399 = 798
    # at the output, reaches `hidden` times 1/8, about 100, and 100 x 64 stays 8x under 65504.
    [judgment] = repair.judgments
    assert judgment == tfmixprec.Repair(4, (), "loss-overflow", message, 64.0, (), True)
    assert judgment.repaired and repair.repairs == [judgment]
    assert (
        f"PrecisionRepair: step 4: the loss now computes in float32 (loss-overflow: {message})"
        in (capsys.readouterr().out)
    )
    assert model.loss.dtype == "float32"
    assert model.optimizer.read_state()["overflow_steps"] == 5
    assert np.isfinite(history.history["loss"][-1])


def _scale_then_forward(n_scale=5, n=512):
    """Batches of 32: the first `n_scale` overflow through their scaled gradients only (labels
    of 1e4: finite at a lower scale, "none"), every later one forward (10 x 10000 in `big`)."""
    x, y = overflowing(n=n)
    first = 32 * n_scale
    x[:first] = 0.1 * np.random.default_rng(2).normal(size=(first, 8)).astype("float32")
    y[:first] = 1e4
    return x, y


@pytest.mark.parametrize(
    "kind, jit_compile",
    [("keras", False), ("mixed_precision_model", False), ("mixed_precision_model", True)],
)
def test_a_run_is_judged_again_while_overflows_keep_coming(kind, jit_compile):
    """The run's 5th overflow (step 4) is the scale's ("none"); the forward overflows that
    follow in the same run are judged at its 10th (step 9) and repaired, long before an
    OverflowGuard at its defaults stops (20 in a row), even with a min_scale of 2^-6 that the
    scale would take 21 overflows to reach (before: judged again only at min_scale, and the
    guard stopped training at step 19 with no repair)."""
    optimizer = tfmixprec.LossScaleOptimizer(
        keras.optimizers.SGD(1e-6), initial_scale=2.0**15, min_scale=2.0**-6
    )
    cls = tfmixprec.MixedPrecisionModel if kind == "mixed_precision_model" else None
    model = overflow_model("flows", optimizer=optimizer, cls=cls)
    model.jit_compile = jit_compile
    repair = tfmixprec.PrecisionRepair(verbose=0)
    guard = tfmixprec.OverflowGuard(verbose=0)
    x, y = _scale_then_forward()
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0, callbacks=[repair, guard])
    assert [(r.step, r.layers, r.cause) for r in repair.repairs] == [
        (9, ("big", "proj"), "forward-overflow")
    ]
    assert guard.stopped_step is None and not model.stop_training
    state = model.optimizer.read_state()
    assert state["last_overflow_step"] == 9  # none after the repair
    assert state["overflow_steps"] + state["iterations"] == 16
    if not jit_compile:  # XLA of TensorFlow 2.16 keeps the first batches' loss in range
        assert (state["overflow_steps"], state["iterations"]) == (10, 6)
