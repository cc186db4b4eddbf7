"""The shadow cache's run forms (``write_run``, ``holds_run``, the block-by-block
``missing_context``) against the slot-by-slot rules they replace, written out here as a
plain dict model: every read, every ``blocks_ending`` set and every verdict and message
must agree, on one shared pool and on separate pools, with blocks reused by groups of
other block sizes, overwritten slots, Mamba states and slots never written."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from properties.checks.oracles import (
    OVERWRITTEN,
    ShadowCache,
    SlotContent,
    brute_force_longest_hit,
    describe_content,
    missing_context,
)
from properties.core.diff import token_range
from properties.core.engine import CachedBlock
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec, cdiv

#: Three groups of block sizes 4, 2 and 4 (a window) and a Mamba group of 2: a block one
#: group wrote is later written by a group whose last slot is another offset.
LAYOUT = KVCacheLayout(
    groups=(
        KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),
        KVCacheGroup(("l1",), FullAttentionSpec(block_size=2)),
        KVCacheGroup(("l2",), SlidingWindowSpec(block_size=4, sliding_window=3)),
        KVCacheGroup(("l3",), MambaSpec(block_size=2, shapes=((4, 8),), dtype_bytes=2)),
    ),
    num_blocks=8,
    max_model_len=32,
)
BLOCKS = range(1, 6)
PREFIXES = (11, 12, 13, 14, OVERWRITTEN)


class SlotModel:
    """The shadow as the rules state it: one content per (block, offset), and the blocks
    whose group's last slot holds a prefix."""

    def __init__(self, layout: KVCacheLayout, shared_pool: bool) -> None:
        self.shared_pool = shared_pool
        self.slots: dict[object, dict[int, SlotContent]] = {}
        self.last = [
            -1 if isinstance(g.spec, MambaSpec) else g.spec.block_size - 1 for g in layout.groups
        ]

    def write(self, gid: int, block: int, offset: int, prefix: int) -> None:
        key = block if self.shared_pool else (gid, block)
        self.slots.setdefault(key, {})[offset] = SlotContent(gid, prefix)

    def read(self, gid: int, block: int, offset: int) -> SlotContent | None:
        return self.slots.get(block if self.shared_pool else (gid, block), {}).get(offset)

    def ending(self, gid: int, prefix: int) -> set[int]:
        return {
            block
            for block in BLOCKS
            if self.read(gid, block, self.last[gid]) == SlotContent(gid, prefix)
        }

    def missing(self, gid: int, table, ids, start: int, end: int) -> str | None:
        """``missing_context`` slot by slot (attention groups)."""
        bs = LAYOUT.groups[gid].spec.block_size
        for p in range(start, end):
            idx = p // bs
            if idx >= len(table) or table[idx] == 0:
                return f"position {p} (block index {idx}) is null or missing in the table"
            if self.read(gid, table[idx], p % bs) != SlotContent(gid, ids[p]):
                got = describe_content(self.read(gid, table[idx], p % bs), gid, ids)
                return (
                    f"block {table[idx]} slot {p % bs} (position {p}) holds {got}, not the "
                    f"KV of this request's {token_range(p + 1)}"
                )
        return None


writes = st.lists(
    st.tuples(
        st.integers(0, 3),  # group
        st.sampled_from(BLOCKS),
        st.integers(0, 3),  # first offset (a Mamba group writes its state, offset -1)
        st.lists(st.sampled_from(PREFIXES), min_size=1, max_size=4),
        st.booleans(),  # as one run, or slot by slot
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(shared_pool=st.booleans(), ops=writes, seed=st.integers(0, 2**16))
def test_runs_agree_with_the_slot_by_slot_rules(shared_pool, ops, seed) -> None:
    shadow = ShadowCache(LAYOUT, shared_pool)
    model = SlotModel(LAYOUT, shared_pool)
    for gid, block, offset, prefixes, as_run in ops:
        bs = LAYOUT.groups[gid].spec.block_size
        if isinstance(LAYOUT.groups[gid].spec, MambaSpec):
            shadow.write(gid, block, -1, prefixes[0])
            model.write(gid, block, -1, prefixes[0])
            continue
        prefixes = prefixes[: max(1, bs - offset)] if offset < bs else prefixes[:1]
        if as_run:
            shadow.write_run(gid, block, offset, prefixes)
        else:
            for i, prefix in enumerate(prefixes):
                shadow.write(gid, block, offset + i, prefix)
        for i, prefix in enumerate(prefixes):
            model.write(gid, block, offset + i, prefix)
    for gid in range(len(LAYOUT.groups)):
        for block in BLOCKS:
            for offset in range(-1, 6):
                assert shadow.read(gid, block, offset) == model.read(gid, block, offset)
        for prefix in PREFIXES:
            assert shadow.blocks_ending(gid, prefix) == model.ending(gid, prefix)
        for block in BLOCKS:  # a block's copy (what a host tier's write or a copy-on-write keeps)
            key = block if shared_pool else (gid, block)
            assert shadow.block(gid, block) == model.slots.get(key, {})
    rng = random.Random(seed)
    for _ in range(40):
        gid = rng.choice((0, 1, 2))
        bs = LAYOUT.groups[gid].spec.block_size
        ids = [rng.choice(PREFIXES[:4]) for _ in range(12)]
        table = [rng.choice((0, *BLOCKS)) for _ in range(rng.randint(0, cdiv(12, bs)))]
        start = rng.randint(0, 12)
        end = rng.randint(start, 12)
        assert missing_context(LAYOUT, shadow, gid, table, ids, start, end) == model.missing(
            gid, table, ids, start, end
        )
        block, offset = rng.choice(BLOCKS), rng.randint(0, bs)
        first = rng.randint(0, 12)
        stop = rng.randint(first, min(12, first + bs - offset + 1))
        expected = all(
            model.read(gid, block, offset + i) == SlotContent(gid, ids[p])
            for i, p in enumerate(range(first, stop))
        )
        assert shadow.holds_run(gid, block, offset, ids, first, stop) == expected
        assert shadow.holds_run(gid, block, offset, tuple(ids), first, stop) == expected


def test_a_run_of_a_block_serves_a_hit_and_a_stale_slot_is_named() -> None:
    """Worked case: block 3 holds positions 0..3 of a request, then slot 2 is rewritten
    with another prefix: the hit search loses the block and the message names slot 2."""
    layout = KVCacheLayout(
        groups=(KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),),
        num_blocks=8,
        max_model_len=32,
    )
    shadow = ShadowCache(layout, shared_pool=True)
    ids = [21, 22, 23, 24, 25]
    shadow.write_run(0, 3, 0, ids[:4])
    assert shadow.blocks_ending(0, 24) == {3}
    cached = [CachedBlock(3, 0, 4)]
    assert brute_force_longest_hit(layout, shadow, cached, ids, 4, 4) == 4
    assert missing_context(layout, shadow, 0, [3], ids, 0, 4) is None
    shadow.write(0, 3, 2, 99)
    assert brute_force_longest_hit(layout, shadow, cached, ids, 4, 4) == 0
    assert missing_context(layout, shadow, 0, [3], ids, 1, 4) == (
        "block 3 slot 2 (position 2) holds the KV of a prefix this request does not share, "
        "not the KV of this request's tokens [0, 3)"
    )
    shadow.write_run(0, 3, 3, [7])  # the last slot: block 3 no longer ends prefix 24
    assert shadow.blocks_ending(0, 24) == set()
    assert shadow.blocks_ending(0, 7) == {3}


@pytest.mark.parametrize("stop", [6, 7])
def test_a_run_past_the_prefix_ids_is_read_slot_by_slot(stop) -> None:
    """``holds_run`` past the end of ``ids`` reads them one by one as ``holds`` would: an
    index error once it reaches a missing id, False when a slot before it differs."""
    shadow = ShadowCache(LAYOUT, shared_pool=True)
    ids = [1, 2, 3, 4, 5]
    for offset, prefix in enumerate([1, 2, 3, 4, 5, 6, 7]):
        shadow.write(0, 2, offset, prefix)
    with pytest.raises(IndexError):
        shadow.holds_run(0, 2, 0, ids, 0, stop)
    assert shadow.holds_run(0, 2, 0, [9, *ids[1:]], 0, stop) is False
