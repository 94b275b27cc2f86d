"""Where `PrecisionRepair` restarts the loss scale, where a repair lands when one call of the
train function runs several steps (`steps_per_execution`), and what a moved layer keeps."""

import keras
import numpy as np
import pytest
from overflow_models import C, overflowing
from overflow_models import model as overflow_model

import tfmixprec
from tfmixprec.precision import cpu_float16
from tfmixprec.precision.cpu_route import route_of

MAX_SCALE = tfmixprec.LossScaleConfig().max_scale  # 2^24


def _batch_norm_model(cls):
    """`big` (frozen, x 10000) passes 65504 and a BatchNormalization brings it back; the only
    other layer with weights, `out`, computes in float32: once `big` and `bn` move, no layer
    computes a gradient in float16."""
    keras.utils.set_random_seed(0)
    with tfmixprec.policy_scope("mixed_float16"):
        inputs = keras.Input((8,))
        big = keras.layers.Dense(16, name="big", kernel_initializer=C(1e4), trainable=False)
        hidden = keras.layers.BatchNormalization(name="bn")(big(inputs))
        outputs = keras.layers.Dense(1, name="out", dtype="float32")(hidden)
        built = cls(inputs, outputs)
        built.compile(tfmixprec.LossScaleOptimizer(keras.optimizers.SGD(1e-6)), "mse")
    return built


@pytest.mark.parametrize("cls", [keras.Model, tfmixprec.MixedPrecisionModel])
def test_with_no_float16_gradient_left_the_scale_restarts_at_max_scale(cls):
    """The restart is the largest power of two at which the largest gradient of a layer still
    computing in float16 stays 8x under 65504, verified finite on the replayed batch: none is
    left here, so it is `max_scale`, and the steps after it do not overflow."""
    model = _batch_norm_model(cls)
    repair = tfmixprec.PrecisionRepair(verbose=0)
    x, y = overflowing()
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[repair])
    [made] = repair.repairs
    assert (made.step, made.layers, made.loss_scale) == (4, ("big", "bn"), MAX_SCALE)
    state = model.optimizer.read_state()
    assert (state["loss_scale"], state["overflow_steps"], state["iterations"]) == (
        MAX_SCALE,
        5,
        11,
    )


def test_with_several_steps_an_execution_the_repair_lands_at_its_end():
    """Callbacks see a batch's end once a call of the train function: with
    `steps_per_execution=4` the fifth overflow (step 4) is seen after step 7, the steps 5-7
    overflow too (skipped), and the repair replays step 7's batch."""
    model = overflow_model("flows")
    model.compile(model.optimizer, "mse", steps_per_execution=4)
    repair = tfmixprec.PrecisionRepair(verbose=0)
    x, y = overflowing()
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[repair])
    [made] = repair.repairs
    assert (made.step, made.layers) == (7, ("big", "proj"))
    state = model.optimizer.read_state()
    assert (state["overflow_steps"], state["iterations"]) == (8, 8)
    assert np.isfinite(model.predict(x[:8], verbose=0)).all()


@pytest.mark.parametrize("cls", [keras.Model, tfmixprec.MixedPrecisionModel])
def test_a_layer_the_repair_moves_to_float32_leaves_its_float16_cpu_route(cls):
    """A route computes a float16 layer's product in float32 around a slow CPU kernel: a
    layer that now computes in float32 takes the class's method again, and `route_of` says
    so; the layers left in float16 keep theirs."""
    model = overflow_model("flows", cls=cls)
    no_fp16 = tfmixprec.HardwareInfo(cpu_name="Test CPU")  # Dense is routed on such a CPU
    cpu_float16.fast_float16_layers(model, hardware=no_fp16)
    assert route_of(model.get_layer("big")) == "float32 product"
    repair = tfmixprec.PrecisionRepair(verbose=0)
    x, y = overflowing()
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[repair])
    assert repair.repairs[0].layers == ("big", "proj")
    routes = {name: route_of(model.get_layer(name)) for name in ("big", "proj", "after")}
    assert routes == {"big": None, "proj": None, "after": "float32 product"}
    assert "call" not in vars(model.get_layer("big"))  # the class's method, no instance one
