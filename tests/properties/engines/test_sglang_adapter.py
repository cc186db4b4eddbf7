"""Hand-written scenarios for the SGLang adapter (page sizes 1, 2, 4; both tree cores).

Expected ids follow from SGLang's allocators on a fresh pool: pages are handed out in
ascending order from 1 (page 0 is the padding page), in both the full and the SWA pool.
Run with ``.engines/sglang/bin/python -W ignore -m pytest
tests/properties/engines/test_sglang_adapter.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from properties.core.engine import EngineError, KVCacheEngine, RequestInput
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

pytestmark = pytest.mark.engine

_ROOT = Path(__file__).resolve().parents[3]
if not (_ROOT / ".engines" / "sglang" / ".kvconform-complete").exists():
    pytest.skip("SGLang is not installed (.engines/sglang)", allow_module_level=True)
pytest.importorskip("sglang.srt.mem_cache.unified_radix_cache")

from properties.engines.sglang import (  # noqa: E402
    SGLangEngine,
    make_engine,
    make_engine_rust,
)

PAGES = (1, 2, 4)
CORES = {"python": make_engine, "rust": make_engine_rust}
PREFIX = tuple(range(100, 112))  # 12 tokens: a whole number of pages for 1, 2 and 4


def hybrid(page: int, window: int = 4, pool_pages: int = 32) -> KVCacheLayout:
    return KVCacheLayout(
        groups=(
            KVCacheGroup(("full",), FullAttentionSpec(block_size=page)),
            KVCacheGroup(("swa",), SlidingWindowSpec(block_size=page, sliding_window=window)),
        ),
        num_blocks=pool_pages + 1,
        max_model_len=160,
    )


def sizes(engine: SGLangEngine) -> tuple[int, ...]:
    a, c = engine.allocator, engine.cache
    return (
        a.full_available_size(),
        a.swa_available_size(),
        c.full_evictable_size(),
        c.swa_evictable_size(),
        c.full_protected_size(),
        c.swa_protected_size(),
    )


def obtainable(engine: SGLangEngine) -> tuple[int, ...]:
    """Per pool, the slots an allocation could obtain (available + evictable), then the
    protected (locked) sizes: what a refused allocation must leave as it found it (the
    tree may evict while trying: that moves slots from evictable to available)."""
    fa, sa, fe, se, fp, sp = sizes(engine)
    return fa + fe, sa + se, fp, sp


def prefill(engine: SGLangEngine, rid: str, prompt: tuple[int, ...]):
    """Admit ``rid`` with its prefix hit and compute the whole prompt in one step."""
    engine.add_request(RequestInput(rid, prompt))
    hit = engine.get_computed_blocks(rid)
    new = engine.allocate_slots(
        rid, len(prompt) - hit.num_tokens, hit.num_tokens, hit if hit.num_tokens else None
    )
    assert new is not None
    engine.set_num_computed_tokens(rid, len(prompt))
    return hit, new


@pytest.fixture(params=[(p, c) for p in PAGES for c in CORES], ids=lambda v: f"bs{v[0]}-{v[1]}")
def setup(request):
    page, core = request.param
    return page, CORES[core](hybrid(page)), core


def test_engine_satisfies_protocol(setup):
    page, engine, core = setup
    assert isinstance(engine, KVCacheEngine)
    assert SGLangEngine.separate_group_pools is True
    expected_core = {"python": "UnifiedTreeCore", "rust": "RustUnifiedTreeCore"}[core]
    assert type(engine.cache.tree_core).__name__ == expected_core
    assert engine.num_free_blocks() == 32


def test_shared_prefix_hit(setup):
    page, engine, _ = setup
    prefill(engine, "A", PREFIX + (50,))
    table_a = engine.get_block_ids("A")
    # 13 tokens from a fresh pool: pages 1.. in both groups
    n_pages_a = {1: 13, 2: 7, 4: 4}[page]
    assert table_a == (tuple(range(1, n_pages_a + 1)), tuple(range(1, n_pages_a + 1)))
    engine.free("A")
    engine.add_request(RequestInput("B", PREFIX + (60, 61)))
    hit = engine.get_computed_blocks("B")
    assert hit.num_tokens == 12
    hit_pages = {1: 12, 2: 6, 4: 3}[page]
    assert hit.block_ids == (table_a[0][:hit_pages], table_a[1][:hit_pages])
    new = engine.allocate_slots("B", 2, 12, hit)
    assert new is not None
    assert engine.get_block_ids("B")[0][:hit_pages] == table_a[0][:hit_pages]


def test_hit_is_capped_below_prompt_length(setup):
    page, engine, _ = setup
    prefill(engine, "A", PREFIX + (50,))
    engine.free("A")
    # the same 13 tokens again: SGLang caps the key at 12 (n - 1), a whole page count
    engine.add_request(RequestInput("C", PREFIX + (50,)))
    assert engine.get_computed_blocks("C").num_tokens == 12
    # a 12-token prompt equal to the cached prefix: cap 11, rounded down to pages
    engine.add_request(RequestInput("D", PREFIX))
    assert engine.get_computed_blocks("D").num_tokens == {1: 11, 2: 10, 4: 8}[page]


def test_lookup_does_not_change_pool_sizes(setup):
    _, engine, _ = setup
    prefill(engine, "A", PREFIX + (50,))
    engine.free("A")
    engine.add_request(RequestInput("B", PREFIX + (7,)))
    before = sizes(engine)
    table_before = engine.get_block_ids("B")
    engine.get_computed_blocks("B")
    assert sizes(engine) == before
    assert engine.get_block_ids("B") == table_before == ((), ())


def test_free_then_reuse(setup):
    page, engine, _ = setup
    prefill(engine, "A", PREFIX + (50,))
    assert engine.num_free_blocks() == 32 - {1: 13, 2: 7, 4: 4}[page]
    engine.free("A")
    engine.remove_request("A")
    assert engine.num_free_blocks() == 32
    # a request as large as the pool reuses every page, evicting the cached prefix
    big = tuple(range(1000, 1000 + 32 * page))
    engine.add_request(RequestInput("X", big))
    assert engine.allocate_slots("X", len(big)) is not None
    assert sorted(engine.get_block_ids("X")[0]) == list(range(1, 33))
    engine.free("X")
    engine.add_request(RequestInput("B", PREFIX + (60,)))
    assert engine.get_computed_blocks("B").num_tokens == 0


def test_allocation_failure_returns_none_without_leaking(setup):
    page, engine, _ = setup
    prefill(engine, "A", PREFIX + (50,))
    engine.free("A")  # caches 13 | 6 | 3 pages
    # a running request holds all but 4 pages of what the cache leaves free
    hold = tuple(range(500, 500 + {1: 15, 2: 22, 4: 25}[page] * page))
    engine.add_request(RequestInput("H", hold))
    assert engine.allocate_slots("H", len(hold)) is not None
    engine.set_num_computed_tokens("H", len(hold))
    engine.add_request(RequestInput("B", PREFIX + tuple(range(7, 7 + 9 * page))))
    hit = engine.get_computed_blocks("B")
    assert hit.num_tokens == 12
    before = obtainable(engine)
    # 9 pages of new tokens: 4 are free (+1 evictable leaf page at bs 1); SGLang's
    # allocator refuses after the tree evicted what it could (that eviction stays)
    assert engine.allocate_slots("B", 9 * page, 12, hit) is None
    assert obtainable(engine) == before  # hit unlocked, nothing taken
    assert engine.get_block_ids("B") == ((), ())
    assert engine.get_computed_blocks("B").num_tokens == 12
    engine.free("H")
    hit = engine.get_computed_blocks("B")
    assert hit.num_tokens == 12
    assert engine.allocate_slots("B", 9 * page, 12, hit) is not None


def test_out_of_window_swa_pages_become_null(setup):
    page, engine, _ = setup
    prompt = tuple(range(200, 208))  # 8 tokens, window w=4 (SGLang: 3)
    prefill(engine, "A", prompt)
    engine.append_output_tokens("A", [1])
    assert engine.allocate_slots("A", 1) is not None  # next token p = 8 sees [5, 8]
    # SGLang keeps ceil(max(3, bs) / bs) pages behind p: frees tokens [0, 5) | [0, 4).
    # The paged allocator hands the page it just freed (1) to the new token; bs 1 frees
    # slots to a release list used only once the free list runs out (new slot 9).
    expected_swa = {1: (0, 0, 0, 0, 0, 6, 7, 8, 9), 2: (0, 0, 3, 4, 1), 4: (0, 2, 1)}[page]
    full_ids, swa_ids = engine.get_block_ids("A")
    assert swa_ids == expected_swa
    assert full_ids == tuple(range(1, len(expected_swa) + 1))


def test_reset_prefix_cache(setup):
    _, engine, _ = setup
    prefill(engine, "A", PREFIX + (50,))
    assert engine.reset_prefix_cache() is False
    engine.free("A")
    assert engine.reset_prefix_cache() is True
    engine.add_request(RequestInput("B", PREFIX + (60,)))
    assert engine.get_computed_blocks("B").num_tokens == 0
    assert engine.num_free_blocks() == 32


@pytest.mark.parametrize(
    "layout",
    [
        KVCacheLayout(
            groups=(KVCacheGroup(("f",), FullAttentionSpec(block_size=2)),),
            num_blocks=9,
            max_model_len=32,
        ),
        KVCacheLayout(
            groups=(
                KVCacheGroup(("f",), FullAttentionSpec(block_size=2)),
                KVCacheGroup(("s",), SlidingWindowSpec(block_size=4, sliding_window=4)),
            ),
            num_blocks=9,
            max_model_len=32,
        ),
        hybrid(8),
        hybrid(2, window=1),
        KVCacheLayout(
            groups=(
                KVCacheGroup(("f",), FullAttentionSpec(block_size=2)),
                KVCacheGroup(
                    ("c",), ChunkedLocalAttentionSpec(block_size=2, attention_chunk_size=4)
                ),
            ),
            num_blocks=9,
            max_model_len=32,
        ),
    ],
    ids=["one-group", "unequal-bs", "bs8", "w1", "chunked"],
)
def test_out_of_scope_layouts_raise(layout):
    with pytest.raises(EngineError, match="layout g0:full"):
        make_engine(layout)


# --------------------------------------------------------------- separate pools (S1-S3)
def test_pool_usage_reports_both_pools(setup):
    """Each pool's figure, not their minimum: SWA pages out of the window go back to the
    SWA pool only, so after a long prefill the SWA pool has more free pages."""
    page, engine, _ = setup
    fresh = engine.pool_usage()
    assert [(p.name, p.num_blocks, p.num_free) for p in fresh] == [
        ("full", 32, 32),
        ("swa", 32, 32),
    ]
    assert sorted(g for p in fresh for g in p.group_ids) == [0, 1]
    prompt = tuple(range(200, 200 + 10 * page))  # 10 pages
    prefill(engine, "A", prompt)
    engine.allocate_slots("A", 1, 0, None)  # the next step frees out-of-window SWA pages
    full, swa = engine.pool_usage()
    assert full.num_free == 32 - 11  # 10 pages + the decode page, none freed
    assert swa.num_free > full.num_free
    assert engine.num_free_blocks() == full.num_free


def _pool_state(engine, layout):
    from properties.checks.state import CheckState

    return CheckState(engine, layout)


def test_per_pool_accounting_catches_swa_locked_pages_counted_free():
    """The mutant counts locked SWA tree pages as obtainable: once B adopts A's cached
    prefix, the SWA pool's free + held exceeds its capacity (P1) while
    ``num_free_blocks()`` (the full pool's figure) stays right."""
    from properties.checks.invariants import pool_accounting_per_pool
    from properties.checks.state import PoolEvent
    from properties.mutants.sglang_mutants import swa_locked_pages_counted_free

    messages = {}
    for name, factory in (("sglang", make_engine), ("mutant", swa_locked_pages_counted_free)):
        layout = hybrid(2)
        engine = factory(layout)
        state = _pool_state(engine, layout)
        prefill(engine, "A", PREFIX + (50,))
        engine.free("A")
        hit, _ = prefill(engine, "B", PREFIX + (60, 61))
        assert hit.num_tokens == 12
        assert engine.cache.swa_protected_size() > 0  # B locks cached SWA pages
        state.invalidate()
        event = PoolEvent({"B": engine.get_block_ids("B")}, engine.num_free_blocks())
        messages[name] = pool_accounting_per_pool(state, event)
    assert messages["sglang"] is None
    assert messages["mutant"] is not None and "pool 'swa'" in messages["mutant"]


# -- issue 19: calls that drive branches the ci profile did not reach before -------------


def _mutant_patched(monkeypatch, name: str) -> None:
    from tests.properties.engines.sglang_mutants import mutated

    owner, method, function = mutated(name)
    monkeypatch.setattr(owner, method, function)


def test_decode_slot_comes_from_alloc_decode_and_a_mapping_mutant_shares_a_page(monkeypatch):
    """bs 2, window 4 (SGLang's 3). A and B each prefill 4 tokens: A pages 1, 2 and B
    pages 3, 4 in both pools. A's decode token at position 4 opens a page: SGLang's
    ``alloc_decode`` hands out page 5 in both pools; the next one (position 5) stays in
    it (no new page). The ``decode_mapping`` mutant maps the new slot to the SWA slot after
    A's last one (A's last SWA slot is 2 * 2 + 1 = 5, so slot 6 = page 3): B's SWA page,
    now in both rows."""
    for mutant in (False, True):
        with monkeypatch.context() as patch:
            if mutant:
                _mutant_patched(patch, "decode_mapping")
            engine = make_engine(hybrid(2))
            prefill(engine, "A", (1, 2, 3, 4))
            prefill(engine, "B", (5, 6, 7, 8))
            assert engine.get_block_ids("B") == ((3, 4), (3, 4))
            new = engine.allocate_slots("A", 1)
            if not mutant:
                assert new == ((5,), (5,))
                engine.set_num_computed_tokens("A", 5)
                assert engine.allocate_slots("A", 1) == ((), ())
                assert engine.get_block_ids("A") == ((1, 2, 5), (1, 2, 5))
            else:
                assert new == ((5,), (3,))  # B's SWA page 3


def test_odd_requests_publish_their_prefix_after_prefill_and_release_the_swa_lock_later():
    """bs 2, window 4 (SGLang's 3: the lock keeps ceil(3 / 2) = 2 SWA pages). A (the
    first request) prefills 12 tokens and publishes nothing until it is freed: a lookup
    of its prompt hits 0. B (the second) prefills 12 other tokens and publishes them at
    once (``checkpoint_kv_cache``): a lookup hits 12 while B runs, and B's SWA pages 0-3
    (tokens 0-7, below its lock's window) read null. At ``p = 15`` B's window [12, 15]
    has passed the 12 published tokens: the SWA part of its lock is released, once: the
    tree's locked SWA tokens (only B locks anything) all become evictable, and B's pages
    0-5 read null."""
    engine = make_engine(hybrid(2))
    a_prompt = tuple(range(100, 112))
    b_prompt = tuple(range(200, 212))
    prefill(engine, "A", a_prompt)
    prefill(engine, "B", b_prompt)
    engine.add_request(RequestInput("C", a_prompt + (1,)))
    assert engine.get_computed_blocks("C").num_tokens == 0
    engine.add_request(RequestInput("D", b_prompt + (1,)))
    assert engine.get_computed_blocks("D").num_tokens == 12
    # A: full 1-6, SWA 1-6; B: full 7-12, SWA 7-12
    assert engine.get_block_ids("B") == ((7, 8, 9, 10, 11, 12), (0, 0, 0, 0, 11, 12))
    for p in (12, 13, 14):
        assert engine.allocate_slots("B", 1) is not None
        engine.set_num_computed_tokens("B", p + 1)
    locked, evictable = engine.cache.swa_protected_size(), engine.cache.swa_evictable_size()
    assert locked > 0
    assert engine.allocate_slots("B", 1) is not None  # p = 15: released
    assert engine.cache.swa_protected_size() == 0
    assert engine.cache.swa_evictable_size() == evictable + locked
    assert engine.get_block_ids("B")[1][:6] == (0, 0, 0, 0, 0, 0)
    engine.set_num_computed_tokens("B", 16)
    assert engine.allocate_slots("B", 1) is not None  # released once: nothing changes
    assert engine.cache.swa_protected_size() == 0
    assert engine.cache.swa_evictable_size() == evictable + locked
    engine.free("B")


def _check_mutant(name: str, only: str = "invariants") -> str:
    """``kvconform check --only ONLY`` against mutant ``name`` (100 examples, the small
    tier, in process; the run stops at the first failure): its output. The example each
    is caught at is printed by the run (the stream depends on the bound: with the SWA
    pool smaller in some layouts, 20 or 40 examples miss the first two). Load-backs
    happen in the serving modes with external hits: the ``production`` property."""
    import os
    import subprocess
    import sys

    command = [
        sys.executable, "-W", "ignore", "-m", "properties.tools.cli", "check",
        "--engine", f"tests.properties.engines.sglang_mutants:make_{name}",
        "--isolation", "none", "--level", "universal", "--profile", "ci",
        "--only", only, "--max-examples", "100", "--tiers", "none",
        "--workers", "1", "--shrink-seconds", "5",
    ]  # fmt: skip
    # torch's own thread count: the forked run worker settles it (properties.core.forked)
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    done = subprocess.run(command, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0, done.stdout[-2000:]
    return done.stdout


def test_the_gate_catches_the_decode_mapping_mutant():
    """A page shared by two requests' SWA rows is written by both: exclusive_write; or,
    first, loaded into while the other holds it (X2, external_load_exclusive: the reach
    case ``sglang-staged-storage-prefetch`` loads a prefix back beside a decoding
    request)."""
    out = _check_mutant("decode_mapping")
    assert any(
        f"first failure [{c}]" in out for c in ("exclusive_write", "external_load_exclusive")
    )


def test_the_gate_catches_the_swa_released_twice_mutant():
    """The second release drops the SWA lock count of the prefix below zero: SGLang's
    own lock-count assertion fails, an engine error."""
    assert "first failure [EngineError]" in _check_mutant("swa_release_twice")


def test_the_gate_catches_the_swa_leaf_kept_mutant():
    """The SWA walk keeps the leaf it should hand over: an allocation the SWA pool's free
    and evictable pages cover fails (S3)."""
    assert "first failure [allocation_fits_per_pool]" in _check_mutant("swa_leaf_kept")


# ---------------------------------------------- SGLang's scheduler calls (issue 19, tree)
@pytest.mark.parametrize(
    ("pool_pages", "ratio", "page", "max_len", "expected"),
    [
        (32, 0.5, 2, 20, 16),  # int(64 * 0.5) // 2 = 16 >= cdiv(20, 2) + 1 = 11
        (19, 0.5, 2, 16, 9),  # int(38 * 0.5) // 2 = 9 = cdiv(16, 2) + 1
        (16, 0.8, 2, 12, 12),  # int(32 * 0.8) = 25 // 2 = 12
        (12, 0.5, 1, 10, 11),  # 6 pages < one 10-token request: raised to 11
        (10, 0.5, 4, 40, 10),  # raised to cdiv(40, 4) + 1 = 11, capped at the full pool
    ],
)
def test_swa_pool_pages(pool_pages, ratio, page, max_len, expected):
    from properties.engines.sglang import swa_pool_pages

    assert swa_pool_pages(pool_pages, ratio, page, max_len) == expected


def test_swa_full_tokens_ratio_follows_num_blocks():
    from properties.engines.sglang import swa_full_tokens_ratio

    assert [swa_full_tokens_ratio(hybrid(2, pool_pages=n - 1)) for n in (33, 34, 35)] == [
        1.0,
        0.8,
        0.5,
    ]


def _short_swa_pool(pool_pages: int) -> KVCacheLayout:
    """bs 2, window 4 (SGLang's 3), max_model_len 16; ``pool_pages`` full pages."""
    return KVCacheLayout(
        groups=(
            KVCacheGroup(("full",), FullAttentionSpec(block_size=2)),
            KVCacheGroup(("swa",), SlidingWindowSpec(block_size=2, sliding_window=4)),
        ),
        num_blocks=pool_pages + 1,
        max_model_len=16,
    )


@pytest.mark.parametrize("mutant", [False, True], ids=["sglang", "swa_leaf_kept"])
def test_a_short_swa_pool_evicts_an_unlocked_leaf_whole(monkeypatch, mutant):
    """num_blocks 20 -> ratio 0.5: 19 full pages, ``int(38 * 0.5) // 2 = 9`` SWA pages.
    A caches 4 tokens (2 pages, one leaf of the tree). B's 16 tokens need 8 pages in each
    pool: the full pool has 17 free, the SWA pool 7 free and A's 2 evictable. Only the SWA
    pool is short, so only SGLang's SWA walk runs: A's leaf is its least recent unlocked
    node and goes whole (its full pages too): a later lookup of A's prompt misses, and
    the full pool holds B's 8 pages only (19 - 8 = 11 free). With num_blocks 21 (ratio
    1.0: 20 pages in both pools) nothing is short and A's prefix stays cached (hit 4). The
    ``swa_leaf_kept`` mutant's walk stops at A's leaf: B's allocation fails although the
    SWA pool reported 9 free pages for its 8 (S3)."""
    if mutant:
        _mutant_patched(monkeypatch, "swa_leaf_kept")
    a = tuple(range(100, 104))
    for pool_pages, short in ((19, True), (20, False)):
        engine = make_engine(_short_swa_pool(pool_pages))
        usage = [(p.name, p.num_blocks, p.num_free) for p in engine.pool_usage()]
        assert usage == [
            ("full", pool_pages, pool_pages),
            ("swa", 9 if short else 20, 9 if short else 20),
        ]
        prefill(engine, "A", a)
        engine.free("A")
        # B's step begins: a host tier acknowledges A's write-through backup here and
        # unlocks A's pages (the layout of 20 pages is deployed with one)
        engine.new_step()
        engine.add_request(RequestInput("B", tuple(range(200, 216))))
        assert engine.get_computed_blocks("B").num_tokens == 0
        new = engine.allocate_slots("B", 16)
        if mutant and short:
            assert new is None
            continue
        assert new is not None
        engine.add_request(RequestInput("A2", a + (1,)))
        assert engine.get_computed_blocks("A2").num_tokens == (0 if short else 4)
        assert engine.pool_usage()[0].num_free == (11 if short else 12)


def test_every_request_is_matched_and_locked_at_its_node():
    """SGLang's scheduler matches every request and locks the node the match ended on
    (the root for a miss): a one-token prompt is matched (key limit 0: no hit) and its
    lock sits on the root; a hit's lock sits on the matched node; with prefix caching off
    (``disable``) the lookup of a cached prompt misses, and freeing gives every page back."""
    engine = make_engine(hybrid(2))
    root = engine.cache.tree_core.empty_match_result.last_device_node
    prefill(engine, "A", PREFIX)
    engine.free("A")
    engine.add_request(RequestInput("one", (100,)))
    assert engine.get_computed_blocks("one").num_tokens == 0
    assert engine.allocate_slots("one", 1) is not None
    assert engine._requests["one"].req.lock.node == root
    hit, _ = prefill(engine, "B", PREFIX + (7,))
    assert hit.num_tokens == 12
    assert engine._requests["B"].req.lock.node != root
    engine.free("one")
    engine.free("B")
    assert engine._requests["one"].req.lock is None
    off = make_engine(dataclasses.replace(hybrid(2), enable_caching=False))
    prefill(off, "A", PREFIX)
    off.free("A")
    hit, _ = prefill(off, "C", PREFIX + (7,))
    assert hit.num_tokens == 0
    assert (
        off._requests["C"].req.lock.node == off.cache.tree_core.empty_match_result.last_device_node
    )
    off.free("C")
    assert [p.num_free for p in off.pool_usage()] == [32, 32]


def test_a_chunk_checkpoint_frees_out_of_window_swa_only_up_to_the_chunk():
    """bs 2, window 4 (SGLang's 3). X (30 tokens) runs and goes: its row, with its 30
    slots still written in it, is the next request's. A (8 tokens, a publishing request)
    decodes 8 more and goes: the tree holds its 16 tokens, with SWA KV gone below A's
    window. B shares A's first 10 tokens: the full KV matches 10, the SWA window only 8,
    so SGLang records a branch at 10. B computes a first chunk of 12 tokens and publishes
    it: the insert ends at the branch, and SGLang then frees B's out-of-window SWA slots up
    to the end of B's fill ids, which must be the chunk's end (``extend_end``, as
    SGLang's scheduler sets it), not the whole 30-token prompt: else it frees X's stale
    row entries past the chunk, and the SWA pool counts more free pages than it has."""
    engine = make_engine(hybrid(2, pool_pages=32))
    prefill(engine, "X", tuple(range(500, 530)))
    engine.free("X")
    a = tuple(range(100, 108))
    prefill(engine, "A", a)
    for t in range(8):
        engine.append_output_tokens("A", [300 + t])
        assert engine.allocate_slots("A", 1) is not None
        engine.set_num_computed_tokens("A", 9 + t)
    engine.free("A")
    engine.add_request(RequestInput("D", (1, 2, 3)))  # B is a publishing request
    engine.add_request(RequestInput("B", a + (300, 301) + tuple(range(700, 718))))
    hit = engine.get_computed_blocks("B")
    assert hit.num_tokens == 8
    assert engine._requests["B"].pending.swa_branching_seqlen == 10
    assert engine.allocate_slots("B", 4, 8, hit) is not None
    engine.set_num_computed_tokens("B", 12)
    req = engine._requests["B"].req
    swa = engine._m["ComponentType"].SWA
    assert req.kv.get_evicted_seqlen(swa) <= 12
    full, swa_pool = engine.pool_usage()
    assert swa_pool.num_free <= swa_pool.num_blocks == 32


@pytest.mark.parametrize("publishing", [False, True], ids=["first", "second"])
def test_a_request_freed_mid_prefill_is_released_without_an_insert(publishing):
    """bs 2, 32 pages per pool. A's 20-token prompt is freed after a first chunk of 8, as
    SGLang releases the chunked request it aborts (``checkpoint=False``): nothing of A is
    inserted at ``free``, so a lookup of the same prompt misses and both pools are whole
    again (32 free pages each, nothing cached). A publishing request (the second added)
    already put its 8 computed tokens in the tree after the chunk: those stay cached (hit
    8, 4 pages evictable: 32 free still). A request freed after its whole prompt inserts
    it: a lookup of the same 20 tokens hits 18 (its limit 19, floored to whole pages)."""
    engine = make_engine(hybrid(2))
    if publishing:
        engine.add_request(RequestInput("pad", (1,)))
    prompt = tuple(range(100, 120))
    engine.add_request(RequestInput("A", prompt))
    assert engine.get_computed_blocks("A").num_tokens == 0
    assert engine.allocate_slots("A", 8) is not None
    engine.set_num_computed_tokens("A", 8)
    engine.free("A")
    engine.add_request(RequestInput("B", prompt))
    assert engine.get_computed_blocks("B").num_tokens == (8 if publishing else 0)
    assert [p.num_free for p in engine.pool_usage()] == [32, 32]
    assert engine.cache.full_evictable_size() == (8 if publishing else 0)
    assert engine.allocate_slots("B", 20) is not None
    engine.set_num_computed_tokens("B", 20)
    engine.free("B")
    engine.add_request(RequestInput("C", prompt))
    assert engine.get_computed_blocks("C").num_tokens == 18


def test_the_gate_catches_the_extend_page_slack_mutant():
    """An extend that exactly fits the pages left is refused: allocation_fits_per_pool
    (the refusal branch of ``alloc_extend`` is reached since SGLang's allocator answers)."""
    assert "first failure [allocation_fits_per_pool]" in _check_mutant("extend_page_slack")


def test_the_gate_catches_the_load_back_order_mutant():
    """Host pages of a multi-node load-back land on the wrong nodes: a request served
    from the host tier reads another part of its prefix (X3)."""
    assert "first failure [host_hit_content]" in _check_mutant("load_back_order", "production")


def test_the_gate_catches_the_host_pages_leaked_mutant():
    """Host eviction drops the host pages of the leaves it evicts: the host pool's free
    and held pages no longer add up (X4)."""
    assert "first failure [host_pool_accounting]" in _check_mutant("host_pages_leaked")


def test_the_gate_catches_the_backup_unlocked_mutant():
    """A queued write-through backup's node is left unlocked: its pages count as
    reclaimable while the backup still reads them (X5)."""
    assert "first failure [backed_up_blocks_not_free]" in _check_mutant("backup_unlocked")


def test_the_gate_catches_the_write_back_dropped_mutant():
    """A write-back backup that succeeded is treated as failed and its subtree dropped:
    SGLang's own assertion on the dropped subtree fails, an engine error."""
    assert "first failure [EngineError]" in _check_mutant("write_back_dropped")


def test_the_gate_catches_the_session_leaf_kept_mutant():
    """A session leaf deleted by eviction stays indexed: closing the session (its last
    request leaves) trips SGLang's own assertion on the stale index, an engine error."""
    assert "first failure [EngineError]" in _check_mutant("session_leaf_kept", "production")
