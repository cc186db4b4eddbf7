"""The prefix cache's key index in arrays (:class:`ArrayKeyIndex`, compiled loops) against
its dict form (:class:`DictKeyIndex`): random sequences of registrations (one block, a
fresh run), evictions (one, many), lookups and clears leave the same heads, the same
duplicates in registration order, the same keys per block and the same lookups, prefixes
and scans. Keys are drawn so that many share a home slot and probe runs wrap around the
table's end (the deletions' backward shifts are exercised). Hand-valued cases pin the
table's probing and shifting and the lists' order; the loops also run as plain Python
(no numba needed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import optimized.control.key_index as key_index
from optimized.control.block_pool import BlockPool
from optimized.control.hashing import HashChain, key_words
from optimized.control.key_index import ArrayKeyIndex, DictKeyIndex, make_key_index
from reference.errors import KVConformError

needs_numba = pytest.mark.skipif(
    not key_index.COMPILED,
    reason="numba is not installed (the jit extra) or KVCONFORM_JIT=0",
)

NUM_BLOCKS = 24  # -> 64 slots (1.5 per block, rounded up to a power of two)
NUM_GROUPS = 2


def _key(first_word: int, tag: int) -> bytes:
    """A 32-byte key whose first word (the home slot, with the group) is ``first_word``."""
    return first_word.to_bytes(8, "little") + bytes([tag]) * 24


#: first words 0, 64, 128 share home 0; 63 and 127 share home 63 (their runs wrap to 0)
KEYS = [_key(w, t) for w in (0, 64, 128, 63, 127, 1) for t in (1, 2)]


class Side:
    """One form of the index with the pool's part of the protocol: a block's group is
    set before it is indexed and cleared after it leaves."""

    def __init__(self, index_cls) -> None:
        self.block_group = np.full(NUM_BLOCKS, -1, dtype=np.int32)
        self.tokens = np.zeros(NUM_BLOCKS, dtype=np.int64)
        if index_cls is ArrayKeyIndex:
            self.index = ArrayKeyIndex(NUM_BLOCKS, self.block_group)
        else:
            self.index = DictKeyIndex(NUM_BLOCKS, NUM_GROUPS, self.block_group)

    def register(self, block: int, key: bytes, group: int) -> None:
        self.block_group[block] = group
        self.tokens[block] = 1
        self.index.add(block, key, group)

    def register_fresh(self, blocks: list[int], keys: list[bytes], group: int) -> None:
        ids = np.array(blocks, dtype=np.int64)
        self.block_group[ids] = group
        self.index.add_fresh(blocks, keys, group, ids)

    def evict(self, block: int) -> None:
        self.index.remove(block, int(self.block_group[block]))
        self.block_group[block] = -1

    def evict_many(self, blocks: list[int]) -> None:
        self.index.remove_many(np.array(blocks, dtype=np.int64), self.tokens)

    def clear(self) -> None:
        self.index.clear()
        self.block_group[:] = -1

    def state(self) -> tuple:
        heads = [dict(self.index.head_map(g)) for g in range(NUM_GROUPS)]
        dupes = [
            {k: list(v) for k, v in self.index.duplicate_map(g).items()} for g in range(NUM_GROUPS)
        ]
        keys = [self.index.key_of(b) for b in range(NUM_BLOCKS)]
        lookups = [
            (self.index.get_many(KEYS, g), self.index.prefix(KEYS, [g]), self.index.get(k, g))
            for g in range(NUM_GROUPS)
            for k in KEYS[:3]
        ]
        both = self.index.prefix(KEYS, [0, 1])
        return heads, dupes, keys, lookups, both, self.block_group.tolist()


@st.composite
def operations(draw) -> list[tuple]:
    """Registrations of unhashed blocks (one, or a fresh run with repeated keys), evictions
    of hashed blocks (one, or several in any order), occasionally a clear."""
    hashed: dict[int, int] = {}  # block -> group
    ops: list[tuple] = []
    for _ in range(draw(st.integers(1, 60))):
        free = [b for b in range(1, NUM_BLOCKS) if b not in hashed]
        kind = draw(st.sampled_from(["one", "fresh", "evict", "evict_many", "clear"]))
        group = draw(st.integers(0, NUM_GROUPS - 1))
        if kind == "one" and free:
            block = draw(st.sampled_from(free))
            ops.append(("one", block, draw(st.sampled_from(KEYS)), group))
            hashed[block] = group
        elif kind == "fresh" and free:
            blocks = draw(st.lists(st.sampled_from(free), min_size=1, max_size=8, unique=True))
            keys = [draw(st.sampled_from(KEYS)) for _ in blocks]
            ops.append(("fresh", blocks, keys, group))
            hashed.update(dict.fromkeys(blocks, group))
        elif kind == "evict" and hashed:
            block = draw(st.sampled_from(sorted(hashed)))
            ops.append(("evict", block))
            del hashed[block]
        elif kind == "evict_many" and hashed:
            blocks = draw(st.lists(st.sampled_from(sorted(hashed)), min_size=1, unique=True))
            ops.append(("evict_many", blocks))
            for b in blocks:
                del hashed[b]
        elif kind == "clear" and draw(st.integers(0, 9)) == 0:
            ops.append(("clear",))
            hashed.clear()
    return ops


def _apply(side: Side, op: tuple) -> None:
    name, *args = op
    {
        "one": side.register,
        "fresh": side.register_fresh,
        "evict": side.evict,
        "evict_many": side.evict_many,
        "clear": side.clear,
    }[name](*args)


@needs_numba
@settings(max_examples=300, deadline=None)
@given(ops=operations())
def test_the_array_index_matches_the_dict_form(ops) -> None:
    arrays, dicts = Side(ArrayKeyIndex), Side(DictKeyIndex)
    for op in ops:
        _apply(arrays, op)
        _apply(dicts, op)
        assert arrays.state() == dicts.state(), op


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=operations())
def test_the_loops_as_plain_python_match_the_dict_form(ops, monkeypatch_loops) -> None:
    """The same with the array form's loops run as Python (no numba needed)."""
    arrays, dicts = Side(ArrayKeyIndex), Side(DictKeyIndex)
    for op in ops:
        _apply(arrays, op)
        _apply(dicts, op)
    assert arrays.state() == dicts.state()


@pytest.fixture
def monkeypatch_loops(monkeypatch):
    """The array index's loops as plain Python functions (each calls the others as
    Python too)."""
    plain = {
        "_find": key_index.find_slot,
        "_delete": key_index.delete_slot,
        "_insert": key_index.insert_block,
        "_remove": key_index.remove_block,
        "compiled_lookup": key_index.lookup_heads,
        "compiled_insert": key_index.insert_blocks,
        "compiled_evict": key_index.evict_blocks,
        "compiled_lookup_right": key_index.lookup_right,
        "compiled_window_run": key_index.window_run,
    }
    for name, fn in plain.items():
        monkeypatch.setattr(key_index, name, fn)


def test_probing_and_backward_shift_by_hand(monkeypatch_loops) -> None:
    """Three keys of home 63 (a table of 64 slots): they take slots 63, 0, 1 (the run
    wraps). Evicting the first key's only block empties 63 and shifts the others back
    (0 -> 63, 1 -> 0): every key is still found, no slot is left marked."""
    side = Side(ArrayKeyIndex)
    index = side.index
    assert index.heads.size == 64
    a, b, c = (_key(63, t) for t in (1, 2, 3))
    for block, key in ((5, a), (6, b), (7, c)):
        side.register(block, key, 0)
    assert [index.heads[s] for s in (63, 0, 1)] == [5, 6, 7]
    side.evict(5)
    assert [index.heads[s] for s in (63, 0, 1)] == [6, 7, -1]
    assert (index.get(a, 0), index.get(b, 0), index.get(c, 0)) == (None, 6, 7)
    # an entry at its home stays: d (home 0) after the run; evicting b keeps d at 0's run
    d = _key(0, 9)
    side.register(8, d, 0)  # slots 63 (b), 0 (c), 1 (d: home 0, one step on)
    side.evict(6)
    assert [index.heads[s] for s in (63, 0, 1)] == [7, 8, -1]
    assert (index.get(c, 0), index.get(d, 0)) == (7, 8)


def test_duplicates_keep_registration_order_by_hand(monkeypatch_loops) -> None:
    """Key ``a`` on 3, 5, 7 (3 the head): evicting 5 leaves ``[3, 7]``; evicting 3 makes
    7 the head; a key of the same home in the other group is another key."""
    side = Side(ArrayKeyIndex)
    a = _key(0, 1)
    for block in (3, 5, 7):
        side.register(block, a, 0)
    side.register(9, a, 1)
    assert side.index.duplicate_map(0) == {a: [5, 7]}
    side.evict(5)
    assert side.index.duplicate_map(0) == {a: [7]}
    side.evict(3)
    assert side.index.head_map(0) == {a: 7} and side.index.duplicate_map(0) == {}
    assert side.index.head_map(1) == {a: 9}
    side.register_fresh([3, 5], [a, a], 0)  # after 7: 3 then 5
    assert side.index.duplicate_map(0) == {a: [3, 5]}


def test_scans_from_the_right_by_hand(monkeypatch_loops) -> None:
    """Rows 1, 2 and 4..6 of 8 cached. Mamba's scan (bs 4, A 8: rows ending on 8, 16,
    ...): below 8 -> row 5 (ends at 24); below 5 -> row 1. The window's (need 2, bs 4, A
    4): rows 5, 6 -> ``([b5, b6], 5)``; need 4 -> no run: the run reaching row 0 is
    none."""
    side = Side(ArrayKeyIndex)
    keys = [_key(100 + i, i) for i in range(8)]
    for i in (1, 2, 4, 5, 6):
        side.register(10 + i, keys[i], 0)
    query = key_words(keys)
    assert side.index.rightmost(query, 0, 8, 4, 8) == 5
    assert side.index.rightmost(query, 0, 5, 4, 8) == 1
    assert side.index.rightmost(query, 1, 8, 4, 8) == -1
    assert side.index.window(query, 0, 2, 4, 4) == ([15, 16], 5)
    assert side.index.window(query, 0, 4, 4, 4) == ([], 0)


def test_a_key_of_another_length_is_refused() -> None:
    with pytest.raises(KVConformError, match="must be 32 bytes, got 1"):
        key_words([b"a"])
    assert key_words([bytes(32)]).tolist() == [[0, 0, 0, 0]]


def test_a_hash_chain_keeps_its_hashes_as_words() -> None:
    """Made from 3 hashes, then 20 appended one at a time and 2 at once (its buffer grows
    past 16 hashes): every row is its hash's words, and a view taken before the growth
    still reads the old rows."""
    chain = HashChain(_key(7, t) for t in range(3))
    first = chain.words()
    assert first.shape == (3, 4) and first[:, 0].tolist() == [7, 7, 7]
    for t in range(20):
        chain.append(_key(100 + t, t))
    chain.extend([_key(200, 1), _key(201, 2)])
    assert chain.words().shape == (25, 4)
    assert chain.words().tolist() == key_words(list(chain)).tolist()
    assert first[:, 0].tolist() == [7, 7, 7]
    with pytest.raises(KVConformError, match="32 bytes"):
        chain.append(b"short")


@needs_numba
def test_a_compiled_pool_keeps_its_keys_in_arrays() -> None:
    assert isinstance(BlockPool(8, True, 4).index, ArrayKeyIndex)
    assert isinstance(BlockPool(8, True, 4, compiled=False).index, DictKeyIndex)
    assert isinstance(make_key_index(8, 1, np.full(8, -1, np.int32), False), DictKeyIndex)
