"""The "Mixed precision" custom-scalars layout: the charts of what `tfmixprec.TensorBoard`
writes, in TensorBoard's Custom Scalars tab (the fallback for a TensorBoard that cannot load the
"Mixed precision" tab's plugin), and the tags it writes them under."""

from __future__ import annotations

import re
from collections.abc import Sequence

from tensorboard.plugins.custom_scalar import layout_pb2

from _tfmixprec_board import names

__all__ = ["dashboard_layout"]  # what the package exports

PREFIX = names.PREFIX
LAYOUT_TITLE = names.TAB_NAME
TAGS = {
    **names.SCALARS,  # the scalars the "Mixed precision" tab reads too
    "grad_underflow_fraction": f"{PREFIX}/grad_underflow_fraction",
    "grad_subnormal_fraction": f"{PREFIX}/grad_subnormal_fraction",
    "grad_log2_abs": f"{PREFIX}/grad_log2_abs",
    "overflow_report": f"{PREFIX}/overflow_report",  # text
    "diagnosis": f"{PREFIX}/diagnosis",  # text
    "repairs": f"{PREFIX}/repairs",  # text, at each PrecisionRepair repair's step
    "repaired_layers": f"{PREFIX}/repaired_layers",  # layers moved to float32, in all
}
# What is written per float8 layer and quantized tensor (inputs, kernel, outputs_grad), each
# over the interval since the last write, and the title of the chart each goes to (None: not
# charted; the scale and the amax are charted as log2, where the three tensors' scales, which
# lie orders of magnitude apart, can be told apart).
FLOAT8_STATS = {
    "saturated_fraction": "saturated (fraction)",
    "underflow_fraction": "zero once quantized (fraction)",
    "flushed_fraction": "non-zero values flushed to zero (fraction)",
    "log2_scale": "scale (log2)",
    "log2_amax": "amax (log2)",
    "scale": None,
    "amax": None,
}
FLOAT8_TITLE = f"{LAYOUT_TITLE}: float8"
LAYERS_TITLE = f"{LAYOUT_TITLE}: overflow steps per layer (total)"  # one chart a layer


def _exact(title: str, tag: str) -> layout_pb2.Chart:
    """A chart of `tag` (an exact name) drawn as written: a margin chart whose margins are the
    value itself. TensorBoard's Custom Scalars tab smooths multiline charts (0.6 by default,
    which turns each step of the loss scale or of a count into a curve) but never a margin
    chart: its smoothing setting is not passed to them."""
    series = layout_pb2.MarginChartContent.Series(value=tag, lower=tag, upper=tag)
    return layout_pb2.Chart(title=title, margin=layout_pb2.MarginChartContent(series=[series]))


def _shown_in_order(charts: list[layout_pb2.Chart]) -> list[layout_pb2.Chart]:
    """`charts` (all margin charts) as the layout must list them for TensorBoard to show them
    in this order: its Custom Scalars tab stacks a category's margin charts last first."""
    return charts[::-1]


def dashboard_layout(
    *,
    per_batch: bool = True,
    loss_scale: bool = True,
    gradient_range: bool = True,
    layers: Sequence[str] = (),
    repairs: bool = False,
    float8_layers: Sequence[str] = (),
) -> layout_pb2.Layout:
    """The custom-scalars layout: loss next to loss scale, overflow events, gradient range.

    Every chart shows one tag as written, never smoothed (a margin chart, which TensorBoard
    does not smooth), one line a run: its title says what it is. The flags leave out the
    charts of tags a run does not write: `tfmixprec.TensorBoard` writes the layout at train
    begin with what it will write, and again with `layers` when a layer overflows for the
    first time.

    Shown in this order (the layout lists each category's charts last first, the order
    TensorBoard stacks margin charts in): category "Mixed precision": "Loss (per batch)"
    (`per_batch`; else "Loss (per epoch)" first), "Loss scale (log2)", "Overflow events
    (skipped steps)" (`loss_scale`), "Loss (per epoch)", "Overflow steps (total)"
    (`loss_scale`), "Gradients below float16's range (fraction)", "Gradients in float16's
    subnormal range (fraction)" (`gradient_range`); with `layers`, category "Mixed precision:
    overflow steps per layer (total)": one chart a layer, titled with its name; with
    `float8_layers`, category "Mixed precision: float8": per layer, one chart a statistic
    ("<layer>: saturated (fraction)", ..., "<layer>: amax (log2)", see `FLOAT8_STATS`), a
    line per quantized tensor.

    Args:
        per_batch: Bool. Whether the run writes per-batch summaries (`update_freq` not
            `"epoch"`): the per-batch loss chart.
        loss_scale: Bool. Whether the model has loss scaling: the loss-scale and overflow
            charts.
        gradient_range: Bool. Whether a `GradientRangeMonitor` is driven: its two charts.
        layers: Sequence of layer names. A chart of `mixed_precision/layer_overflow_steps/<layer>`
            each, in this order.
        repairs: Bool. Whether `PrecisionRepair` repaired the run: a chart "Layers moved to
            float32 by PrecisionRepair (total)" last in "Mixed precision".
        float8_layers: Sequence of layer paths. The model's float8 layers: their charts of
            `mixed_precision/float8/<layer>/<tensor>/<statistic>`.

    Returns:
        A `tensorboard.plugins.custom_scalar.layout_pb2.Layout`.
    """
    loss = {
        "batch": _exact("Loss (per batch)", "batch_loss"),
        "epoch": _exact("Loss (per epoch)", "epoch_loss"),
    }
    charts = [loss["batch" if per_batch else "epoch"]]
    if loss_scale:
        charts.append(_exact("Loss scale (log2)", TAGS["log2_loss_scale"]))
        charts.append(_exact("Overflow events (skipped steps)", TAGS["overflow"]))
    if per_batch:
        charts.append(loss["epoch"])
    if loss_scale:
        charts.append(_exact("Overflow steps (total)", TAGS["overflow_steps"]))
    if gradient_range:
        charts.append(
            _exact("Gradients below float16's range (fraction)", TAGS["grad_underflow_fraction"])
        )
        charts.append(
            _exact(
                "Gradients in float16's subnormal range (fraction)",
                TAGS["grad_subnormal_fraction"],
            )
        )
    if repairs:
        title = "Layers moved to float32 by PrecisionRepair (total)"
        charts.append(_exact(title, TAGS["repaired_layers"]))
    return layout_pb2.Layout(category=_categories(charts, layers, float8_layers))


def _categories(
    charts: list[layout_pb2.Chart], layers: Sequence[str], float8_layers: Sequence[str]
) -> list[layout_pb2.Category]:
    """The layout's categories: "Mixed precision" (`charts`), then the per-layer overflow
    charts and the float8 charts when there are any."""
    categories = [layout_pb2.Category(title=LAYOUT_TITLE, chart=_shown_in_order(charts))]
    if layers:
        per_layer = [_exact(layer, f"{TAGS['layer_overflow_steps']}/{layer}") for layer in layers]
        categories.append(layout_pb2.Category(title=LAYERS_TITLE, chart=_shown_in_order(per_layer)))
    if float8_layers:
        float8 = _float8_charts(float8_layers)
        categories.append(layout_pb2.Category(title=FLOAT8_TITLE, chart=float8))
    return categories


def _float8_charts(layers: Sequence[str]) -> list[layout_pb2.Chart]:
    """Per float8 layer, one chart a statistic, with a line per quantized tensor (the tags
    matched by a regular expression: TensorBoard smooths these, unlike the margin charts)."""
    charts = []
    for layer in layers:
        for stat, title in FLOAT8_STATS.items():
            if title is None:
                continue
            tags = f"^{re.escape(TAGS['float8'])}/{re.escape(layer)}/[a-z_]+/{stat}$"
            lines = layout_pb2.MultilineChartContent(tag=[tags])
            charts.append(layout_pb2.Chart(title=f"{layer}: {title}", multiline=lines))
    return charts
