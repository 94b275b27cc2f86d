"""What `tfmixprec.TensorBoard` writes and the "Mixed precision" tab reads: one place for both.

It imports nothing, so the writer (inside `tfmixprec`) and the plugin (inside TensorBoard's
process) share it without either importing the other's dependencies.

Scalars (TensorBoard's scalars plugin), all at one step numbering: the 0-based number of the
step just taken, skipped steps counted (the numbering of every tfmixprec message), or the
epoch with `update_freq="epoch"` (the run's `start` event says which):

- `mixed_precision/loss_scale`, `log2_loss_scale`, `overflow_steps` (the total so far) and
  `loss` (the step's logged loss), at each write;
- `mixed_precision/overflow` at each overflow step: how many overflow steps it stands for (1
  where the step is known exactly; more where several fell between two reads and only the last
  one's number is known, e.g. with `steps_per_execution > 1`), never written as 0;
- `mixed_precision/layer_overflow_steps/<layer>`: each layer's total, after an interval with
  overflows;
- `mixed_precision/float8/<layer>/<tensor>/<statistic>`.

Events (this plugin's own tensor summaries, one JSON object each, one tag each: TensorBoard
keeps only 10 samples a tag of a plugin it does not know): `mixed_precision/event/<kind>/<step>`.
"""

PLUGIN_NAME = "tfmixprec"  # the plugin's name: its data, its routes (/data/plugin/tfmixprec/)
TAB_NAME = "Mixed precision"  # the tab's title in TensorBoard's tab bar
PREFIX = "mixed_precision"
EVENT_PREFIX = f"{PREFIX}/event"

# The kinds of event, in the order a run's table explains them.
START = "start"  # a fit began: the run's axis ("step" or "epoch"), policy, scale, settings
DIAGNOSIS = "diagnosis"  # an overflow step replayed: cause, layer, the value, the message
REPAIR = "repair"  # a PrecisionRepair judgment that moved layers (or the loss) to float32
MIN_SCALE = "min_scale"  # gradients not finite at min_scale, where lowering cannot help
GUARD_STOP = "guard_stop"  # OverflowGuard stopped training
EVENT_KINDS = (START, DIAGNOSIS, REPAIR, MIN_SCALE, GUARD_STOP)

SCALARS = {
    "loss_scale": f"{PREFIX}/loss_scale",
    "log2_loss_scale": f"{PREFIX}/log2_loss_scale",
    "overflow": f"{PREFIX}/overflow",
    "overflow_steps": f"{PREFIX}/overflow_steps",
    "loss": f"{PREFIX}/loss",
    "layer_overflow_steps": f"{PREFIX}/layer_overflow_steps",  # + "/<layer>"
    "float8": f"{PREFIX}/float8",  # + "/<layer>/<tensor>/<statistic>"
}


def event_tag(kind: str, step: int) -> str:
    """The tag of one event: its kind and its step (zero-padded, so tags sort by step)."""
    if kind not in EVENT_KINDS:
        raise ValueError(f"kind must be one of {EVENT_KINDS}. Received: kind={kind!r}")
    return f"{EVENT_PREFIX}/{kind}/{int(step):010d}"
