"""Tests of the TensorBoard callback: event files read back, and a live TensorBoard server."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2

import tfmixprec
from tfmixprec import LossScaleOptimizer

BATCH = 4


def _fit(log_dir, bad_batches=(2, 5), batches=8, epochs=1, monitor=False, **tb_kwargs):
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
            (x[BATCH : 2 * BATCH], y[:BATCH]), every_n_steps=4
        )
    callback = tfmixprec.TensorBoard(str(log_dir), gradient_monitor=gradient_monitor, **tb_kwargs)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[callback])
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
    steps = list(range(1, 9))
    assert _series(acc, "mixed_precision/loss_scale") == list(
        zip(steps, [32768.0] * 2 + [16384.0] * 3 + [8192.0] * 3)
    )
    assert _series(acc, "mixed_precision/overflow") == list(
        zip(steps, [0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    )
    assert _series(acc, "mixed_precision/overflow_steps") == list(
        zip(steps, [0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0])
    )
    # Keras's own summaries are still there.
    assert "epoch_loss" in acc.Tags()["tensors"]
    assert "batch_loss" in acc.Tags()["tensors"]


def test_update_freq_is_respected(tmp_path):
    _fit(tmp_path / "n4", update_freq=4)
    acc = _events(tmp_path / "n4")
    assert _series(acc, "mixed_precision/overflow") == [(4, 1.0), (8, 1.0)]
    assert _series(acc, "mixed_precision/loss_scale") == [(4, 16384.0), (8, 8192.0)]
    _fit(tmp_path / "epoch", epochs=2, update_freq="epoch")
    acc = _events(tmp_path / "epoch")
    assert _series(acc, "mixed_precision/overflow") == [(0, 2.0), (1, 2.0)]
    assert _series(acc, "mixed_precision/overflow_steps") == [(0, 2.0), (1, 4.0)]
    assert [step for step, _ in _series(acc, "epoch_loss")] == [0, 1]  # Keras's own, kept
    assert "batch_loss" not in acc.Tags()["tensors"]


def test_custom_scalars_layout_written(tmp_path):
    _fit(tmp_path)
    acc = _events(tmp_path)
    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout()
    layout.ParseFromString(tf.make_ndarray(event.tensor_proto).item())
    assert layout == tfmixprec.dashboard_layout()
    (category,) = layout.category
    assert category.title == "Mixed precision"
    titles = [chart.title for chart in category.chart]
    assert titles[:3] == ["Loss (per batch)", "Loss scale", "Overflow events (skipped steps)"]


def test_gradient_monitor_summaries(tmp_path):
    _, callback = _fit(tmp_path, monitor=True, update_freq=2)
    acc = _events(tmp_path)
    series = _series(acc, "mixed_precision/grad_underflow_fraction")
    assert [step for step, _ in series] == [4, 8]
    assert all(0.0 <= value <= 1.0 for _, value in series)
    assert series[-1][1] == callback.gradient_monitor.weight_stats.underflow_fraction
    histograms = acc.Tensors("mixed_precision/grad_log2_abs")
    assert [e.step for e in histograms] == [4, 8]


def test_bad_arguments():
    with pytest.raises(
        TypeError, match=r"gradient_monitor must be a tfmixprec.GradientRangeMonitor"
    ):
        tfmixprec.TensorBoard("logs", gradient_monitor="yes")
    with pytest.raises(ValueError, match=r"update_freq must be .*update_freq=0"):
        tfmixprec.TensorBoard("logs", update_freq=0)
    callback = tfmixprec.TensorBoard("some/dir", update_freq=3)
    assert tfmixprec.TensorBoard.from_config(callback.get_config()).get_config() == {
        "log_dir": "some/dir",
        "update_freq": 3,
    }


# -------------------------------------------------------------------- live server
def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get_json(port, path, params=None):
    url = f"http://127.0.0.1:{port}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture
def tensorboard_server(tmp_path):
    """A real `tensorboard` process on 127.0.0.1, serving `tmp_path`; stopped afterwards."""
    servers = []

    def start(log_dir):
        port = _free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorboard.main",
                "--logdir",
                str(log_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--reload_interval",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        )
        servers.append(proc)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"tensorboard exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                tags = _get_json(port, "/data/plugin/scalars/tags")
                if any("mixed_precision/loss_scale" in run_tags for run_tags in tags.values()):
                    return port
            except OSError:
                pass
            time.sleep(0.5)
        pytest.fail("tensorboard did not serve the run within 90 s")

    yield start
    for proc in servers:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_live_tensorboard_http_api(tmp_path, tensorboard_server):
    _fit(tmp_path / "run", update_freq=1)
    port = tensorboard_server(tmp_path)
    tags = _get_json(port, "/data/plugin/scalars/tags")
    run = "run/train"
    assert {"mixed_precision/loss_scale", "mixed_precision/overflow", "epoch_loss"} <= set(
        tags[run]
    )
    points = _get_json(
        port, "/data/plugin/scalars/scalars", {"run": run, "tag": "mixed_precision/overflow"}
    )
    assert [(step, value) for _, step, value in points] == list(
        zip(range(1, 9), [0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    )
    scale = _get_json(
        port, "/data/plugin/scalars/scalars", {"run": run, "tag": "mixed_precision/loss_scale"}
    )
    assert [value for _, _, value in scale][-1] == 8192.0
    layout = _get_json(port, "/data/plugin/custom_scalars/layout")
    assert layout["category"][0]["title"] == "Mixed precision"
