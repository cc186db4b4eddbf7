"""Dense float64 attention: masks of spec section 8 and the softmax, with hand values."""

from __future__ import annotations

import math

import pytest

from reference.attention import attend, dense_attention, first_visible_key, visible_keys
from reference.content import ContentModel
from reference.errors import InvalidSpecError
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

FULL = FullAttentionSpec(block_size=4)
SWA4 = SlidingWindowSpec(block_size=4, sliding_window=4)
CHUNK8 = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8)


def test_visible_keys_per_attention_type() -> None:
    assert visible_keys(FULL, 5) == range(0, 6)
    assert visible_keys(SWA4, 7) == range(4, 8)
    assert visible_keys(SWA4, 2) == range(0, 3)
    assert visible_keys(CHUNK8, 13) == range(8, 14)
    assert visible_keys(CHUNK8, 16) == range(16, 17)
    assert visible_keys(CHUNK8, 7) == range(0, 8)
    assert first_visible_key(SlidingWindowSpec(block_size=2, sliding_window=1), 9) == 9


def test_mamba_has_no_attention() -> None:
    with pytest.raises(InvalidSpecError, match="MambaSpec"):
        first_visible_key(MambaSpec(block_size=4), 3)


def test_attend_softmax_by_hand() -> None:
    # scores 0 and ln 3 (after the 1/sqrt(2) scale) -> weights 1/4 and 3/4
    s = math.log(3) * math.sqrt(2)
    out = attend(((1.0, 0.0),), [((0.0, 0.0),), ((s, 0.0),)], [((1.0, 0.0),), ((0.0, 1.0),)])
    assert out[0][0] == pytest.approx(0.25, abs=1e-12)
    assert out[0][1] == pytest.approx(0.75, abs=1e-12)


def test_single_visible_key_returns_its_value() -> None:
    m = ContentModel(num_kv_heads=2, head_size=4)
    h = m.prefix_hashes(range(10, 30))
    # query 0 (any type), SWA w=1 anywhere, chunked C=8 at a chunk start: one key -> its V
    for spec, p in (
        (FULL, 0),
        (SlidingWindowSpec(block_size=4, sliding_window=1), 11),
        (CHUNK8, 16),
    ):
        (out,) = dense_attention(m, spec, h, [p], layer=0)
        assert out == m.value(h, p, 0)  # weight exp(0) / 1 == 1 exactly


def test_two_keys_equal_weights_when_keys_match() -> None:
    # Window 2 with identical keys: output is the mean of the two values.
    k = ((0.5, -0.5),)
    out = attend(((0.3, 0.9),), [k, k], [((1.0, 2.0),), ((3.0, -2.0),)])
    assert out[0] == pytest.approx((2.0, 0.0), abs=1e-12)


def test_window_hides_older_keys() -> None:
    m = ContentModel()
    a = m.prefix_hashes([1, 2, 3, 4, 5, 6])
    b = m.prefix_hashes([1, 2, 3, 4, 5, 6])
    (sw,) = dense_attention(m, SWA4, a, [5], 0)
    (full,) = dense_attention(m, FULL, b, [5], 0)
    assert sw != full


def test_query_past_the_tokens_is_refused() -> None:
    m = ContentModel()
    with pytest.raises(InvalidSpecError, match="position 3 is past"):
        dense_attention(m, FULL, m.prefix_hashes([1, 2, 3]), [3], 0)
