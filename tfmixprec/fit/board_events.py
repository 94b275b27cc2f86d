"""The events of a run that the "Mixed precision" tab tabulates, written as TensorBoard
summaries of the tab's own plugin (`_tfmixprec_board`): a fit's start, each diagnosis, each
repair, overflows at `min_scale` and an `OverflowGuard` stop, one JSON object each, at its step.

`tfmixprec.TensorBoard` writes them; `_tfmixprec_board.names` holds the tags and kinds the tab
reads. Each event has its own tag (its kind and step): TensorBoard keeps at most 10 samples a
tag of a plugin it does not know, and a run may have more diagnoses than that.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import tensorflow as tf
from tensorboard.compat.proto import summary_pb2

from _tfmixprec_board import names
from tfmixprec._common.text import jsonable

__all__: list[str] = []  # private module: nothing here is part of the package's API

# The tab's plugin owns these summaries; a tensor summary (TensorBoard's data class).
METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=names.PLUGIN_NAME),
    data_class=summary_pb2.DATA_CLASS_TENSOR,
)


def write_event(writer: Any, kind: str, step: int, payload: dict[str, Any]) -> None:
    """Writes one event (`payload`, JSON-ready) of `kind` at `step` with `writer` (a
    `tf.summary` writer), and flushes it."""
    text = json.dumps(jsonable(payload), allow_nan=False)
    with writer.as_default(), tf.summary.record_if(True):
        tf.summary.write(
            names.event_tag(kind, step), tf.constant(text), step=step, metadata=METADATA
        )
    writer.flush()


def diagnosis_event(diagnosis: Any) -> dict[str, Any]:
    """An `OverflowDiagnosis` as the tab shows it: cause, layer, the value behind the cause
    (the layer's largest |x| in float32, e.g. past float16's 65504; None for a cause that is
    not a layer's value), the message and the markdown table."""
    row = next((r for r in diagnosis.layers if r.layer == diagnosis.layer), None)
    value = None if row is None else row.float32_max_abs
    return {
        "cause": diagnosis.cause,
        "layer": diagnosis.layer,
        "value": value if value is None or math.isfinite(value) else str(value),
        "compute_dtype": None if row is None else row.compute_dtype,
        "loss_scale": diagnosis.loss_scale,
        "message": diagnosis.message,
        "text": diagnosis.to_markdown(),
    }


def repair_event(repair: Any) -> dict[str, Any]:
    """A `PrecisionRepair` repair: the layers moved to float32, the cause, the loss scale it
    restarted at, the message and its markdown."""
    event = dataclasses.asdict(repair)
    event.pop("step")  # the event's own step
    return {**event, "text": repair.to_markdown()}
