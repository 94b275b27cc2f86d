"""A traced step reads the loss scale once (`scaling/step_notes.py`): `scale_loss` reads it,
`apply` unscales with that value and hands it to both of its branches (which grow or back
off from it), and the batch keeper records it (`scale_used()`). Each step of several in one
`tf.function` (with XLA too, and under 2 replicas) uses its own scale: the scales and the
weights are those of the same steps run eagerly, bit for bit."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmixprec import LossScaleOptimizer

# Each step: its gradients' factor (inf: an overflow) and whether `scale_loss` scales it (else
# the step scales by the scale it reads itself, and `apply` reads it again).
STEPS = [(1.0, True), (np.inf, True), (2.0, False), (3.0, True), (np.inf, False), (1.0, True)]


def _optimizer():
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=8.0, dynamic_growth_steps=1)
    var = keras.Variable(np.ones(3, "float32"))
    opt.build([var])
    return opt, var


def _step(opt, var, factor, through_scale_loss):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(var.value * tf.constant([factor, 1.0, 1.0]))
        if through_scale_loss:
            scaled = opt.scale_loss(loss)
        else:
            scaled = loss * tf.cast(opt.loss_scale, tf.float32)
    opt.apply(tape.gradient(scaled, [var.value]), [var])
    return tf.cast(opt.loss_scale, tf.float32)


def _eager():
    opt, var = _optimizer()
    scales = [float(_step(opt, var, *step)) for step in STEPS]
    return scales, var.numpy()


def _reads(graph_def, name):
    """The ReadVariableOps of the captured handle `name` in a step and its branches."""
    library = {f.signature.name: f for f in graph_def.library.function}
    count = 0

    def walk(nodes, names):
        nonlocal count
        for node in nodes:
            inputs = [i.split(":")[0] for i in node.input if not i.startswith("^")]
            count += node.op == "ReadVariableOp" and inputs[0] in names
            if node.op in ("If", "StatelessIf"):
                at = [k for k, i in enumerate(inputs[1:]) if i in names]
                for branch in ("then_branch", "else_branch"):
                    function = library[node.attr[branch].func.name]
                    walk(function.node_def, {function.signature.input_arg[k].name for k in at})

    walk(graph_def.node, {name})
    return count


def test_a_step_reads_the_scale_once():
    """Before: four reads (`scale_loss`, the unscaling, and each branch)."""
    opt, var = _optimizer()
    noted = {}

    @tf.function
    def step(factor):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(tf.reduce_sum(var.value * factor))
        opt.apply(tape.gradient(scaled, [var.value]), [var])
        noted["used"] = opt.scale_used()
        return scaled

    concrete = step.get_concrete_function(tf.TensorSpec([3], tf.float32))
    handle = opt._loss_scale.scale_variable.value.handle
    inner = [t for outer, t in concrete.graph.captures if outer is handle]
    assert _reads(concrete.graph.as_graph_def(), inner[0].op.name) == 1
    # The keeper's record takes the scale the step read: the one read, before the branch.
    read = [op for op in concrete.graph.get_operations() if op.type == "ReadVariableOp"]
    assert noted["used"].op in read and noted["used"].op.inputs[0] is inner[0]
    assert opt.scale_used() is None  # eagerly: nothing noted


@pytest.mark.parametrize("jit_compile", [False, True])
def test_steps_in_one_function_use_each_its_own_scale(jit_compile):
    opt, var = _optimizer()

    @tf.function(jit_compile=jit_compile)
    def steps():
        return [_step(opt, var, *step) for step in STEPS]

    scales = [float(s) for s in steps()]
    eager_scales, eager_weights = _eager()
    assert scales == eager_scales == [16.0, 8.0, 16.0, 32.0, 16.0, 32.0]
    np.testing.assert_array_equal(var.numpy(), eager_weights)


def test_steps_in_one_function_under_two_replicas(two_cpu_strategy):
    def run(traced):
        with two_cpu_strategy.scope():
            opt, var = _optimizer()

        def steps():
            return [_step(opt, var, *step) for step in STEPS]

        runner = tf.function(lambda: two_cpu_strategy.run(steps)) if traced else None
        if traced:
            scales = runner()
        else:
            scales = [two_cpu_strategy.run(lambda s=s: _step(opt, var, *s)) for s in STEPS]
        local = two_cpu_strategy.experimental_local_results
        return [float(local(s)[0]) for s in scales], var.numpy()

    (scales, weights), (eager_scales, eager_weights) = run(True), run(False)
    assert scales == eager_scales == [16.0, 8.0, 16.0, 32.0, 16.0, 32.0]
    np.testing.assert_array_equal(weights, eager_weights)


@pytest.mark.parametrize("growth_steps", [1, 1000])
def test_a_scale_assigned_between_scale_loss_and_apply_is_read_again(growth_steps):
    """The user assigns the scale after `scale_loss` read it, in the step: `apply` unscales
    with the scale assigned and its branches grow from it or keep it, as eagerly."""

    def run(traced):
        opt = LossScaleOptimizer(
            keras.optimizers.SGD(0.5), initial_scale=8.0, dynamic_growth_steps=growth_steps
        )
        var = keras.Variable(np.ones(3, "float32"))
        opt.build([var])

        def step(factor):
            with tf.GradientTape() as tape:
                scaled = opt.scale_loss(tf.reduce_sum(var.value * factor))
            opt.loss_scale.assign(2.0)
            opt.apply(tape.gradient(scaled, [var.value]), [var])

        step = tf.function(step) if traced else step
        for factor in (1.0, np.inf):
            step(tf.constant(factor))
        return float(opt.loss_scale), float(opt.last_overflow_scale), var.numpy().tolist()

    assert run(True) == run(False)
    # Unscaled by 2, not by the 8 it was scaled with: 1 - 0.5 * 8 / 2; backed off from 2.
    assert run(True) == (1.0, 2.0, [-1.0, -1.0, -1.0])
