"""Real architectures, built from their configurations, to try mixed precision on: KerasHub's
GPT-2, Llama, Gemma, Mistral, BERT, ViT and ResNet, and `keras.applications`' MobileNetV3.

Nothing is downloaded: each model is built from a configuration with random weights, at a size
chosen here (`"tiny"` for tests, `"bench"` for benchmarks), and comes with a batch of data
in the shape its `fit` takes. The tests (`tests/test_zoo*.py`) and `benchmarks/zoo.py` use
them; so can you, to see what tfmixprec does on a model you did not write.

KerasHub is not a dependency of tfmixprec: `pip install "tfmixprec[zoo]"` (or `keras-hub`)
for its models.

Example:

>>> entry = tfmixprec.zoo.build("gpt2", size="tiny")
>>> entry.model.compile(optimizer="adam", loss=entry.loss)
>>> x, y, weights = entry.data(steps=2)
>>> history = entry.model.fit(x, y, sample_weight=weights, batch_size=entry.batch_size)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = ["MODELS", "SIZES", "ZooModel", "build"]

SIZES = ("tiny", "bench")


@dataclasses.dataclass(frozen=True)
class _Size:
    """One size of the zoo: text models' width, layers, heads, vocabulary and sequence, the
    image side, and the batch."""

    hidden: int
    layers: int
    heads: int
    vocabulary: int
    sequence: int
    image: int
    batch: int


_SIZE = {
    "tiny": _Size(hidden=32, layers=1, heads=4, vocabulary=64, sequence=8, image=32, batch=4),
    # A GPT-2 of 4 layers, hidden 256, 4 heads, vocabulary 8192, sequence 128, batch 16 (the
    # size benchmarks/zoo.py times); the others at the same width.
    "bench": _Size(
        hidden=256, layers=4, heads=4, vocabulary=8192, sequence=128, image=64, batch=16
    ),
}


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """A zoo model with what it trains on.

    Attributes:
        name: String. The zoo's name for it (one of `MODELS`).
        model: `keras.Model`. Built, not compiled.
        loss: A `keras.losses.Loss`: the loss its task trains with.
        batch_size: Int. The batch size of its size.
        data: Callable `data(steps, seed=0) -> (x, y, sample_weight)`: NumPy data for
            `steps` batches (`sample_weight` None where the task has none), the same for the
            same arguments.
    """

    name: str
    model: keras.Model
    loss: Any
    batch_size: int
    data: Callable[..., tuple[Any, Any, Any]]

    def dataset(self, steps: int, seed: int = 0) -> tf.data.Dataset:
        """`data(steps, seed)` as a repeated `tf.data.Dataset` of `batch_size` batches (with
        the weights where the task has them), for `fit(..., steps_per_epoch=...)`."""
        x, y, weights = self.data(steps, seed)
        data = (x, y) if weights is None else (x, y, weights)
        return tf.data.Dataset.from_tensor_slices(data).batch(self.batch_size).repeat()


def _tokens(size: _Size, segments: bool = False) -> Callable[..., tuple[Any, Any, Any]]:
    """Sequences that count up from a random start by a random stride (a task a language
    model learns), as `x` dict, next-token labels and the padding mask as weights."""

    def data(steps: int, seed: int = 0) -> tuple[Any, Any, Any]:
        rng = np.random.default_rng(seed)
        n = steps * size.batch
        start = rng.integers(0, size.vocabulary - 1, (n, 1))
        stride = rng.integers(1, 4, (n, 1))
        seq = 1 + (start + stride * np.arange(size.sequence + 1)) % (size.vocabulary - 1)
        seq = seq.astype("int32")
        mask = np.ones((n, size.sequence), "int32")
        x = {"token_ids": seq[:, :-1], "padding_mask": mask}
        if segments:  # a classifier: the label is the stride
            x["segment_ids"] = np.zeros_like(mask)
            return x, (stride[:, 0] - 1).astype("int32"), None
        return x, seq[:, 1:], mask.astype("float32")

    return data


def _images(size: _Size, classes: int) -> Callable[..., tuple[Any, Any, Any]]:
    """Images whose class is the channel with the brightest mean."""

    def data(steps: int, seed: int = 0) -> tuple[Any, Any, Any]:
        rng = np.random.default_rng(seed)
        n = steps * size.batch
        labels = rng.integers(0, classes, n)
        images = rng.normal(0, 1, (n, size.image, size.image, 3)).astype("float32")
        images[np.arange(n), :, :, labels % 3] += 1.0
        return images, labels.astype("int32"), None

    return data


def _decoder(kind: str, size: _Size) -> keras.Model:
    import keras_hub

    common = dict(
        vocabulary_size=size.vocabulary,
        num_layers=size.layers,
        hidden_dim=size.hidden,
        intermediate_dim=2 * size.hidden,
    )
    if kind == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(
            num_heads=size.heads, max_sequence_length=size.sequence, **common
        )
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    heads = dict(num_query_heads=size.heads)
    if kind == "llama":  # grouped-query attention: 2 key/value heads
        backbone = keras_hub.models.LlamaBackbone(num_key_value_heads=2, **heads, **common)
        return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    if kind == "mistral":
        backbone = keras_hub.models.MistralBackbone(num_key_value_heads=2, **heads, **common)
        return keras_hub.models.MistralCausalLM(backbone=backbone, preprocessor=None)
    # Gemma: one key/value head (multi-query attention)
    backbone = keras_hub.models.GemmaBackbone(
        num_key_value_heads=1, head_dim=size.hidden // size.heads, **heads, **common
    )
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def _bert(size: _Size) -> keras.Model:
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=size.vocabulary,
        num_layers=size.layers,
        num_heads=size.heads,
        hidden_dim=size.hidden,
        intermediate_dim=2 * size.hidden,
        max_sequence_length=size.sequence,
    )
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None)


def _vit(size: _Size) -> keras.Model:
    import keras_hub

    backbone = keras_hub.models.ViTBackbone(
        image_shape=(size.image, size.image, 3),
        patch_size=size.image // 4,
        num_layers=size.layers,
        num_heads=size.heads,
        hidden_dim=size.hidden,
        mlp_dim=2 * size.hidden,
    )
    return keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=3, preprocessor=None)


def _resnet(size: _Size) -> keras.Model:
    import keras_hub

    tiny = size.hidden < 64  # tiny: 2 stages of 1 block; else ResNet-18's 4 stages of 2
    stages = 2 if tiny else 4
    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[3 if tiny else 7],
        stackwise_num_filters=[64, 64] if tiny else [64, 128, 256, 512],
        stackwise_num_blocks=[1 if tiny else 2] * stages,
        stackwise_num_strides=[1] + [2] * (stages - 1),
        block_type="basic_block",
        image_shape=(size.image, size.image, 3),
    )
    return keras_hub.models.ResNetImageClassifier(
        backbone=backbone, num_classes=3, preprocessor=None
    )


def _mobilenet(size: _Size) -> keras.Model:
    return keras.applications.MobileNetV3Small(
        input_shape=(size.image, size.image, 3),
        weights=None,
        classes=3,
        include_preprocessing=False,
    )


def _logits_loss() -> Any:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# name -> (builder(size), loss(), data(size))
MODELS: dict[str, tuple[Callable, Callable, Callable]] = {
    "gpt2": (lambda s: _decoder("gpt2", s), _logits_loss, _tokens),
    "llama": (lambda s: _decoder("llama", s), _logits_loss, _tokens),
    "gemma": (lambda s: _decoder("gemma", s), _logits_loss, _tokens),
    "mistral": (lambda s: _decoder("mistral", s), _logits_loss, _tokens),
    "bert": (_bert, _logits_loss, lambda s: _tokens(s, segments=True)),
    "vit": (_vit, _logits_loss, lambda s: _images(s, 3)),
    "resnet": (_resnet, _logits_loss, lambda s: _images(s, 3)),
    "mobilenet": (
        _mobilenet,
        keras.losses.SparseCategoricalCrossentropy,  # its output is a softmax
        lambda s: _images(s, 3),
    ),
}


def build(name: str, size: str = "tiny", seed: int = 0) -> ZooModel:
    """Builds a zoo model under the current global dtype policy, from the seed.

    Args:
        name: String. One of `MODELS`: `"gpt2"`, `"llama"`, `"gemma"`, `"mistral"`, `"bert"`,
            `"vit"`, `"resnet"`, `"mobilenet"`.
        size: String. `"tiny"` (tests: a layer of width 32, images of 32x32) or `"bench"` (4
            layers of width 256, vocabulary 8192, sequence 128; a ResNet-18 and images of
            64x64).
        seed: Int. `keras.utils.set_random_seed(seed)` before building: the same weights
            under every policy.

    Returns:
        A `ZooModel`.

    Raises:
        ValueError: For an unknown name or size.
        ImportError: For a KerasHub model without `keras-hub` installed.
    """
    if not isinstance(name, str) or name not in MODELS:
        raise ValueError(f"Unknown zoo model. Valid names: {', '.join(MODELS)}. Received: {name!r}")
    if not isinstance(size, str) or size not in SIZES:
        raise ValueError(f"Unknown zoo size. Valid sizes: {', '.join(SIZES)}. Received: {size!r}")
    builder, loss, data = MODELS[name]
    dims = _SIZE[size]
    keras.utils.set_random_seed(seed)
    try:
        model = builder(dims)
    except ModuleNotFoundError as err:
        raise ImportError(
            f"The zoo model {name!r} is a KerasHub model: pip install keras-hub (or "
            f"'tfmixprec[zoo]'). ({err})"
        ) from err
    return ZooModel(name, model, loss(), dims.batch, data(dims))
