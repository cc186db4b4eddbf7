"""The scheduler level's image placeholders: hand examples of ``with_images`` and
``image_runs``."""

from __future__ import annotations

from properties.core.images import (
    IMAGE_BASE,
    ImageRun,
    image_length,
    image_runs,
    image_token,
    with_images,
)


def test_lengths_and_tokens() -> None:
    assert [image_length(i) for i in range(4)] == [2, 3, 5, 8]
    assert image_token(2, 3) == IMAGE_BASE + 2003


def test_a_trigger_starts_the_image_its_prefix_sum_names() -> None:
    # position 1 (a 7, prefix sum 8) starts image 8 % 4 = 0, length 2
    assert with_images((1, 7, 2, 3, 4)) == (1, image_token(0, 0), image_token(0, 1), 3, 4)
    # position 0: sum 7 -> image 3 (length 8) does not fit in 5 tokens, so no image;
    # position 3: sum 7 + 1 + 1 + 7 = 16 -> image 0 (length 2) fits
    assert with_images((7, 1, 1, 7, 5)) == (7, 1, 1, image_token(0, 0), image_token(0, 1))


def test_an_image_is_never_cut_and_a_prefix_keeps_the_images_it_holds() -> None:
    prompt = (1, 7, 2, 3, 4, 6, 7, 0, 0, 0, 0, 0)
    full = with_images(prompt)
    # position 6: sum 1 + 7 + 2 + 3 + 4 + 6 + 7 = 30 -> image 2 (5 tokens), fits
    assert full[6:11] == tuple(image_token(2, j) for j in range(5))
    # a prefix that would cut image 2 keeps the 7 as text, the images before it stay
    assert with_images(prompt[:9]) == full[:6] + (7, 0, 0)


def test_runs_read_the_images_back() -> None:
    prompt = (1, *[image_token(3, j) for j in range(8)], 2, image_token(0, 0), image_token(0, 1))
    assert image_runs(prompt) == [ImageRun(1, 8, "image-3"), ImageRun(10, 2, "image-0")]
    # the same image twice in a row is two runs
    twice = (image_token(0, 0), image_token(0, 1), image_token(0, 0), image_token(0, 1))
    assert image_runs(twice) == [ImageRun(0, 2, "image-0"), ImageRun(2, 2, "image-0")]
    assert image_runs((1, 2, 3)) == []
