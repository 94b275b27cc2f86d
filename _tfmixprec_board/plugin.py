"""The "Mixed precision" tab: a TensorBoard plugin over what `tfmixprec.TensorBoard` writes.

TensorBoard finds it through the `tensorboard_plugins` entry point (pyproject.toml) and shows
its tab when a run holds this plugin's events (written at each `fit`'s start) or, for a run
that Keras's own `keras.callbacks.TensorBoard` wrote beside `tfmixprec.LossScaleMonitor`, the
loss-scale values of its logs. It reads the logs through TensorBoard's data provider, as
TensorBoard's own plugins do, and serves one JSON document a run (`/data?run=...`) to its page
(`static/index.js`), which draws it.
"""

from __future__ import annotations

import json
import mimetypes
import posixpath
from importlib import resources
from typing import Any

from tensorboard import context as tb_context
from tensorboard import plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from _tfmixprec_board import names

SCALARS_PLUGIN = "scalars"  # TensorBoard's scalars plugin: where tf.summary.scalar goes
DOWNSAMPLE = 100_000  # every point TensorBoard kept (it keeps up to 1,000 a scalar tag)
# A run written by Keras's own TensorBoard callback beside LossScaleMonitor: the monitor's
# values in Keras's logs, per batch (at Keras's batch count, 1-based) or per epoch.
KERAS_TAGS = {
    "batch": ("batch_loss_scale", "batch_loss", "batch_overflow", "batch_overflow_steps"),
    "epoch": ("epoch_loss_scale", "epoch_loss", "epoch_overflow", "epoch_overflow_steps"),
}
STATIC = ("index.js", "style.css")


class MixedPrecisionPlugin(base_plugin.TBPlugin):
    """TensorBoard's "Mixed precision" tab.

    Args:
        context: `tensorboard.plugins.base_plugin.TBContext`. TensorBoard's, with its data
            provider.
    """

    plugin_name = names.PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._provider = context.data_provider

    def get_plugin_apps(self) -> dict[str, Any]:
        return {
            "/index.js": self._serve_static,
            "/static/*": self._serve_static,
            "/runs": self._serve_runs,
            "/data": self._serve_data,
        }

    def is_active(self) -> bool:
        """For a run of Keras's own callback only (a run with this plugin's events makes the
        tab active without asking): whether some run logged a loss scale."""
        ctx = tb_context.RequestContext()
        return bool(keras_runs(self._provider, ctx, ""))

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name=names.TAB_NAME)

    @wrappers.Request.application
    def _serve_static(self, request: wrappers.Request) -> wrappers.Response:
        name = posixpath.basename(request.path)
        if name not in STATIC:
            return http_util.Respond(request, "Not found", "text/plain", code=404)
        body = resources.files("_tfmixprec_board").joinpath("static", name).read_bytes()
        return http_util.Respond(request, body, mimetypes.guess_type(name)[0])

    @wrappers.Request.application
    def _serve_runs(self, request: wrappers.Request) -> wrappers.Response:
        ctx, eid = plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)
        return http_util.Respond(
            request, {"runs": runs(self._provider, ctx, eid)}, "application/json"
        )

    @wrappers.Request.application
    def _serve_data(self, request: wrappers.Request) -> wrappers.Response:
        ctx, eid = plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)
        run = request.args.get("run")
        if run not in runs(self._provider, ctx, eid):
            body = {"error": f"no mixed-precision data for run={run!r}; see /runs for the runs"}
            return http_util.Respond(request, body, "application/json", code=404)
        return http_util.Respond(
            request, run_data(self._provider, ctx, eid, run), "application/json"
        )


def runs(data: provider.DataProvider, ctx: Any, eid: str) -> list[str]:
    """The runs with something to show: tfmixprec's events, or a loss scale in Keras's logs."""
    ours = data.list_tensors(ctx, experiment_id=eid, plugin_name=names.PLUGIN_NAME)
    return sorted(set(ours) | set(keras_runs(data, ctx, eid)))


def keras_runs(data: provider.DataProvider, ctx: Any, eid: str) -> dict[str, str]:
    """The runs whose logs hold a loss scale (`tfmixprec.TensorBoard`'s own, or Keras's callback
    beside `LossScaleMonitor`), each with where it is: `"tfmixprec"`, `"batch"` or `"epoch"`."""
    found = {}
    for run, tags in data.list_scalars(ctx, experiment_id=eid, plugin_name=SCALARS_PLUGIN).items():
        if names.SCALARS["loss_scale"] in tags:
            found[run] = "tfmixprec"
        elif KERAS_TAGS["batch"][0] in tags:
            found[run] = "batch"
        elif KERAS_TAGS["epoch"][0] in tags:
            found[run] = "epoch"
    return found


def run_data(data: provider.DataProvider, ctx: Any, eid: str, run: str) -> dict[str, Any]:
    """What the tab draws for `run`, as JSON-ready values (every step in the run's numbering).

    Returns:
        Dict with `run`; `source` (`"tfmixprec"`: `tfmixprec.TensorBoard` wrote it; `"keras"`:
        Keras's callback, beside `LossScaleMonitor`); `axis` (`"step"`: 0-based, skipped steps
        counted; `"batch"`: Keras's batch count, 1-based; `"epoch"`); `scale`, `loss` (lists
        of `[step, value]`); `overflows` (`[step, count]`, the overflow steps each marker
        stands for); `overflow_total` (the run's last total, or None); `layers` (each with
        `name`, `total`, `points` of its total over time, most overflows first); `float8`
        (`layer`, `tensor`, `statistic`, `points`); `events` (diagnoses, repairs,
        `min_scale` warnings and `OverflowGuard` stops, each a dict with `kind` and `step`).
    """
    scalars = _scalars(data, ctx, eid, run)
    events = _events(data, ctx, eid, run)
    where = keras_runs(data, ctx, eid).get(run, "tfmixprec")
    if where != "tfmixprec" and not events:
        return _keras_run(run, where, scalars)
    starts = [e for e in events if e["kind"] == names.START]
    tag = names.SCALARS
    return {
        "run": run,
        "source": "tfmixprec",
        "axis": starts[-1].get("axis", "step") if starts else "step",
        "scale": _with_starts(scalars.get(tag["loss_scale"], []), starts),
        "loss": scalars.get(tag["loss"], []),
        "overflows": scalars.get(tag["overflow"], []),
        "overflow_total": _last(scalars.get(tag["overflow_steps"])),
        "layers": _layers(scalars),
        "float8": _float8(scalars),
        "events": [e for e in events if e["kind"] != names.START],
        "starts": starts,
    }


def _keras_run(run: str, where: str, scalars: dict[str, list]) -> dict[str, Any]:
    scale, loss, overflow, total = (scalars.get(t, []) for t in KERAS_TAGS[where])
    return {
        "run": run,
        "source": "keras",
        "axis": where,
        "scale": scale,
        "loss": loss,
        "overflows": [[step, value] for step, value in overflow if value > 0],
        "overflow_total": _last(total),
        "layers": [],
        "float8": [],
        "events": [],
        "starts": [],
    }


def _scalars(data: provider.DataProvider, ctx: Any, eid: str, run: str) -> dict[str, list]:
    found = data.read_scalars(
        ctx,
        experiment_id=eid,
        plugin_name=SCALARS_PLUGIN,
        downsample=DOWNSAMPLE,
        run_tag_filter=provider.RunTagFilter(runs=[run]),
    ).get(run, {})
    return {tag: [[d.step, d.value] for d in points] for tag, points in found.items()}


def _events(data: provider.DataProvider, ctx: Any, eid: str, run: str) -> list[dict[str, Any]]:
    """The run's events, each JSON object with its `kind` and `step`, in step order (a start
    first at its step)."""
    found = data.read_tensors(
        ctx,
        experiment_id=eid,
        plugin_name=names.PLUGIN_NAME,
        downsample=DOWNSAMPLE,
        run_tag_filter=provider.RunTagFilter(runs=[run]),
    ).get(run, {})
    events = []
    for tag, points in found.items():
        kind = tag.split("/")[-2]
        for point in points:
            text = point.numpy.item()
            event = json.loads(text.decode() if isinstance(text, bytes) else text)
            events.append({**event, "kind": kind, "step": point.step})
    order = {kind: i for i, kind in enumerate(names.EVENT_KINDS)}
    return sorted(events, key=lambda e: (e["step"], order.get(e["kind"], len(order))))


def _with_starts(scale: list, starts: list[dict[str, Any]]) -> list:
    """The loss-scale points (the scale after each written step) with the scale each fit
    started at, one step before its first (the scale its first step used)."""
    written = {step for step, _ in scale}
    before = [
        [start["step"] - 1, start["loss_scale"]]
        for start in starts
        if start.get("loss_scale") and start["step"] - 1 not in written
    ]
    return sorted(scale + before)


def _last(points: list | None) -> float | None:
    return points[-1][1] if points else None


def _layers(scalars: dict[str, list]) -> list[dict[str, Any]]:
    prefix = names.SCALARS["layer_overflow_steps"] + "/"
    layers = [
        {"name": tag[len(prefix) :], "total": points[-1][1], "points": points}
        for tag, points in scalars.items()
        if tag.startswith(prefix) and points
    ]
    return sorted(layers, key=lambda layer: (-layer["total"], layer["name"]))


def _float8(scalars: dict[str, list]) -> list[dict[str, Any]]:
    prefix = names.SCALARS["float8"] + "/"
    series = []
    for tag, points in sorted(scalars.items()):
        if tag.startswith(prefix):
            layer, tensor, statistic = tag[len(prefix) :].rsplit("/", 2)
            series.append(
                {"layer": layer, "tensor": tensor, "statistic": statistic, "points": points}
            )
    return series
