"""The "Mixed precision" tab: TensorBoard's plugin over what the callbacks write, served by a
real `tensorboard` on 127.0.0.1 and drawn by a real headless Chromium."""

import gc
import json
import os
import re
import shutil
from pathlib import Path

import keras
import numpy as np
import pytest
from live_tensorboard import get_json, start_tensorboard, stop
from overflow_models import model as overflow_model
from overflow_models import overflowing
from tensorboard import context as tb_context
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer

import tfmixprec
from _tfmixprec_board import names, plugin
from tfmixprec.fit.board_events import diagnosis_event, repair_event
from tfmixprec.fit.layout import FLOAT8_STATS
from tfmixprec.fit.repair import repairs_of

STORY, STOP, KERAS = "story/train", "stopped/train", "keras_board/train"
FLOAT8, BF16 = "float8/train", "bfloat16/train"


def _story(log_dir):
    """A float16 model whose layer `big` really passes 65504: 5 skipped steps, a diagnosis of
    the first, a repair at the fifth, then clean steps."""
    model = overflow_model("flows", cls=tfmixprec.MixedPrecisionModel)
    monitor = tfmixprec.LossScaleMonitor(update_freq=1, diagnose=1)
    board = tfmixprec.TensorBoard(str(log_dir), update_freq=1, diagnose=1)
    callbacks = [tfmixprec.PrecisionRepair(verbose=0), monitor, board]
    model.fit(*overflowing(), batch_size=32, epochs=2, shuffle=False, verbose=0,
              callbacks=callbacks)  # fmt: skip
    return model, monitor


def _stopped(log_dir):
    """A plain `keras.Model` whose scale starts at 4 over a `min_scale` of 1, fed Inf from its
    4th batch on: overflows at `min_scale`, then OverflowGuard stops it, with
    steps_per_execution=2 (the logs say only every second step's flag)."""
    with tfmixprec.policy_scope("mixed_float16"):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(4, name="hidden")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(2, name="out", dtype="float32")(hidden))
        optimizer = tfmixprec.LossScaleOptimizer(
            keras.optimizers.SGD(), initial_scale=4.0, min_scale=1.0, on_min_scale="ignore"
        )
        model.compile(optimizer=optimizer, loss="mse", steps_per_execution=2)
    x = np.ones((40, 3), "float32")
    x[12:, 0] = np.inf
    guard = tfmixprec.OverflowGuard(max_consecutive=4, verbose=0)
    board = tfmixprec.TensorBoard(str(log_dir), update_freq=2)
    model.fit(x, np.zeros((40, 2), "float32"), batch_size=4, shuffle=False, verbose=0,
              callbacks=[guard, board])  # fmt: skip
    return model, guard


def _float8(log_dir):
    """A float16 model with one float8 layer (`hidden`), its statistics written every 2 steps."""
    with tfmixprec.policy_scope("mixed_float16"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((32,)), keras.layers.Dense(64, activation="relu", name="first")]
            + [keras.layers.Dense(64, activation="gelu", name="hidden"), keras.layers.Dense(16)]
        )
        tfmixprec.float8_layers(model)
        model.compile(
            tfmixprec.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(24, 32)).astype("float32"), rng.integers(0, 16, 24)
    board = tfmixprec.TensorBoard(str(log_dir), update_freq=2)
    model.fit(x, y, batch_size=4, verbose=0, shuffle=False, callbacks=[board])
    return model, board


def _keras_board(log_dir):
    """Keras's own TensorBoard callback after LossScaleMonitor (whose values it writes)."""
    model = overflow_model("flows")
    monitor = tfmixprec.LossScaleMonitor(update_freq=1)
    board = keras.callbacks.TensorBoard(str(log_dir), update_freq=1)
    model.fit(*overflowing(n=128), batch_size=32, epochs=1, shuffle=False, verbose=0,
              callbacks=[monitor, board])  # fmt: skip
    return model, monitor


def _bfloat16(log_dir):
    """A plain `keras.Model` under mixed_bfloat16 with a plain optimizer: no loss scaling."""
    with tfmixprec.policy_scope("mixed_bfloat16"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="out")])
        model.compile(optimizer="sgd", loss="mse")
    board = tfmixprec.TensorBoard(str(log_dir), update_freq=1)
    model.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=4, verbose=0, callbacks=[board])
    return model, board


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    found = {
        STORY: _story(logs / "story"),
        STOP: _stopped(logs / "stopped"),
        KERAS: _keras_board(logs / "keras_board"),
        FLOAT8: _float8(logs / "float8"),
        BF16: _bfloat16(logs / "bfloat16"),
    }
    gc.collect()  # `_stopped`'s fit left its epoch early: see conftest's `fit_left_early`
    servers = []
    port = start_tensorboard(logs, servers)
    yield logs, port, found
    stop(servers)


def _overflow_steps(monitor):
    """The overflow steps `LossScaleMonitor(update_freq=1)` reported, one a line."""
    return [int(re.match(r"overflow at step (\d+) ", line).group(1)) for line in monitor.events]


def test_the_tab_is_listed_active_under_its_name(runs):
    _, port, _ = runs
    listing = get_json(port, "/data/plugins_listing")
    assert listing[names.PLUGIN_NAME]["enabled"] is True
    assert listing[names.PLUGIN_NAME]["tab_name"] == "Mixed precision"
    assert get_json(port, "/data/plugin/tfmixprec/runs") == {
        "runs": [BF16, FLOAT8, KERAS, STOP, STORY]
    }


def test_the_story_run_serves_the_steps_layers_causes_and_repair_recorded(runs):
    _, port, found = runs
    model, monitor = found[STORY]
    data = get_json(port, "/data/plugin/tfmixprec/data", {"run": STORY})
    state = model.optimizer.read_state()
    assert (data["source"], data["axis"]) == ("tfmixprec", "step")
    # One marker an overflow step, at the step the monitor reported it (0-based).
    assert data["overflows"] == [[step, 1.0] for step in _overflow_steps(monitor)]
    assert _overflow_steps(monitor) == [0, 1, 2, 3, 4]
    assert data["overflow_total"] == state["overflow_steps"] == 5
    # The scale each step left, from the scale the fit started at (before step 0).
    assert data["scale"][:7] == [[-1, 32768.0], [0, 16384.0], [1, 8192.0], [2, 4096.0],
                                 [3, 2048.0], [4, 4096.0], [5, 4096.0]]  # fmt: skip
    assert data["scale"][-1] == [state["step"] - 1, state["loss_scale"]]
    assert [step for step, _ in data["loss"]] == list(range(5, state["step"]))  # finite ones
    report = tfmixprec.overflow_report(model)
    assert [(layer["name"], layer["total"]) for layer in data["layers"]] == [
        (row.layer, float(row.overflow_steps)) for row in report.layers
    ]
    [(step, diagnosis)] = monitor.diagnoses
    [repair] = repairs_of(model)
    diagnosed, repaired = data["events"]
    assert (diagnosed["kind"], diagnosed["step"]) == ("diagnosis", step) == ("diagnosis", 0)
    assert (diagnosed["cause"], diagnosed["layer"]) == (diagnosis.cause, diagnosis.layer)
    assert (diagnosed["cause"], diagnosed["layer"]) == ("forward-overflow", "big")
    assert diagnosed["value"] > 65504 and diagnosed["message"] == diagnosis.message
    assert (repaired["kind"], repaired["step"], repaired["layers"]) == (
        "repair",
        repair.step,
        list(repair.layers),
    )
    assert repaired["layers"] == ["big", "proj"] and repaired["step"] == 4
    assert repaired["loss_scale"] == repair.loss_scale == 4096.0
    [start] = data["starts"]
    assert (start["step"], start["policy"], start["loss_scale"]) == (0, "mixed_float16", 32768.0)


def test_a_guard_stop_and_several_steps_an_execution(runs):
    """With steps_per_execution=2 only every second step's flag is in the logs: the markers
    still count every overflow step, the last of them at its own step."""
    _, port, found = runs
    model, guard = found[STOP]
    data = get_json(port, "/data/plugin/tfmixprec/data", {"run": STOP})
    state = model.optimizer.read_state()
    assert sum(count for _, count in data["overflows"]) == state["overflow_steps"] == 5
    assert data["overflows"][-1][0] == state["last_overflow_step"]
    # Steps 3 to 7 overflowed; a read every execution of 2 steps knows each one's last.
    assert data["overflows"] == [[3, 1.0], [5, 2.0], [7, 2.0]]
    # Overflows at min_scale=1 (the scale went 4, 2, 1), reported at each read that saw some.
    at_min = [e for e in data["events"] if e["kind"] == "min_scale"]
    assert [(e["step"], e["count"]) for e in at_min] == [(5, 1), (7, 2)]
    assert at_min[0]["message"].startswith("1 overflow step(s) at min_scale=1, where lowering")
    [stopped] = [e for e in data["events"] if e["kind"] == "guard_stop"]
    assert stopped["message"] == guard.stop_message
    assert stopped["step"] == guard.stopped_step - 1 == state["step"] - 1


def test_float8_statistics_per_layer_and_tensor(runs):
    _, port, found = runs
    _, board = found[FLOAT8]
    data = get_json(port, "/data/plugin/tfmixprec/data", {"run": FLOAT8})
    series = {(s["layer"], s["tensor"], s["statistic"]): s["points"] for s in data["float8"]}
    tensors = ("inputs", "kernel", "outputs_grad")
    for tensor in tensors:
        points = series[("hidden", tensor, "saturated_fraction")]
        assert [step for step, _ in points] == [1, 3, 5]  # every 2 steps, 0-based
        assert all(0.0 <= value <= 1.0 for _, value in points)
    assert {layer for layer, _, _ in series} == {"hidden"}
    assert {statistic for _, _, statistic in series} == set(FLOAT8_STATS)


def test_a_run_without_loss_scaling(runs):
    """Listed by its start event; its loss, and no scale: it has none to show."""
    _, port, _ = runs
    data = get_json(port, "/data/plugin/tfmixprec/data", {"run": BF16})
    assert (data["scale"], data["overflows"], data["overflow_total"]) == ([], [], None)
    assert [step for step, _ in data["loss"]] == [0, 1]
    [start] = data["starts"]
    assert (start["policy"], start["loss_scale"], start["dynamic"]) == (
        "mixed_bfloat16",
        None,
        None,
    )


def test_keras_own_tensorboard_beside_the_monitor(runs):
    _, port, found = runs
    model, monitor = found[KERAS]
    data = get_json(port, "/data/plugin/tfmixprec/data", {"run": KERAS})
    assert (data["source"], data["axis"], data["events"]) == ("keras", "batch", [])
    # Keras counts its batches from 1: the monitor's step N is Keras's batch N + 1.
    assert [step for step, _ in data["overflows"]] == [s + 1 for s in _overflow_steps(monitor)]
    assert data["overflow_total"] == model.optimizer.read_state()["overflow_steps"]


def test_an_unknown_run_is_a_404_that_names_it(runs):
    _, port, _ = runs
    with pytest.raises(Exception, match="404") as raised:
        get_json(port, "/data/plugin/tfmixprec/data", {"run": "nope"})
    body = json.loads(raised.value.read())
    assert body == {"error": "no mixed-precision data for run='nope'; see /runs for the runs"}


def test_the_page_and_its_styles_ship_in_the_package(runs):
    _, port, _ = runs
    import urllib.request

    for name in ("index.js", "static/index.js", "static/style.css"):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/tfmixprec/{name}") as r:
            body = r.read().decode()
        assert "http://" not in body.replace("http://www.w3.org/2000/svg", "")  # no fetch out
    with pytest.raises(Exception, match="404"):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/tfmixprec/static/../plugin.py")


def _provider(log_dir):
    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(log_dir))
    multiplexer.Reload()
    return data_provider.MultiplexerDataProvider(multiplexer, str(log_dir))


def test_inactive_without_what_tfmixprec_writes(tmp_path):
    """Keras's own TensorBoard without LossScaleMonitor: nothing for the tab, which stays off."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    board = keras.callbacks.TensorBoard(str(tmp_path / "plain"), update_freq=1)
    model.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=4, verbose=0, callbacks=[board])
    data = _provider(tmp_path)
    ctx = tb_context.RequestContext()
    assert plugin.runs(data, ctx, "") == []
    tab = plugin.MixedPrecisionPlugin(type("Context", (), {"data_provider": data})())
    assert tab.is_active() is False
    assert tab.frontend_metadata().tab_name == "Mixed precision"


def test_event_tags_refuse_an_unknown_kind():
    assert names.event_tag("repair", 12) == "mixed_precision/event/repair/0000000012"
    with pytest.raises(ValueError, match=r"kind must be one of .*Received: kind='repairs'"):
        names.event_tag("repairs", 12)


def test_events_carry_what_the_reports_say(runs):
    _, _, found = runs
    model, monitor = found[STORY]
    [(_, diagnosis)] = monitor.diagnoses
    event = diagnosis_event(diagnosis)
    assert event["text"] == diagnosis.to_markdown()
    row = next(r for r in diagnosis.layers if r.layer == "big")
    assert (event["value"], event["compute_dtype"]) == (row.float32_max_abs, "float16")
    [repair] = repairs_of(model)
    assert repair_event(repair) == {
        "layers": ("big", "proj"),
        "cause": "forward-overflow",
        "message": repair.message,
        "loss_scale": 4096.0,
        "float8": (),
        "float32_loss": False,
        "text": repair.to_markdown(),
    }


# -------------------------------------------------------------------- in a real browser
def _chromium():
    """Selenium driving Debian's chromium and chromedriver (no download). Skipped where they
    are not installed, except in CI (`.ci/run` installs them): there it fails."""
    missing = [p for p in ("/usr/bin/chromium", "/usr/bin/chromedriver") if not Path(p).exists()]
    try:
        from selenium import webdriver
    except ImportError:
        missing.append("selenium")
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs chromium, chromedriver and selenium; missing: {missing}")
        pytest.skip(f"needs {', '.join(missing)} (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1600"):
        options.add_argument(argument)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    return webdriver.Chrome(options=options, service=service)


def test_the_tab_draws_every_overflow_the_layer_the_cause_and_the_repair(runs):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    _, port, found = runs
    driver = _chromium()
    try:
        driver.get(f"http://127.0.0.1:{port}/#{names.PLUGIN_NAME}")
        frame = (By.CSS_SELECTOR, "iframe[src*='plugin_entry.html?name=tfmixprec']")
        WebDriverWait(driver, 60).until(
            expected_conditions.frame_to_be_available_and_switch_to_it(frame)
        )
        WebDriverWait(driver, 60).until(
            lambda d: d.execute_script("return document.body.dataset.rendered")
        )
        panels = {
            p.get_attribute("data-run"): p
            for p in driver.find_elements(By.CSS_SELECTOR, "section.run")
        }
        assert sorted(panels) == [BF16, FLOAT8, KERAS, STOP, STORY]  # side by side
        for run in (STORY, STOP, KERAS, FLOAT8):
            model = found[run][0]
            markers = panels[run].find_elements(By.CSS_SELECTOR, "circle.overflow-marker")
            drawn = sum(int(m.get_attribute("data-count")) for m in markers)
            assert drawn == model.optimizer.read_state()["overflow_steps"], run
        story = panels[STORY]
        steps = [
            int(m.get_attribute("data-step"))
            for m in story.find_elements(By.CSS_SELECTOR, "circle.overflow-marker")
        ]
        assert steps == _overflow_steps(found[STORY][1])
        text = story.text
        assert "16 steps: 11 applied, 5 skipped (overflow)" in text
        rows = [r.text for r in story.find_elements(By.CSS_SELECTOR, "tr.event")]
        [(_, diagnosis)] = found[STORY][1].diagnoses
        assert rows[0] == f"0 diagnosis big forward-overflow {diagnosis.message}"
        assert "past float16's 65504" in diagnosis.message  # the value, in the message
        assert rows[1].startswith(
            "4 repair big, proj forward-overflow moved to float32: big, proj; loss scale "
            "restarted at 2^12 (4096)"
        )
        assert len(story.find_elements(By.CSS_SELECTOR, "line.repair-mark")) == 1
        float8 = panels[FLOAT8].find_elements(By.CSS_SELECTOR, "figure.chart-float8")
        assert [f.find_element(By.TAG_NAME, "figcaption").text for f in float8] == [
            "float8 hidden: saturated and zero-once-quantized fraction"
        ]
        assert len(float8[0].find_elements(By.CSS_SELECTOR, "polyline.series")) == 6  # 3 x 2
        assert (
            panels[BF16]
            .find_element(By.CSS_SELECTOR, "p.no-scaling")
            .text.startswith("No loss scaling in this run")
        )
        stop_rows = [r.text for r in panels[STOP].find_elements(By.CSS_SELECTOR, "tr.guard_stop")]
        assert len(stop_rows) == 1 and "OverflowGuard stopped training" in stop_rows[0]
    finally:
        driver.quit()
