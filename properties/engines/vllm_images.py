"""The image model vLLM's scheduler sees at the scheduler level: what its encoder budget
and its requests' ``mm_features`` are built from, with no model and no processor.

vLLM's ``Scheduler`` sizes its encoder compute budget and encoder cache
(``MultiModalBudget``) from the model's multimodal processor: the modalities it
supports, the most items per prompt and the most placeholder tokens one item takes.
:class:`ImageRegistry` is the ``mm_registry`` the harness passes to the scheduler; its
processor describes one modality, ``image``, of at most
:data:`properties.core.images.MAX_IMAGE_LENGTH` tokens per item. :func:`mm_features`
turns a prompt's image runs (:func:`properties.core.images.image_runs`) into vLLM's
``MultiModalFeatureSpec`` list (no pixel data: the scheduler never reads it).

Example: ``mm_features((1, 1000000, 1000001, 3))`` is one image feature at offset 1,
length 2, identifier ``image-0``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from properties.core.images import MAX_IMAGE_LENGTH, image_runs

#: the modality every image feature has
MODALITY = "image"


@dataclass(frozen=True)
class MultiModalConfigStub:
    """The ``model_config.multimodal_config`` fields the scheduler path reads: no
    processor cache (nothing crosses processes), no embeddings-only inputs, not an
    encoder-only deployment."""

    mm_processor_cache_gb: float = 0.0
    enable_mm_embeds: bool = False
    mm_encoder_only: bool = False


@dataclass(frozen=True)
class ImageProcessingInfo:
    """A processor's ``info``: one modality, ``image``, of ``max_tokens`` tokens per item."""

    model_config: Any
    max_tokens: int = MAX_IMAGE_LENGTH
    supported_mm_limits: Mapping[str, int | None] = field(default_factory=lambda: {MODALITY: None})
    allowed_mm_limits: Mapping[str, int] = field(default_factory=lambda: {MODALITY: 64})

    @property
    def ctx(self) -> ImageProcessingInfo:  # ``info.ctx.model_config``
        return self

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        """At most ``max_tokens``, and never more than the model's context ``seq_len``
        (no longer image fits a prompt)."""
        return {MODALITY: min(self.max_tokens, seq_len)}


@dataclass(frozen=True)
class ImageProcessor:
    """A multimodal processor reduced to its ``info`` (all ``MultiModalBudget`` reads)."""

    info: ImageProcessingInfo


class ImageRegistry:
    """The ``mm_registry`` of the harness's scheduler: its one processor."""

    def create_processor(self, model_config: Any, **kwargs: Any) -> ImageProcessor:
        return ImageProcessor(ImageProcessingInfo(model_config))


def mm_features(prompt: Sequence[int]) -> list[Any]:
    """vLLM's ``MultiModalFeatureSpec`` per image run of ``prompt``, in order."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return [
        MultiModalFeatureSpec(
            data=None,
            modality=MODALITY,
            identifier=run.identifier,
            mm_position=PlaceholderRange(offset=run.offset, length=run.length),
            mm_hash=run.identifier,
        )
        for run in image_runs(prompt)
    ]


__all__ = [
    "ImageProcessingInfo",
    "ImageProcessor",
    "ImageRegistry",
    "MultiModalConfigStub",
    "mm_features",
]
