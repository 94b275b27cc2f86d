"""Computing a layer's product in another dtype than its policy's, through the layer's
own Keras internals: float32 products and convolutions for float16 layers on CPUs, a
reversible embedding's reverse projection, attention's scores and values."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

__all__: list[str] = []  # private module: nothing here is part of the package's API


# Why: `tfmixprec.cpu_float16` computes a float16 layer's product in float32 (TensorFlow's
# float16 CPU kernels are slow; benchmarks/RESULTS.md, 2b). Keras's `Dense`, `EinsumDense`
# and convolution layers have no hook for the product's dtype, so these re-implement their
# `call` (Keras 3.12 to 3.15) with the product in float32 and the rest as Keras does it.
def float32_product_call(layer: Any, inputs: Any, training: Any = None) -> Any:
    """`Dense.call` / `EinsumDense.call` with the product in float32.

    The kernel is read in float16 first, so its gradient passes a float16 cast and overflows
    where a float16 product's would; bias and activation stay in float16, as in Keras.
    """
    kernel = tf.cast(keras.ops.cast(layer.kernel, layer.compute_dtype), tf.float32)
    x = _dense_product(layer, tf.cast(inputs, tf.float32), kernel)
    return _dense_epilogue(layer, tf.cast(x, layer.compute_dtype))


def _dense_product(layer: Any, inputs: Any, kernel: Any) -> Any:
    """The product of a `Dense` (a matmul) or an `EinsumDense` (its einsum)."""
    if isinstance(layer, keras.layers.EinsumDense):
        return keras.ops.einsum(layer.equation, inputs, kernel)
    return keras.ops.matmul(inputs, kernel)


def _dense_epilogue(layer: Any, x: Any) -> Any:
    """What a `Dense` / `EinsumDense` does after its product, in `x`'s dtype: the bias (read
    in the compute dtype, as Keras adds it) and the activation."""
    if layer.bias is not None:
        x = keras.ops.add(x, tf.cast(layer.bias, x.dtype))
    if layer.activation is not None:
        x = layer.activation(x)
    return x


def _read_in_float32(layer: Any, variable: Any) -> tf.Tensor:
    """A kernel read in the compute dtype, then cast to float32: its gradient passes a
    float16 cast and overflows where a float16 product's would."""
    return tf.cast(keras.ops.cast(variable, layer.compute_dtype), tf.float32)


def _convolution_in_float32(layer: Any, inputs: tf.Tensor) -> tf.Tensor:
    """The convolution of `layer`'s own `call` (Keras's `Conv1D`, transposed, depthwise and
    separable convolutions call `keras.ops` directly, not `convolution_op`), in float32."""
    ops, common = keras.ops, dict(padding=layer.padding, data_format=layer.data_format)
    if isinstance(layer, keras.layers.SeparableConv1D | keras.layers.SeparableConv2D):
        depthwise = _read_in_float32(layer, layer.depthwise_kernel)
        pointwise = _read_in_float32(layer, layer.pointwise_kernel)
        return ops.separable_conv(
            inputs, depthwise, pointwise, layer.strides, dilation_rate=layer.dilation_rate, **common
        )
    kernel = _read_in_float32(layer, layer.kernel)
    if isinstance(layer, keras.layers.DepthwiseConv1D | keras.layers.DepthwiseConv2D):
        return ops.depthwise_conv(
            inputs, kernel, layer.strides, dilation_rate=layer.dilation_rate, **common
        )
    if "Transpose" in type(layer).__name__:
        return ops.conv_transpose(
            inputs,
            kernel,
            list(layer.strides),
            output_padding=layer.output_padding,
            dilation_rate=layer.dilation_rate,
            **common,
        )
    if layer.padding == "causal":  # Conv1D: pad the past, as Keras's own call does
        left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
        axis = 1 if layer.data_format == "channels_last" else 2
        inputs = ops.pad(inputs, [(left, 0) if i == axis else (0, 0) for i in range(3)])
        common["padding"] = "valid"
    return ops.conv(
        inputs, kernel, list(layer.strides), dilation_rate=layer.dilation_rate, **common
    )


def float32_convolution_call(layer: Any, inputs: Any) -> Any:
    """A convolution layer's `call` (one that does not use `convolution_op`) with the
    convolution in float32; bias and activation in float16, as in Keras."""
    x = tf.cast(_convolution_in_float32(layer, tf.cast(inputs, tf.float32)), layer.compute_dtype)
    if layer.bias is not None:
        channels = (layer.bias.shape[0],)
        shape = (1,) * (layer.rank + 1) + channels
        if layer.data_format != "channels_last":
            shape = (1,) + channels + (1,) * layer.rank
        x = keras.ops.add(x, keras.ops.reshape(layer.bias, shape))
    if layer.activation is not None:
        x = layer.activation(x)
    return x


# Why: `tfmixprec.cpu_bfloat16` computes a `ReversibleEmbedding`'s reverse projection (a
# language model's logits, its largest matmul) in the layer's compute dtype. Keras does not
# autocast an embedding's variables, so under `mixed_bfloat16` its `call(reverse=True)`
# multiplies bfloat16 activations by the float32 table, and the product runs in float32.
# Its public `reverse_dtype` would change that, but it is saved in the layer's config and
# leaves the logits in bfloat16; this re-implements Keras's reverse `call` (Keras 3.12 to
# 3.15; a Keras without `keras.layers.ReversibleEmbedding` has nothing routed) with the product
# in the compute dtype and the logits returned in float32, as Keras returns them.
REVERSIBLE_EMBEDDING = getattr(keras.layers, "ReversibleEmbedding", None)


def reverse_called(layer: Any) -> bool | None:
    """Whether a functional model calls `layer` with `reverse=True` (Keras keeps each
    symbolic call in the private `_inbound_nodes`, with its arguments); None when the layer
    has no symbolic calls (a subclassed model's: it may be)."""
    nodes = getattr(layer, "_inbound_nodes", None) or []
    if not nodes:
        return None
    return any(bool(node.arguments.kwargs.get("reverse", False)) for node in nodes)


def compute_dtype_reverse_call(layer: Any, inputs: Any, reverse: bool = False) -> Any:
    """`ReversibleEmbedding.call` with the reverse product in the layer's compute dtype."""
    if not reverse:
        return type(layer).call(layer, inputs, reverse=False)
    # bfloat16 only: under another policy (a layer moved to float16 later) the product stays
    # in float32, as Keras computes it against the float32 table.
    dtype = "bfloat16" if layer.compute_dtype == "bfloat16" else "float32"
    if layer.tie_weights:
        kernel = keras.ops.transpose(keras.ops.cast(layer.embeddings, dtype))
    else:
        kernel = keras.ops.cast(layer.reverse_embeddings, dtype)
    logits = keras.ops.cast(keras.ops.matmul(keras.ops.cast(inputs, dtype), kernel), "float32")
    if layer.logit_soft_cap is not None:
        cap = layer.logit_soft_cap
        logits = keras.ops.multiply(keras.ops.tanh(keras.ops.divide(logits, cap)), cap)
    return logits


# Why: `tfmixprec.cpu_float16` computes attention's score and value products in float32: in
# float16 they run TensorFlow's Eigen einsum and batched matmul, not oneDNN's (on a GPT-2
# step, 199 ms of op time against 145 for the same products in float32). Keras's
# `MultiHeadAttention` computes them in `_compute_attention`, which its docstring invites
# subclasses to override (Keras 3.12 to 3.15); this runs Keras's own with the projected
# query, key and value cast to float32, and casts the output back, on Keras's explicit path
# only (dropout, attention scores returned, or not 4-D): there the softmax layer casts the
# scores to its float16 policy, so a score past 65504 is `inf`, as in float16. On its other
# path (`ops.dot_product_attention`, no softmax layer) float32 scores could not overflow, so
# that path runs in float16, as Keras runs it.
ATTENTION_METHOD = "_compute_attention"  # the method `float32_attention` stands in for


def computes_kerass_attention(layer: Any) -> bool:
    """Whether `layer` computes attention with Keras's own `_compute_attention` (a
    `MultiHeadAttention`, KerasHub's attention layers among them, that does not override it)."""
    method = keras.layers.MultiHeadAttention._compute_attention
    return getattr(type(layer), "_compute_attention", None) is method


def float32_attention(
    layer: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
) -> Any:
    """`MultiHeadAttention._compute_attention` with the products in float32."""
    returns_scores = kwargs.get("return_attention_scores", args[2] if len(args) > 2 else False)
    if not (layer._dropout > 0.0 or returns_scores or len(query.shape) != 4):
        return type(layer)._compute_attention(layer, query, key, value, *args, **kwargs)
    output, scores = type(layer)._compute_attention(
        layer,
        tf.cast(query, tf.float32),
        tf.cast(key, tf.float32),
        tf.cast(value, tf.float32),
        *args,
        **kwargs,
    )
    return tf.cast(output, layer.compute_dtype), scores


# Why: `tfmixprec.cpu_bfloat16`'s float32 element-wise route (autocast-style, after PyTorch's
# CPU autocast: products in bfloat16, element-wise work in float32). Keras's `Dense` and
# `EinsumDense` have no hook for the dtype of their bias and activation, so this
# re-implements their `call` (Keras 3.12 to 3.15) with the product in the compute dtype, as
# Keras computes it, and the bias and activation in float32; the output is cast back to the
# compute dtype, so the layer's output dtype is Keras's.
def float32_epilogue_call(layer: Any, inputs: Any, training: Any = None) -> Any:
    """`Dense.call` / `EinsumDense.call` with the bias and activation in float32."""
    x = tf.cast(_dense_product(layer, inputs, layer.kernel), tf.float32)
    return tf.cast(_dense_epilogue(layer, x), layer.compute_dtype)


def float32_inside_call(layer: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
    """A layer's own `call` (Keras's `Dropout`, `Softmax`) on its inputs cast to float32, the
    output cast back to the compute dtype."""
    outputs = type(layer).call(layer, tf.cast(inputs, tf.float32), *args, **kwargs)
    return tf.cast(outputs, layer.compute_dtype)
