"""Regression: a chunked-local hit never lands inside a chunk whose tokens it dropped."""

from hypothesis import example, given, settings
from hypothesis import strategies as st

from properties.core.engine import RequestInput
from properties.engines.reference import make_engine
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import ChunkedLocalAttentionSpec


def _layout(chunk: int, bs: int) -> KVCacheLayout:
    spec = ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=chunk)
    return KVCacheLayout((KVCacheGroup(("l0",), spec),), num_blocks=64, max_model_len=128)


def test_fresh_prompt_with_unaligned_chunk_hits_nothing() -> None:
    # C 6, bs 4, 9 tokens, nothing cached: vLLM 0.33 answers 4 (block 0 null), which
    # would resume at position 4 of chunk [0, 6) without tokens 0..3. Sound answer: 0.
    engine = make_engine(_layout(6, 4))
    engine.add_request(RequestInput("a", tuple(range(9))))
    hit = engine.get_computed_blocks("a")
    assert hit.num_tokens == 0
    assert hit.block_ids == ((),)


@settings(max_examples=60, deadline=None)
@given(chunk=st.integers(1, 12), bs=st.integers(1, 6), length=st.integers(2, 40))
@example(chunk=6, bs=4, length=9)  # the vLLM finding
def test_chunked_hit_context_is_real(chunk: int, bs: int, length: int) -> None:
    """Whatever is cached, positions [floor(L/C)*C, L) of a hit L are real blocks."""
    layout = _layout(chunk, bs)
    engine = make_engine(layout)
    engine.add_request(RequestInput("w", tuple(range(length))))
    engine.allocate_slots("w", length)  # caches every full block of the prompt
    engine.free("w")
    engine.add_request(RequestInput("r", tuple(range(length)) + (99,)))
    hit = engine.get_computed_blocks("r")
    start = hit.num_tokens // chunk * chunk
    table = hit.block_ids[0]
    for p in range(start, hit.num_tokens):
        assert table[p // bs] != 0, (hit, p)
