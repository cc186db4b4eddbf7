"""Multimodal items and prompt embeddings in the hash chain (vLLM 0.33's
``generate_block_hash_extra_keys`` and ``generate_lookahead_block_hash_extra_keys``):
check values worked out by hand from vLLM's rules; the first is vLLM's own
``test_mm_prefix_caching`` example."""

from __future__ import annotations

import pytest

from reference.errors import InvalidRequestError
from reference.hashing import block_extra_keys
from reference.media import (
    MultimodalItem,
    embeds_digest,
    input_identities,
    media_extra_keys,
    validate_media,
)
from reference.request import Request

AAA, BBB = MultimodalItem("aaa", 11, 10), MultimodalItem("bbb", 30, 18)


def test_items_straddling_blocks() -> None:
    # H 16: "aaa" covers 11..20, "bbb" 30..47
    assert media_extra_keys(0, 16, (AAA, BBB), None) == ([("mm", "aaa", 11)], [])
    assert media_extra_keys(16, 32, (AAA, BBB), None) == (
        [("mm", "aaa", -5), ("mm", "bbb", 14)],
        [],
    )
    assert media_extra_keys(32, 48, (AAA, BBB), None) == ([("mm", "bbb", -2)], [])
    assert media_extra_keys(48, 64, (AAA, BBB), None) == ([], [])


def test_key_order_lora_items_salt_embeds() -> None:
    embeds = tuple(range(20))
    keys = block_extra_keys(0, 16, "s", "ad", (AAA,), embeds)
    assert keys == (
        ("lora", "ad", "ad"),
        ("mm", "aaa", 11),
        ("cache_salt", "s"),
        ("prompt_embeds", embeds_digest(embeds, 0, 16)),
    )
    # a block past the prompt still carries the digest of an empty slice
    assert block_extra_keys(32, 48, None, None, (), embeds) == (
        ("prompt_embeds", embeds_digest(embeds, 32, 48)),
    )
    assert embeds_digest(embeds, 32, 48) == embeds_digest((), 0, 0)


def test_lookahead_window_takes_the_next_tokens_items() -> None:
    # H 4, L 2: block 0's window is [0, 6): an image starting at 5 is named in it
    image = MultimodalItem("img", 5, 3)
    request = Request("r", list(range(12)), 4, mm_items=(image,), num_hash_lookahead_tokens=2)
    plain = Request("p", list(range(12)), 4, num_hash_lookahead_tokens=2)
    assert len(request.block_hashes) == 2  # (j + 1) * 4 + 2 <= 12: j = 0, 1
    assert request.block_hashes[0] != plain.block_hashes[0]


def test_other_image_behind_equal_tokens_changes_every_later_hash() -> None:
    tokens = list(range(16))
    a = Request("a", tokens, 4, mm_items=(MultimodalItem("x", 5, 4),))
    b = Request("b", tokens, 4, mm_items=(MultimodalItem("y", 5, 4),))
    same = Request("c", tokens, 4, mm_items=(MultimodalItem("x", 5, 4),))
    moved = Request("d", tokens, 4, mm_items=(MultimodalItem("x", 6, 4),))
    assert a.block_hashes[0] == b.block_hashes[0]  # block 0 ([0, 4)) has no image
    assert all(x != y for x, y in zip(a.block_hashes[1:], b.block_hashes[1:]))
    assert a.block_hashes == same.block_hashes
    assert a.block_hashes[1] != moved.block_hashes[1]


def test_embeddings_key_every_block() -> None:
    tokens = list(range(8))
    a = Request("a", tokens, 4, prompt_embeds=[1] * 8)
    b = Request("b", tokens, 4, prompt_embeds=[1] * 4 + [2] * 4)
    assert a.block_hashes[0] == b.block_hashes[0]
    assert a.block_hashes[1] != b.block_hashes[1]
    a.append_output_token_ids([9, 9, 9, 9])  # a block of outputs: the empty slice's key
    assert len(a.block_hashes) == 3


@pytest.mark.parametrize(
    ("items", "embeds"),
    [
        ((("x", 3, 4),), None),  # past the 6-token prompt
        ((("x", 0, 3), ("y", 2, 2)), None),  # overlapping
        ((("", 0, 1),), None),  # empty identifier
        ((("x", 0, 0),), None),  # empty item
        ((), (1, 2)),  # not one id per position
        ((), (1, 2, 3, 4, 5, -1)),
    ],
)
def test_invalid_media_is_refused(items, embeds) -> None:
    with pytest.raises(InvalidRequestError):
        validate_media(InvalidRequestError, "Request", 6, items, embeds)


def test_input_identities() -> None:
    assert input_identities([5, 9, 7]) == [5, 9, 7]
    with_image = input_identities([5, 9, 7], (MultimodalItem("img", 1, 1),))
    assert with_image[0] == 5 and with_image[2] == 7 and with_image[1] >= 2**62
    other = input_identities([5, 9, 7], (MultimodalItem("other", 1, 1),))
    assert other[1] != with_image[1]
    embedded = input_identities([5, 9, 7], (), (0, 0, 1))
    assert all(v >= 2**62 for v in embedded) and embedded[0] != embedded[1]
