"""Hand-written scenarios for the SGLang adapter (page sizes 1, 2, 4; both tree cores).

Expected ids follow from SGLang's allocators on a fresh pool: pages are handed out in
ascending order from 1 (page 0 is the padding page), in both the full and the SWA pool.
Run with ``.engines/sglang/bin/python -W ignore -m pytest
tests/properties/engines/test_sglang_adapter.py``.
"""

from __future__ import annotations

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
    before = sizes(engine)
    # 9 pages of new tokens: 4 are free (+1 evictable leaf page at bs 1)
    assert engine.allocate_slots("B", 9 * page, 12, hit) is None
    assert sizes(engine) == before  # hit unlocked, nothing taken
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
