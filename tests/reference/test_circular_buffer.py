"""Reference circular buffers (vLLM 0.33 ``CircularBufferManager``): one ring block per
request for its whole life, outside prefix caching. The tables and free queues are worked
out by hand and were also run on vLLM 0.33.0 through the adapter (same output)."""

from __future__ import annotations

import pytest

from properties.core.engine import RequestInput
from properties.engines.reference import ReferenceEngine
from reference.errors import InvalidLayoutError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import CircularBufferSpec, FullAttentionSpec, MambaSpec


def _layout(full_bs: int, ring: int, num_blocks: int = 10) -> KVCacheLayout:
    return KVCacheLayout(
        (
            KVCacheGroup(("l0",), FullAttentionSpec(block_size=full_bs)),
            KVCacheGroup(("l1",), CircularBufferSpec(block_size=ring)),
        ),
        num_blocks=num_blocks,
        max_model_len=64,
    )


def test_spec_flags() -> None:
    spec = CircularBufferSpec(block_size=4)
    assert spec.type_name == "circular_buffer"
    assert not spec.prefix_cacheable and not spec.uses_slot_mapping
    # one page per request whatever the length
    assert spec.max_memory_usage_bytes(64, 64) == spec.page_size_bytes


def test_one_ring_per_request_and_no_hit() -> None:
    eng = ReferenceEngine(_layout(4, 4))
    eng.add_request(RequestInput("r", tuple(range(10))))
    # full: cdiv(10, 4) = 3 blocks; the ring: 1 block
    assert eng.allocate_slots("r", 10) == ((1, 2, 3), (4,))
    eng.set_num_computed_tokens("r", 10)
    eng.append_output_tokens("r", [100, 101, 102])
    # 13 tokens: full grows to 4 blocks, the ring stays
    assert eng.allocate_slots("r", 3) == ((5,), ())
    eng.set_num_computed_tokens("r", 13)
    # the same 10-token prompt + 1: the full group hits 2 blocks (8 tokens), the ring
    # group hits nothing and does not limit the hit
    eng.add_request(RequestInput("s", tuple(range(10)) + (50,)))
    hit = eng.get_computed_blocks("s")
    assert (hit.block_ids, hit.num_tokens) == (((1, 2), ()), 8)
    assert eng.allocate_slots("s", 3, 8, hit) == ((6,), (7,))
    assert eng.get_block_ids("s") == ((1, 2, 6), (7,))
    assert eng.free_queue() == [8, 9]
    # freeing: uncached blocks (the rings, the partial tails) to the front, cached
    # blocks to the back in reverse order
    eng.free("s")
    assert eng.free_queue() == [7, 6, 8, 9]
    eng.free("r")
    assert eng.free_queue() == [4, 5, 7, 6, 8, 9, 3, 2, 1]


def test_hash_block_size_ignores_the_ring() -> None:
    layout = _layout(8, 4)
    assert (layout.hash_block_size, layout.scheduler_block_size) == (8, 8)
    eng = ReferenceEngine(layout)
    eng.add_request(RequestInput("a", tuple(range(17))))
    assert eng.allocate_slots("a", 17) == ((1, 2, 3), (4,))
    eng.set_num_computed_tokens("a", 17)
    eng.add_request(RequestInput("b", tuple(range(17))))
    hit = eng.get_computed_blocks("b")
    assert (hit.block_ids, hit.num_tokens) == (((1, 2), ()), 16)
    assert eng.allocate_slots("b", 1, 16, hit) == ((5,), (6,))


def test_layout_rules() -> None:
    ring = KVCacheGroup(("c",), CircularBufferSpec(block_size=4))
    with pytest.raises(InvalidLayoutError, match="circular buffer"):
        KVCacheLayout((ring, ring), num_blocks=8, max_model_len=32)
    # a ring of another size does not stop partial hits (Mamba 8 over hash 4)
    layout = KVCacheLayout(
        (
            KVCacheGroup(("f",), FullAttentionSpec(block_size=4)),
            KVCacheGroup(("m",), MambaSpec(block_size=8)),
            KVCacheGroup(("c",), CircularBufferSpec(block_size=2)),
        ),
        num_blocks=16,
        max_model_len=32,
    )
    assert layout.hash_block_size == 4 and layout.partial_hits_enabled


def test_a_layout_of_one_ring_alone_never_hits() -> None:
    """The unitary coordinator asks the ring's own scan (``no_hit``): a resend of the same
    prompt gets an empty hit and its own ring. (The production property draws rings beside
    other groups only, so this hand test is the one that reaches the scan.)"""
    layout = KVCacheLayout(
        (KVCacheGroup(("l0",), CircularBufferSpec(block_size=4)),), num_blocks=6, max_model_len=64
    )
    eng = ReferenceEngine(layout)
    eng.add_request(RequestInput("a", tuple(range(10))))
    assert eng.allocate_slots("a", 10) == ((1,),)
    eng.set_num_computed_tokens("a", 10)
    eng.add_request(RequestInput("b", tuple(range(10))))
    hit = eng.get_computed_blocks("b")
    assert (hit.block_ids, hit.num_tokens) == (((),), 0)
    assert eng.allocate_slots("b", 10, 0, hit) == ((2,),)
