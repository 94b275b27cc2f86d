"""Tests of the TensorBoard callback: event files read back, and a live TensorBoard server."""

import inspect
import re
import shutil
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from live_tensorboard import get_json, start_tensorboard, stop
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2

import tfmixprec
from tfmixprec import LossScaleOptimizer

BATCH = 4


def _fit(
    log_dir,
    bad_batches=(2, 5),
    batches=8,
    epochs=1,
    monitor=False,
    monitor_in_fit=False,
    **tb_kwargs,
):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * BATCH, 3)).astype("float32")
    y = rng.normal(size=(batches * BATCH, 2)).astype("float32")
    for b in bad_batches:
        x[b * BATCH, 1] = np.inf
    gradient_monitor = None
    if monitor:
        gradient_monitor = tfmixprec.GradientRangeMonitor(
            (x[BATCH : 2 * BATCH], y[:BATCH]), update_freq=4
        )
        gradient_monitor.measured_at = []
        measure = gradient_monitor.measure

        def counted():  # records the step of each measurement
            stats = measure()
            gradient_monitor.measured_at.append(gradient_monitor.last_step)
            return stats

        gradient_monitor.measure = counted
    callback = tfmixprec.TensorBoard(str(log_dir), gradient_monitor=gradient_monitor, **tb_kwargs)
    callbacks = [callback] + ([gradient_monitor] if monitor_in_fit else [])
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    return model, callback


def _events(log_dir):
    acc = event_accumulator.EventAccumulator(
        str(Path(log_dir) / "train"), size_guidance={event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    return acc


def _series(acc, tag):
    return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


def test_every_batch_values_in_event_files(tmp_path):
    _fit(tmp_path, update_freq=1)
    acc = _events(tmp_path)
    steps = list(range(8))  # the step just taken: 0-based, skipped steps counted
    assert _series(acc, "mixed_precision/loss_scale") == list(
        zip(steps, [32768.0] * 2 + [16384.0] * 3 + [8192.0] * 3)
    )
    # Only at the overflow steps: a series of events alone, never clipped as outliers.
    assert _series(acc, "mixed_precision/overflow") == [(2, 1.0), (5, 1.0)]
    assert _series(acc, "mixed_precision/overflow_steps") == list(
        zip(steps, [0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0])
    )
    assert _series(acc, "mixed_precision/log2_loss_scale") == list(
        zip(steps, [15.0] * 2 + [14.0] * 3 + [13.0] * 3)
    )
    # Each layer's overflow total, written after the intervals with overflows: steps 2 and 5.
    layer_tags = [t for t in acc.Tags()["tensors"] if "/layer_overflow_steps/" in t]
    assert len(layer_tags) == 2  # the Inf input reaches both Dense layers' gradients
    for tag in layer_tags:
        assert _series(acc, tag) == [(2, 1.0), (5, 2.0)]
    # Keras's own summaries are still there; the loss-scale values are not written twice.
    assert "epoch_loss" in acc.Tags()["tensors"]
    assert "batch_loss" in acc.Tags()["tensors"]
    duplicates = [t for t in acc.Tags()["tensors"] if t.startswith(("batch_", "epoch_"))]
    assert sorted(duplicates) == ["batch_loss", "epoch_learning_rate", "epoch_loss"]


def _texts(acc, tag):
    return [(e.step, tf.make_ndarray(e.tensor_proto).item().decode()) for e in acc.Tensors(tag)]


def test_overflow_report_and_diagnosis_as_text(tmp_path):
    model, board = _fit(tmp_path, update_freq=1)
    x = np.ones((BATCH, 3), "float32")
    x[0, 1] = np.inf
    diagnosis = tfmixprec.explain_overflow(model, (x, np.ones((BATCH, 2), "float32")))
    files_before = set((tmp_path / "train").iterdir())
    board.write_diagnosis(diagnosis)
    board.write_diagnosis(diagnosis, step=42)
    for step in range(100, 112):  # more than crosses the event files' counter from 9 to 10
        board.write_diagnosis(diagnosis, step=step)
    # All diagnoses in one event file, so they read back in the order written (event files
    # made in one second sort by a counter as text: "...10.v2" before "...9.v2").
    assert len(set((tmp_path / "train").iterdir()) - files_before) == 1
    acc = _events(tmp_path)
    reports = _texts(acc, "mixed_precision/overflow_report")
    assert [step for step, _ in reports] == [2, 5]  # at the step it names last
    assert reports[1][1].startswith("**2 overflow steps**, last at step 5")
    assert "| layer | overflow steps | last step | variables |" in reports[1][1]
    texts = _texts(acc, "mixed_precision/diagnosis")
    # The last step taken (0-based), then as given.
    assert [step for step, _ in texts] == [7, 42] + list(range(100, 112))
    assert texts[0][1].startswith("**bad-data**: the batch's inputs hold 1 NaN/Inf values")
    with pytest.raises(TypeError, match="diagnosis must be what tfmixprec.explain_overflow"):
        board.write_diagnosis("bad-data")


def test_no_duplicate_tags_with_mixed_precision_model(tmp_path):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = tfmixprec.MixedPrecisionModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=LossScaleOptimizer("sgd"), loss="mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    board = tfmixprec.TensorBoard(str(tmp_path), update_freq=1)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[board])
    tags = set(_events(tmp_path).Tags()["tensors"])
    assert (
        not {
            f"{prefix}_{key}"
            for prefix in ("batch", "epoch")
            for key in ("loss_scale", "overflow", "overflow_steps", "skipped_fraction")
        }
        & tags
    )
    assert {"mixed_precision/loss_scale", "batch_loss", "epoch_loss"} <= tags


def test_only_the_chief_writes_under_a_multi_worker_strategy(
    tmp_path, two_cpu_strategy, monkeypatch
):
    """A 2-replica MirroredStrategy made to answer `should_save_summary` False, as
    MultiWorkerMirroredStrategy does on a worker that is not the chief."""
    extended = type(two_cpu_strategy.extended)
    monkeypatch.setattr(extended, "should_save_summary", property(lambda self: False))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    with two_cpu_strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,))
        model = tfmixprec.MixedPrecisionModel(inputs, keras.layers.Dense(2)(inputs))
        model.compile(optimizer=LossScaleOptimizer("sgd"), loss="mse")
    x, y = np.ones((16, 3), "float32"), np.ones((16, 2), "float32")
    x[4, 0] = np.inf
    log_dir = tmp_path / "logs"
    board = tfmixprec.TensorBoard(str(log_dir), update_freq=1)

    def keep(logs):  # before the board's on_train_end: its train writer is the default one
        tf.summary.flush()
        shutil.copytree(tmp_path / "tmp", tmp_path / "kept")

    watch = keras.callbacks.LambdaCallback(on_train_end=keep)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[watch, board])
    kept = list((tmp_path / "kept").glob("*/train/events.*"))
    assert len(kept) == 1 and kept[0].parts[-3].startswith("tfmixprec-tb-worker-")
    acc = event_accumulator.EventAccumulator(str(kept[0].parent), {"tensors": 0})
    acc.Reload()  # the worker wrote as usual, into its own folder
    assert [e.step for e in acc.Tensors("mixed_precision/overflow")] == [0]
    model.evaluate(x, y, batch_size=8, verbose=0, callbacks=[board])
    model.predict(x, batch_size=8, verbose=0, callbacks=[board])
    assert list((tmp_path / "tmp").iterdir()) == []  # its folder removed each time
    assert not log_dir.exists()
    assert board.log_dir == board.get_config()["log_dir"] == str(log_dir)
    monkeypatch.undo()  # the chief: the same callback writes into log_dir
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[board])
    assert len(list((log_dir / "train").glob("events.*"))) == 1


def test_update_freq_is_respected(tmp_path):
    _fit(tmp_path / "n4", update_freq=4)
    acc = _events(tmp_path / "n4")
    # Each overflow marked at its own step (2 and 5), the values at each write (3 and 7).
    assert _series(acc, "mixed_precision/overflow") == [(2, 1.0), (5, 1.0)]
    assert _series(acc, "mixed_precision/loss_scale") == [(3, 16384.0), (7, 8192.0)]
    _fit(tmp_path / "epoch", epochs=2, update_freq="epoch")
    acc = _events(tmp_path / "epoch")
    assert _series(acc, "mixed_precision/overflow") == [(0, 2.0), (1, 2.0)]
    assert _series(acc, "mixed_precision/overflow_steps") == [(0, 2.0), (1, 4.0)]
    assert [step for step, _ in _series(acc, "epoch_loss")] == [0, 1]  # Keras's own, kept
    assert "batch_loss" not in acc.Tags()["tensors"]


def test_overflows_after_the_last_write_are_written_at_the_end(tmp_path):
    # update_freq=3 writes at steps 2 and 5; the overflow of step 7 comes after.
    _fit(tmp_path, bad_batches=(1, 7), update_freq=3)
    acc = _events(tmp_path)
    assert _series(acc, "mixed_precision/overflow") == [(1, 1.0), (7, 1.0)]
    assert _series(acc, "mixed_precision/overflow_steps")[-1] == (7, 2.0)


def _layouts(acc):
    """The custom-scalars layouts written, in order (TensorBoard shows the last)."""
    layouts = []
    for event in acc.Tensors("custom_scalars__config__"):
        layouts.append(layout_pb2.Layout())
        layouts[-1].ParseFromString(tf.make_ndarray(event.tensor_proto).item())
    return layouts


def _shown(layout):
    """Per category, its title and its chart titles in the order TensorBoard shows them
    (margin charts: last first)."""
    return [(cat.title, [chart.title for chart in reversed(cat.chart)]) for cat in layout.category]


def _chart_tags(layout):
    return {
        tag
        for category in layout.category
        for chart in category.chart
        for series in chart.margin.series
        for tag in (series.value, series.lower, series.upper)
    }


MAIN_CHARTS = [
    "Loss (per batch)",
    "Loss scale (log2)",
    "Overflow events (skipped steps)",
    "Loss (per epoch)",
    "Overflow steps (total)",
    "Gradients below float16's range (fraction)",
    "Gradients in float16's subnormal range (fraction)",
]


def test_dashboard_layout_charts():
    layout = tfmixprec.dashboard_layout()  # everything the callback can write, no layer
    assert _shown(layout) == [("Mixed precision", MAIN_CHARTS)]
    for chart in layout.category[0].chart:
        # Every chart a margin chart (TensorBoard never smooths one) of one exact tag, its
        # margins the value itself: drawn as written, one line a run.
        assert chart.WhichOneof("content") == "margin"
        (series,) = chart.margin.series
        assert series.value == series.lower == series.upper
    assert _chart_tags(layout) == {
        "batch_loss",
        "epoch_loss",
        "mixed_precision/log2_loss_scale",
        "mixed_precision/overflow",
        "mixed_precision/overflow_steps",
        "mixed_precision/grad_underflow_fraction",
        "mixed_precision/grad_subnormal_fraction",
    }
    # Only the charts of what a run writes.
    assert _shown(tfmixprec.dashboard_layout(per_batch=False, gradient_range=False)) == [
        (
            "Mixed precision",
            [
                "Loss (per epoch)",
                "Loss scale (log2)",
                "Overflow events (skipped steps)",
                "Overflow steps (total)",
            ],
        )
    ]
    assert _shown(
        tfmixprec.dashboard_layout(per_batch=False, loss_scale=False, gradient_range=False)
    ) == [("Mixed precision", ["Loss (per epoch)"])]
    # A chart a layer, titled with its name, in their own category.
    layout = tfmixprec.dashboard_layout(layers=["conv_1", "dense"])
    assert _shown(layout)[1] == (
        "Mixed precision: overflow steps per layer (total)",
        ["conv_1", "dense"],
    )
    assert [chart.margin.series[0].value for chart in reversed(layout.category[1].chart)] == [
        "mixed_precision/layer_overflow_steps/conv_1",
        "mixed_precision/layer_overflow_steps/dense",
    ]


def test_custom_scalars_layout_written(tmp_path):
    model, _ = _fit(tmp_path)  # update_freq="epoch": both layers overflow in the epoch
    acc = _events(tmp_path)
    # At train begin, the charts of what it writes (no per-batch loss, no gradient monitor);
    # once layers overflow, again with a chart for each (TensorBoard shows a run's last).
    first, *_, last = _layouts(acc)
    assert first == tfmixprec.dashboard_layout(per_batch=False, gradient_range=False)
    layers = [row.layer for row in tfmixprec.overflow_report(model).layers]
    assert len(layers) == 2
    assert last == tfmixprec.dashboard_layout(per_batch=False, gradient_range=False, layers=layers)
    assert _shown(last) == [
        (
            "Mixed precision",
            [
                "Loss (per epoch)",
                "Loss scale (log2)",
                "Overflow events (skipped steps)",
                "Overflow steps (total)",
            ],
        ),
        ("Mixed precision: overflow steps per layer (total)", layers),
    ]
    assert _chart_tags(last) <= set(acc.Tags()["tensors"])  # no empty chart


def test_layout_without_loss_scaling(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")  # float32, no loss scaling
    board = tfmixprec.TensorBoard(str(tmp_path), update_freq=1)
    model.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=4, verbose=0, callbacks=[board])
    acc = _events(tmp_path)
    (layout,) = _layouts(acc)
    assert _shown(layout) == [("Mixed precision", ["Loss (per batch)", "Loss (per epoch)"])]
    assert _chart_tags(layout) <= set(acc.Tags()["tensors"])


@pytest.mark.parametrize("monitor_in_fit", [False, True])
def test_gradient_monitor_summaries(tmp_path, monitor_in_fit):
    _, callback = _fit(tmp_path, monitor=True, monitor_in_fit=monitor_in_fit, update_freq=2)
    monitor = callback.gradient_monitor
    assert monitor.driver is callback
    # Driven by the callback: once per update_freq batches, also when fit steps it too.
    assert monitor.measured_at == [4, 8] and monitor.last_step == 8
    acc = _events(tmp_path)
    series = _series(acc, "mixed_precision/grad_underflow_fraction")
    assert [step for step, _ in series] == [3, 7]  # the 4th and 8th steps, 0-based
    assert all(0.0 <= value <= 1.0 for _, value in series)
    assert series[-1][1] == callback.gradient_monitor.weight_stats.underflow_fraction
    histograms = acc.Tensors("mixed_precision/grad_log2_abs")
    assert [e.step for e in histograms] == [3, 7]
    layout = _layouts(acc)[-1]  # with the monitor's two charts, each with its data
    assert _shown(layout)[0] == ("Mixed precision", MAIN_CHARTS)
    assert _chart_tags(layout) <= set(acc.Tags()["tensors"])


def test_bad_arguments():
    with pytest.raises(
        TypeError,
        match=r"^log_dir must be the path of the folder .*Received: log_dir=123 of type int$",
    ):
        tfmixprec.TensorBoard(123)
    assert tfmixprec.TensorBoard(Path("runs") / "a").log_dir == str(Path("runs") / "a")
    with pytest.raises(
        TypeError, match=r"gradient_monitor must be a tfmixprec.GradientRangeMonitor"
    ):
        tfmixprec.TensorBoard("logs", gradient_monitor="yes")
    with pytest.raises(ValueError, match=r"update_freq must be .*update_freq=0"):
        tfmixprec.TensorBoard("logs", update_freq=0)
    with pytest.raises(ValueError, match=r"already driven by a TensorBoard callback"):
        monitor = tfmixprec.GradientRangeMonitor((np.ones((1, 3)), np.ones((1, 2))))
        tfmixprec.TensorBoard("logs", gradient_monitor=monitor)
        tfmixprec.TensorBoard("logs", gradient_monitor=monitor)  # one driver per monitor
    callback = tfmixprec.TensorBoard("some/dir", update_freq=3)
    config = tfmixprec.TensorBoard.from_config(callback.get_config()).get_config()
    assert (config["log_dir"], config["update_freq"]) == ("some/dir", 3)


KERAS_ARGUMENTS = [
    name
    for name in inspect.signature(keras.callbacks.TensorBoard.__init__).parameters
    if name != "self"
]


def test_config_round_trip_holds_every_keras_argument(tmp_path):
    values = {
        "log_dir": str(tmp_path / "run"),
        "histogram_freq": 2,
        "write_graph": False,
        "write_images": True,
        "write_steps_per_second": True,
        "update_freq": 3,
        "profile_batch": (2, 4),
        "embeddings_freq": 5,
        "embeddings_metadata": {"embedding": "metadata.tsv"},
    }
    defaults = inspect.signature(keras.callbacks.TensorBoard.__init__).parameters
    assert sorted(values) == sorted(KERAS_ARGUMENTS)
    assert all(values[name] != defaults[name].default for name in values)  # none at default
    monitor = tfmixprec.GradientRangeMonitor((np.ones((1, 3)), np.ones((1, 2))))
    callback = tfmixprec.TensorBoard(gradient_monitor=monitor, diagnose=2, **values)
    config = callback.get_config()
    # As the instance holds it: a profile_batch pair as a list (what JSON gives back);
    # gradient_monitor left out (it holds a data batch); tfmixprec's own diagnose kept.
    assert config == {**values, "profile_batch": [2, 4], "diagnose": 2}
    restored = tfmixprec.TensorBoard.from_config(config)
    assert restored.get_config() == config
    assert restored.gradient_monitor is None
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(callback))
    assert type(again) is tfmixprec.TensorBoard and again.get_config() == config


@pytest.mark.parametrize(
    "kwargs, held",
    [
        ({}, {"update_freq": "epoch", "profile_batch": 0}),
        (
            {"update_freq": "batch", "profile_batch": "3,5"},
            {"update_freq": 1, "profile_batch": [3, 5]},
        ),
        ({"profile_batch": 7}, {"profile_batch": 7}),
    ],
)
def test_config_holds_parsed_values(kwargs, held):
    config = tfmixprec.TensorBoard("logs", **kwargs).get_config()
    assert {name: config[name] for name in held} == held
    assert tfmixprec.TensorBoard.from_config(config).get_config() == config


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """One real `tensorboard` server over one run, `_fit` with `update_freq=1` (two overflow
    steps, no gradient monitor), read by the tests below that only read: its port and the
    model. (The float8 run has a server of its own: TensorBoard merges the custom-scalar
    layouts of all its runs, and the dashboard test checks the layout whole.)"""
    logs = tmp_path_factory.mktemp("live")
    model, _ = _fit(logs / "run", update_freq=1)
    servers = []
    try:
        yield start_tensorboard(logs, servers), model
    finally:
        stop(servers)


def test_live_tensorboard_http_api(live_run):
    port, _ = live_run
    tags = get_json(port, "/data/plugin/scalars/tags")
    run = "run/train"
    assert {
        "mixed_precision/loss_scale",
        "mixed_precision/log2_loss_scale",
        "mixed_precision/overflow",
        "epoch_loss",
    } <= set(tags[run])
    assert "batch_loss_scale" not in tags[run]
    layer_tags = [t for t in tags[run] if t.startswith("mixed_precision/layer_overflow_steps/")]
    assert len(layer_tags) == 2
    per_layer = get_json(port, "/data/plugin/scalars/scalars", {"run": run, "tag": layer_tags[0]})
    assert [(step, value) for _, step, value in per_layer] == [(2, 1.0), (5, 2.0)]
    text_tags = get_json(port, "/data/plugin/text/tags")
    assert "mixed_precision/overflow_report" in text_tags[run]
    texts = get_json(
        port, "/data/plugin/text/text", {"run": run, "tag": "mixed_precision/overflow_report"}
    )
    assert [entry["step"] for entry in texts] == [2, 5]
    assert "<table>" in texts[-1]["text"]  # the markdown table, rendered
    points = get_json(
        port, "/data/plugin/scalars/scalars", {"run": run, "tag": "mixed_precision/overflow"}
    )
    assert [(step, value) for _, step, value in points] == [(2, 1.0), (5, 1.0)]
    scale = get_json(
        port, "/data/plugin/scalars/scalars", {"run": run, "tag": "mixed_precision/loss_scale"}
    )
    assert [value for _, _, value in scale][-1] == 8192.0
    layout = get_json(port, "/data/plugin/custom_scalars/layout")
    assert layout["category"][0]["title"] == "Mixed precision"


def _frontend_tag_filter(chart):
    """The `tag` parameter TensorBoard's Custom Scalars tab sends for a chart's data (its
    multiline and margin chart cards): the regexes, or the exact tags escaped, ORed."""
    if chart.get("multiline"):
        regexes = chart["multiline"]["tag"]
        return regexes[0] if len(regexes) == 1 else "|".join(f"({r})" for r in regexes)
    tags = [s[key] for s in chart["margin"]["series"] for key in ("value", "lower", "upper")]
    return "|".join(f"({re.escape(tag)})" for tag in tags)


def test_live_dashboard_charts_are_exact_labelled_and_not_empty(live_run):
    port, model = live_run  # no gradient monitor
    run = "run/train"
    layout = get_json(port, "/data/plugin/custom_scalars/layout")
    layers = [row.layer for row in tfmixprec.overflow_report(model).layers]
    shown = [
        (category["title"], [chart["title"] for chart in reversed(category["chart"])])
        for category in layout["category"]
    ]
    assert shown == [
        (  # no gradient charts: no gradient monitor wrote any
            "Mixed precision",
            [
                "Loss (per batch)",
                "Loss scale (log2)",
                "Overflow events (skipped steps)",
                "Loss (per epoch)",
                "Overflow steps (total)",
            ],
        ),
        ("Mixed precision: overflow steps per layer (total)", layers),  # a chart a layer
    ]
    for category in layout["category"]:
        for chart in category["chart"]:
            # A margin chart (never smoothed) of one tag, its margins the value itself.
            (series,) = chart["margin"]["series"]
            assert series["value"] == series["lower"] == series["upper"]
            # What the tab asks for this chart: the run has data for it.
            data = get_json(
                port,
                "/data/plugin/custom_scalars/scalars",
                {"run": run, "tag": _frontend_tag_filter(chart)},
            )
            assert data["regex_valid"] and data["tag_to_events"][series["value"]], chart["title"]
            if category["title"].endswith("per layer (total)"):
                points = data["tag_to_events"][series["value"]]
                assert [(step, value) for _, step, value in points] == [(2, 1.0), (5, 2.0)]
                assert series["value"] == f"mixed_precision/layer_overflow_steps/{chart['title']}"
    scale = get_json(
        port,
        "/data/plugin/custom_scalars/scalars",
        {"run": run, "tag": "(mixed_precision/log2_loss_scale)"},
    )["tag_to_events"]["mixed_precision/log2_loss_scale"]
    assert [value for _, _, value in scale] == [15.0] * 2 + [14.0] * 3 + [13.0] * 3
    # The premise, in the frontend this server serves: the tab passes its smoothing setting
    # (0.6 by default) to its multiline chart cards, never to its margin chart cards.
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/index.js", timeout=30) as response:
        script = response.read().decode()
    cards = {
        kind: re.findall(rf"<tf-custom-scalar-{kind}-chart-card\b[^>]*>", script)
        for kind in ("multi-line", "margin")
    }
    assert cards["multi-line"] and cards["margin"]
    assert all("smoothing-weight=" in card for card in cards["multi-line"])
    assert not any("smoothing" in card for card in cards["margin"])


def test_live_float8_tags_match_the_monitor(tmp_path, tensorboard_server):
    """float16 + float8 with a dynamic loss scale in `fit`: the float8 statistics that
    `tfmixprec.TensorBoard` writes, read back through the server, are the numbers
    `Float8Monitor` gives in Python for the same intervals."""
    tfmixprec.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(64, activation="relu", name="first")]
        + [keras.layers.Dense(64, activation="gelu", name="hidden"), keras.layers.Dense(16)]
    )
    assert [c.layer for c in tfmixprec.float8_layers(model)] == ["hidden"]
    model.compile(
        LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6 * BATCH, 32)).astype("float32"), rng.integers(0, 16, 6 * BATCH)
    board = tfmixprec.TensorBoard(str(tmp_path / "run"), update_freq=2)
    monitor = tfmixprec.Float8Monitor(update_freq=2)
    model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False, callbacks=[board, monitor])
    port = tensorboard_server(tmp_path)
    run = "run/train"
    tags = [t for t in get_json(port, "/data/plugin/scalars/tags")[run] if "/float8/" in t]
    stats = ("saturated_fraction", "underflow_fraction", "flushed_fraction", "scale", "amax")
    stats += ("log2_scale", "log2_amax")
    tensors = ("inputs", "kernel", "outputs_grad")
    assert sorted(tags) == sorted(
        f"mixed_precision/float8/hidden/{t}/{s}" for t in tensors for s in stats
    )
    assert [step for step, _ in monitor.history] == [2, 4, 6]
    for tensor in tensors:
        for stat in stats:
            tag = f"mixed_precision/float8/hidden/{tensor}/{stat}"
            served = get_json(port, "/data/plugin/scalars/scalars", {"run": run, "tag": tag})
            expected = [  # the monitor counts the steps taken; the board writes at the
                # 0-based number of the step just taken
                (step - 1, float(np.float32(_stat(layers[0].tensors()[tensor], stat))))
                for step, layers in monitor.history
            ]
            assert [(step, value) for _, step, value in served] == expected, tag
    first_read = monitor.history[0][1][0]
    assert first_read.inputs.values == 2 * BATCH * 64 and first_read.inputs.scale != 1.0
    layout = get_json(port, "/data/plugin/custom_scalars/layout")
    (float8,) = [c for c in layout["category"] if c["title"] == "Mixed precision: float8"]
    assert [chart["title"] for chart in float8["chart"]] == [
        "hidden: saturated (fraction)",
        "hidden: zero once quantized (fraction)",
        "hidden: non-zero values flushed to zero (fraction)",
        "hidden: scale (log2)",
        "hidden: amax (log2)",
    ]


def _stat(tensor, stat):
    if stat.startswith("log2_"):
        return np.log2(getattr(tensor, stat[5:]))
    return getattr(tensor, stat)


@pytest.mark.parametrize(
    "cls, markers",
    [  # MixedPrecisionModel's step logs its overflow flag: each marked at its own step
        (tfmixprec.MixedPrecisionModel, [(1, 1.0), (2, 1.0)]),
        # Keras's own step logs none: the read at step 3 finds 2, the last at step 2
        (keras.Model, [(2, 2.0)]),
    ],
)
def test_overflows_between_two_writes_are_all_counted(tmp_path, cls, markers):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = cls(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = np.ones((8 * BATCH, 3), "float32"), np.ones((8 * BATCH, 2), "float32")
    x[1 * BATCH, 0] = x[2 * BATCH, 0] = np.inf  # steps 1 and 2, in the write interval 0-3
    board = tfmixprec.TensorBoard(str(tmp_path), update_freq=4)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[board])
    acc = _events(tmp_path)
    assert _series(acc, "mixed_precision/overflow") == markers
    assert _series(acc, "mixed_precision/overflow_steps") == [(3, 2.0), (7, 2.0)]
