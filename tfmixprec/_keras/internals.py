"""Every name of Keras's (and TensorFlow's) internals that `_keras/` uses, one entry a use with
its reason, so the next Keras that moves one shows it the day it lands.

`tests/_keras/test_keras_names.py` checks both ways: each entry exists in the Keras and
TensorFlow installed (an import path imports, a private attribute is on a real object of its
owner's kind), and the entries are exactly the uses the code of `_keras/` makes (read from its
source: imports from `keras.src` / `tensorflow.python`, the functions of such a module,
`tf.__internal__`, private attributes read, set or overridden), so a new use cannot be
forgotten here. `.ci/nightly` runs that test against the newest Keras pre-release.
"""

from __future__ import annotations

import dataclasses

__all__: list[str] = []  # private module: nothing here is part of the package's API


@dataclasses.dataclass(frozen=True)
class Internal:
    """One use of an internal name by one module of `_keras/`.

    Attributes:
        module: String. The module of `_keras/` that uses it (`"fit"`).
        name: String. An import path (`"keras.src.losses.losses.LossFunctionWrapper"`,
            `"tensorflow.__internal__.distribute.strategy_supports_no_merge_call"`), or a
            private attribute as `"<owner>.<attribute>"` (`"Dense._kernel"`), the owner a
            kind of object the test builds (`OWNERS`).
        reason: String. Why tfmixprec needs it (the function's docstring says more).
        instead: String. Where the name may be absent: what this Keras has in its place
            (checked instead), e.g. Keras 3.16's float8 strategy for `Dense._float8_call`.
    """

    module: str
    name: str
    reason: str
    instead: str = ""

    @property
    def key(self) -> str:
        """What the module's source shows: the path of an import, a private attribute's name."""
        owner, _, attribute = self.name.rpartition(".")
        return attribute if owner in OWNERS else self.name


# The kinds of objects whose private attributes `_keras/` reads (the test builds one of each).
OWNERS = (
    "Layer",
    "Dense",
    "MultiHeadAttention",
    "KerasTensor",
    "Model",
    "Loss",
    "Optimizer",
    "LossScaleOptimizer",
    "TensorBoard",
    "EpochIterator",  # Keras's `fit` iterates its epochs with one (`TFEpochIterator`)
    "tf.function",
    "EagerContext",
    "train_function",  # Keras's Python train function: its closure variables
    "one_step_on_data",  # ...and the per-batch step's wrapper's
)

# Private methods tfmixprec defines itself in a subclass of Keras's: not Keras's (the test
# checks that Keras has none of these names, so a Keras that adds one cannot be overridden
# unnoticed).
OWN = ("_checked_step", "_cross_replica_step")

_MERGE = "tensorflow.__internal__.distribute.strategy_supports_no_merge_call"
_TRAINER = "keras.src.backend.tensorflow.trainer._collective_all_reduce_multi_worker"

INTERNALS = (
    # fit: `fit` as tfmixprec hooks into it.
    Internal("fit", _TRAINER, "multi-worker fit: the fix applies where Keras's own test says"),
    Internal(
        "fit",
        "tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext",
        "in_xla_context: whether the function traced now is compiled with XLA",
    ),
    Internal("fit", _MERGE, "update_each_copy: whether a merge_call is needed"),
    Internal("fit", "TensorBoard._train_writer", "tfmixprec.TensorBoard writes into Keras's run"),
    Internal("fit", "TensorBoard._global_train_batch", "...at the batch steps Keras writes"),
    Internal("fit", "TensorBoard._should_write_train_graph", "whether Keras's batch end works"),
    Internal("fit", "TensorBoard._should_trace", "whether Keras's batch end works"),
    Internal("fit", "Model._loss_tracker", "whether any step of the epoch was applied"),
    Internal(
        "fit", "Model._maybe_symbolic_build", "MultiWorkerFit: builds from one batch; epochs_closed"
    ),
    Internal("fit", "EpochIterator._epoch_iterator", "epochs_closed: the epoch's generator"),
    Internal("fit", "EpochIterator._distributed_dataset", "BuiltBeforeTrace: the data's spec"),
    Internal("fit", "Model._distribute_strategy", "BuiltBeforeTrace: Keras builds under one"),
    Internal("fit", "Model._compile_metrics", "BuiltBeforeTrace: whether a metric is unbuilt"),
    Internal("fit", "Model._compile_loss", "BuiltBeforeTrace: whether the loss is unbuilt"),
    Internal("fit", "Model._symbolic_build", "BuiltBeforeTrace: Keras's build from a batch"),
    Internal("fit", "Model._make_function", "MultiWorkerFit: the step's scalar logs as vectors"),
    Internal("fit", "tf.function._list_all_concrete_functions", "the traced train functions"),
    Internal("fit", "Model.train_function", "traced_train_functions: Keras's Python function"),
    Internal("fit", "train_function.multi_step_on_iterator", "...its per-execution tf.function"),
    Internal("fit", "train_function.one_step_on_data", "...its per-batch step (Keras 3.16)"),
    Internal("fit", "one_step_on_data.step_func", "...the step's tf.function, wrapped by Keras"),
    # float8: Keras's float8 layers watched and replayed.
    Internal(
        "float8",
        "Dense._float8_call",
        "the float8 forward tfmixprec's counters and replays replace (Keras 3.12 to 3.15)",
        instead="keras.src.quantizers.modes.float8.Float8Strategy.call",
    ),
    Internal("float8", "Dense._kernel", "the float kernel a float8 layer quantizes"),
    # graph: a model's layer graph.
    Internal("graph", "keras.src.models.functional.Functional", "MixedPrecisionModel.__new__"),
    Internal(
        "graph", "keras.src.models.model.functional_init_arguments", "MixedPrecisionModel.__new__"
    ),
    Internal("graph", "Model._flatten_layers", "all_sublayers: the only walk of nested layers"),
    Internal("graph", "KerasTensor._keras_history", "producing_layer / producing_output_index"),
    Internal("graph", "Model._build_shapes_dict", "build_shapes of a subclassed model"),
    Internal("graph", "Layer._losses", "call_losses: an observing call puts them back"),
    Internal("graph", "Layer._inbound_nodes", "node_outputs: a layer's functional calls"),
    # kernels: a layer's product in another dtype.
    Internal("kernels", "Layer._inbound_nodes", "reverse_called: a reverse embedding's calls"),
    Internal("kernels", "MultiHeadAttention._compute_attention", "float32_attention"),
    Internal("kernels", "MultiHeadAttention._dropout", "float32_attention: Keras's explicit path"),
    # losses: the dtype of a loss object.
    Internal("losses", "keras.src.losses.losses.LossFunctionWrapper", "as_compiled, as fit"),
    Internal("losses", "Loss._dtype_policy", "set_loss_dtype: Keras has no setter"),
    Internal("losses", "Loss._dtype", "set_loss_dtype: Keras has no setter"),
    # op_watch: the first non-finite low-precision operation.
    Internal(
        "op_watch", "tensorflow.python.framework.op_callbacks", "first_nonfinite_op's callback"
    ),
    Internal(
        "op_watch", "tensorflow.python.framework.op_callbacks.add_op_callback", "...installed"
    ),
    Internal(
        "op_watch", "tensorflow.python.framework.op_callbacks.remove_op_callback", "...removed"
    ),
    # optimizer_hooks: Keras's LossScaleOptimizer extended.
    Internal(
        "optimizer_hooks",
        "keras.src.utils.tracking.no_automatic_dependency_tracking",
        "the optimizer's build, as Keras's own LossScaleOptimizer.build",
    ),
    Internal("optimizer_hooks", _MERGE, "apply: Keras's structure with or without merge_call"),
    Internal("optimizer_hooks", "Optimizer._trainable_variables", "built_variables"),
    Internal("optimizer_hooks", "Optimizer._get_variable_index", "variable_index"),
    Internal(
        "optimizer_hooks", "Optimizer._overwrite_variable_with_gradient", "float8's variables"
    ),
    Internal("optimizer_hooks", "Optimizer._trackable_children", "checkpoints by name"),
    Internal("optimizer_hooks", "LossScaleOptimizer._tf_apply", "apply/skip with flags"),
    Internal("optimizer_hooks", "LossScaleOptimizer._stateful_handle_finite_grads", "Keras's hook"),
    Internal(
        "optimizer_hooks", "LossScaleOptimizer._stateful_handle_non_finite_grads", "Keras's hook"
    ),
    Internal("optimizer_hooks", "Model._compile_config", "set_compiled_optimizer: model.save"),
    # saving: a saved file's model.
    Internal(
        "saving",
        "keras.src.legacy.saving.saving_utils.model_from_config",
        "declared_model: a legacy .h5 config, as Keras's legacy loader builds it",
    ),
    # settings: process-wide settings read and put back.
    Internal("settings", "keras.src.backend.common.global_state", "the global policy, unset"),
    Internal(
        "settings",
        "keras.src.backend.common.global_state.get_global_attribute",
        "global_policy, global_seeds_kept",
    ),
    Internal(
        "settings",
        "keras.src.backend.common.global_state.set_global_attribute",
        "restore_global_policy, global_seeds_kept",
    ),
    Internal("settings", "tensorflow.python.eager.context", "grappler's options, as set"),
    Internal("settings", "tensorflow.python.eager.context.context", "the eager context"),
    Internal(
        "settings", "EagerContext._optimizer_experimental_options", "an option never set, unset"
    ),
)
