"""Image inputs the scheduler level draws: placeholder tokens that name their image.

vLLM schedules a multimodal request's encoder inputs (images) by their placeholder
ranges in the prompt (``mm_features``) and hashes every block that overlaps one with the
item's identifier and offset (``("mm", identifier, offset - block start)``). The
reference hashes tokens only. The scheduler level keeps both exact by drawing
placeholder tokens that *name* their image: token ``IMAGE_BASE + IMAGE_STRIDE * i + j``
is position ``j`` of image ``i`` (``j < image_length(i)``), so two blocks with equal
tokens after equal prefixes overlap the same images at the same offsets, and vLLM's
extra keys never split what the reference joins (real models repeat one pad token
and tell images apart by their hash: that is the manager level's multimodal hashing,
not this module's).

* :func:`with_images` turns a text prompt into one with images: an ``IMAGE_TRIGGER``
  token at position ``p`` outside an image starts image ``i = sum(prompt[:p + 1]) %
  NUM_IMAGES``, which fills the next ``image_length(i)`` positions, if they are all in
  the prompt (an image is never cut: vLLM rejects an identifier whose placeholder
  length changes). Whether ``p`` starts an image depends on the prompt up to
  ``p + image_length(i)``, so a prompt's prefix keeps the images that end in it and
  prefix hits survive up to the first image it cuts;
* :func:`image_runs` reads the images back: maximal runs of consecutive positions
  ``j, j + 1, ...`` of one image, each an :class:`ImageRun` (identifier ``image-i``, or
  ``image-i@j`` for a run that does not start at position 0 of its image).

Worked example: ``with_images((1, 7, 2, 3, 4))``: position 1 (a 7, prefix sum 8)
starts image ``8 % 4 = 0`` of length 2: ``(1, 1000000, 1000001, 3, 4)``; its run is
``ImageRun(offset=1, length=2, identifier="image-0")``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: the first placeholder token id (text tokens are below it)
IMAGE_BASE = 1_000_000
#: placeholder ids of one image: ``IMAGE_BASE + IMAGE_STRIDE * image + position``
IMAGE_STRIDE = 1_000
#: images drawn (ids ``0..NUM_IMAGES - 1``)
NUM_IMAGES = 4
#: the text token that starts an image
IMAGE_TRIGGER = 7


def image_length(image: int) -> int:
    """The placeholder length of image ``image``: 2, 3, 5, 8 for images 0-3."""
    return (2, 3, 5, 8)[image % NUM_IMAGES]


#: the longest image (vLLM's ``max_tokens_per_item``)
MAX_IMAGE_LENGTH = max(image_length(i) for i in range(NUM_IMAGES))


def image_token(image: int, position: int) -> int:
    """Placeholder ``position`` of ``image``."""
    return IMAGE_BASE + IMAGE_STRIDE * image + position


def with_images(prompt: Sequence[int]) -> tuple[int, ...]:
    """``prompt`` with images (module docstring), causally."""
    out: list[int] = []
    total = 0
    image, left, position = 0, 0, 0
    for p, token in enumerate(prompt):
        total += token
        if left:
            out.append(image_token(image, position))
            position += 1
            left -= 1
            continue
        if token == IMAGE_TRIGGER and p + image_length(total % NUM_IMAGES) <= len(prompt):
            image = total % NUM_IMAGES
            out.append(image_token(image, 0))
            position, left = 1, image_length(image) - 1
            continue
        out.append(token)
    return tuple(out)


@dataclass(frozen=True)
class ImageRun:
    """One image's placeholders in a prompt: ``length`` tokens from ``offset``."""

    offset: int
    length: int
    identifier: str


def image_runs(prompt: Sequence[int]) -> list[ImageRun]:
    """The images of ``prompt``, in order (module docstring)."""
    runs: list[ImageRun] = []
    start = -1
    image = expect = 0
    for p, token in enumerate([*prompt, -1]):
        if start >= 0 and token == image_token(image, expect) and expect < IMAGE_STRIDE:
            expect += 1
            continue
        if start >= 0:
            first = prompt[start] - image_token(image, 0)
            name = f"image-{image}" if first == 0 else f"image-{image}@{first}"
            runs.append(ImageRun(start, p - start, name))
            start = -1
        if token >= IMAGE_BASE:
            image, first = divmod(token - IMAGE_BASE, IMAGE_STRIDE)
            start, expect = p, first + 1
    return runs


__all__ = [
    "IMAGE_BASE",
    "IMAGE_STRIDE",
    "IMAGE_TRIGGER",
    "MAX_IMAGE_LENGTH",
    "NUM_IMAGES",
    "ImageRun",
    "image_length",
    "image_runs",
    "image_token",
    "with_images",
]
