"""Hand-written scenarios for the vLLM 0.33.0 adapter (``properties/engines/vllm.py``).

Run with ``.engines/vllm/bin/python -m pytest tests/properties/engines/test_vllm_adapter.py``;
``conftest.py`` skips the module when vLLM is not installed or importable. Every
expected value below is derived by hand from the rules in ``docs/vllm-behaviour.md``.
"""

from __future__ import annotations

import pytest

from properties.core.engine import (
    CacheHit,
    EngineError,
    ExposesCachedBlocks,
    ExposesFreeQueue,
    ExposesRefCounts,
    KVCacheEngine,
    RequestInput,
)
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

pytestmark = pytest.mark.engine


def make(groups: tuple, num_blocks: int, max_model_len: int = 256):
    from properties.engines.vllm import make_engine

    layout = KVCacheLayout(
        groups=tuple(KVCacheGroup((f"l{i}",), spec) for i, spec in enumerate(groups)),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
    )
    return make_engine(layout)


def full_swa(num_blocks: int = 20):
    """Full attention + SWA(w=4), both bs 2 (hash 2, scheduler block 2)."""
    return make(
        (FullAttentionSpec(block_size=2), SlidingWindowSpec(block_size=2, sliding_window=4)),
        num_blocks,
    )


def run_prompt(engine, request_id: str, tokens: tuple[int, ...], chunk: int | None = None):
    """Add a request and compute its whole prompt (optionally in chunks); return rows."""
    engine.add_request(RequestInput(request_id, tokens))
    hit = engine.get_computed_blocks(request_id)
    done = hit.num_tokens
    first = True
    while done < len(tokens):
        n = min(chunk or len(tokens), len(tokens) - done)
        if first:
            assert engine.allocate_slots(request_id, n, hit.num_tokens, hit) is not None
            first = False
        else:
            assert engine.allocate_slots(request_id, n) is not None
        done += n
        engine.set_num_computed_tokens(request_id, done)
    return engine.get_block_ids(request_id)


def test_capabilities_and_13_token_prompt_rows_then_window_frees():
    engine = full_swa()
    assert isinstance(engine, KVCacheEngine)
    assert isinstance(engine, ExposesRefCounts)
    assert isinstance(engine, ExposesFreeQueue)
    assert isinstance(engine, ExposesCachedBlocks)
    engine.add_request(RequestInput("a", tuple(range(13))))
    hit = engine.get_computed_blocks("a")
    assert hit == CacheHit(((), ()), 0)
    # cdiv(13, 2) = 7 blocks per group, popped in order from the queue 1..19.
    new = engine.allocate_slots("a", 13, 0, hit)
    assert new == ((1, 2, 3, 4, 5, 6, 7), (8, 9, 10, 11, 12, 13, 14))
    assert engine.num_free_blocks() == 19 - 14
    engine.set_num_computed_tokens("a", 13)
    engine.append_output_tokens("a", [99])
    # Decode at 13: skipped = 13 - 4 + 1 = 10 tokens -> SWA columns 0..4 become null.
    assert engine.allocate_slots("a", 1) == ((), ())
    assert engine.get_block_ids("a") == (
        (1, 2, 3, 4, 5, 6, 7),
        (0, 0, 0, 0, 0, 13, 14),
    )
    assert engine.num_free_blocks() == 5 + 5
    assert engine.ref_counts()[8] == 0 and engine.ref_counts()[13] == 1


def test_shared_10_token_prefix_hits_10_with_swa_nulls():
    engine = full_swa()
    run_prompt(engine, "a", tuple(range(13)))
    engine.add_request(RequestInput("b", tuple(range(10)) + (50, 51, 52)))
    hit = engine.get_computed_blocks("b")
    # Full: blocks 0..4 match (10 tokens). SWA w 4 needs cdiv(3, 2) = 2 blocks ending
    # at 10: columns 3, 4 (ids 11, 12); columns 0..2 are null.
    assert hit == CacheHit(((1, 2, 3, 4, 5), (0, 0, 0, 11, 12)), 10)
    # 13 tokens -> 7 columns: 2 new blocks per group from the queue front 15..19.
    assert engine.allocate_slots("b", 3, 10, hit) == ((15, 16), (17, 18))
    assert engine.get_block_ids("b") == ((1, 2, 3, 4, 5, 15, 16), (0, 0, 0, 11, 12, 17, 18))
    assert engine.ref_counts()[1] == 2 and engine.ref_counts()[11] == 2
    assert engine.num_free_blocks() == 1


def test_free_order_tail_first_unhashed_front_hashed_back():
    engine = full_swa()
    run_prompt(engine, "a", tuple(range(13)))
    engine.free("a")
    # Group 0 freed first: 7 (partial, unhashed) to the front, 6..1 (hashed) to the
    # back; then group 1: 14 to the front, 13..8 to the back.
    assert engine.free_queue() == [
        14,
        7,
        15,
        16,
        17,
        18,
        19,
        6,
        5,
        4,
        3,
        2,
        1,
        13,
        12,
        11,
        10,
        9,
        8,
    ]
    assert engine.num_free_blocks() == 19
    cached = {(c.block_id, c.group_id, c.num_tokens) for c in engine.cached_blocks()}
    assert cached == {(b, 0, 2 * b) for b in range(1, 7)} | {
        (b, 1, 2 * (b - 7)) for b in range(8, 14)
    }
    assert engine.reset_prefix_cache() is True
    assert engine.cached_blocks() == []


def test_cache_salt_and_lora_name_reach_the_hash():
    engine = make((FullAttentionSpec(block_size=2),), 40)
    prompt = tuple(range(8))
    for rid, salt, lora in (("a", "s1", None), ("b", None, "L1")):
        engine.add_request(RequestInput(rid, prompt, cache_salt=salt, lora_name=lora))
        hit = engine.get_computed_blocks(rid)
        engine.allocate_slots(rid, 8, 0, hit)
        engine.set_num_computed_tokens(rid, 8)
    cases = {
        "plain": (None, None, 0),
        "same_salt": ("s1", None, 6),  # max hit = 7 tokens -> 3 full blocks
        "other_salt": ("s2", None, 0),
        "same_lora": (None, "L1", 6),
        "other_lora": (None, "L2", 0),
    }
    for rid, (salt, lora, expected) in cases.items():
        engine.add_request(RequestInput(rid, prompt, cache_salt=salt, lora_name=lora))
        assert engine.get_computed_blocks(rid).num_tokens == expected, rid


def test_foreign_hit_and_vllm_errors_become_engine_errors_and_pool_full_is_none():
    engine = make((FullAttentionSpec(block_size=2),), 5)
    engine.add_request(RequestInput("a", tuple(range(10))))
    with pytest.raises(EngineError, match="did not return"):
        engine.allocate_slots("a", 10, 0, CacheHit(((),), 0))
    with pytest.raises(EngineError, match=r"vllm: allocate_slots\('a', 0, 0, 0\) raised"):
        engine.allocate_slots("a", 0)
    with pytest.raises(EngineError, match="unknown request"):
        engine.get_computed_blocks("zz")
    # 10 tokens need 5 blocks; only 4 are free -> None, nothing changes.
    hit = engine.get_computed_blocks("a")
    assert engine.allocate_slots("a", 10, 0, hit) is None
    assert engine.num_free_blocks() == 4
    assert engine.get_block_ids("a") == ((),)


def test_mamba_align_rows_per_chunk_and_same_step_refusal():
    engine = make((FullAttentionSpec(block_size=4), MambaSpec(block_size=4)), 40)
    engine.add_request(RequestInput("a", tuple(range(20))))
    hit = engine.get_computed_blocks("a")
    engine.new_step()
    # [0, 8): Mamba needs column cdiv(8, 4) - 1 = 1 only; the null padding is not new.
    assert engine.allocate_slots("a", 8, 0, hit) == ((1, 2), (3,))
    engine.set_num_computed_tokens("a", 8)
    engine.new_step()
    assert engine.allocate_slots("a", 8) == ((4, 5), (6,))
    assert engine.get_block_ids("a")[1] == (0, 3, 0, 6)
    engine.set_num_computed_tokens("a", 16)
    engine.new_step()
    # The state read two allocations ago (column 1, id 3) is freed first.
    assert engine.allocate_slots("a", 4) == ((7,), (8,))
    assert engine.get_block_ids("a")[1] == (0, 0, 0, 6, 8)
    engine.set_num_computed_tokens("a", 20)
    # A request hitting a Mamba state registered in this same step is refused.
    engine.add_request(RequestInput("b", tuple(range(8)) + (7, 7)))
    hit_b = engine.get_computed_blocks("b")
    assert hit_b == CacheHit(((1, 2), (0, 3)), 8)
    free_before = engine.num_free_blocks()
    engine.add_request(RequestInput("c", tuple(range(16)) + (5,)))
    hit_c = engine.get_computed_blocks("c")
    assert hit_c.num_tokens == 16
    assert engine.allocate_slots("c", 1, 16, hit_c) is not None  # 6 cached last step
    engine.add_request(RequestInput("d", tuple(range(20)) + (5, 5)))
    hit_d = engine.get_computed_blocks("d")
    assert hit_d == CacheHit(((1, 2, 4, 5, 7), (0, 0, 0, 0, 8)), 20)
    assert engine.allocate_slots("d", 2, 20, hit_d) is None  # 8 cached this step
    engine.new_step()
    hit_d = engine.get_computed_blocks("d")
    assert engine.allocate_slots("d", 2, 20, hit_d) is not None
    assert free_before > engine.num_free_blocks()


def test_chunked_local_hits_whole_chunks_without_lookup():
    engine = make((ChunkedLocalAttentionSpec(block_size=2, attention_chunk_size=4),), 20)
    engine.add_request(RequestInput("a", tuple(range(9))))
    # max hit 8 = two whole chunks before the query: nulls, nothing looked up.
    hit = engine.get_computed_blocks("a")
    assert hit == CacheHit(((0, 0, 0, 0),), 8)
    assert engine.allocate_slots("a", 1, 8, hit) == ((1,),)
    assert engine.num_free_blocks() == 18


def _cache_two_blocks_of_a(engine) -> None:
    """Full attention bs 2: "a" (5 tokens) computes 2 tokens (block 1 cached), then 2 more
    (block 2 cached), a step after each."""
    engine.add_request(RequestInput("a", (1, 2, 3, 4, 5)))
    hit = engine.get_computed_blocks("a")
    assert engine.allocate_slots("a", 2, 0, hit) == ((1,),)
    engine.set_num_computed_tokens("a", 2)
    engine.new_step()
    assert engine.allocate_slots("a", 2) == ((2,),)
    engine.set_num_computed_tokens("a", 4)
    engine.new_step()


def test_kv_events_are_checked_against_the_pool_and_catch_two_event_mutants(monkeypatch):
    """The adapter drains vLLM's KV events at every step and checks them against the pool
    (every cached hash announced by a BlockStored, every BlockRemoved names an announced
    hash). Scenario, full attention bs 2, 4 blocks (3 usable): "a" computes 2 tokens (1
    block cached), then 2 more (a second block cached while one is cached already); then
    "a" is freed and "b" (other tokens) takes 3 blocks, evicting both cached ones.
    Unmutated: no error. ``event_offset`` announces the first block's hash again for the
    second block, so the pool caches an unannounced hash at the step after;
    ``removed_with_group`` removes a hash with the group id glued on, never announced."""
    from tests.properties.engines.vllm_event_mutants import mutated

    def scenario() -> None:
        engine = make((FullAttentionSpec(block_size=2),), 4)
        _cache_two_blocks_of_a(engine)
        engine.free("a")
        engine.remove_request("a")
        engine.add_request(RequestInput("b", (7, 8, 9, 10, 11, 12)))
        hit = engine.get_computed_blocks("b")
        assert hit.num_tokens == 0
        assert engine.allocate_slots("b", 6, 0, hit) == ((3, 2, 1),)
        engine.new_step()

    scenario()
    for name, message in (
        ("event_offset", "that no BlockStored event announced"),
        ("removed_with_group", "removes a hash never stored"),
    ):
        owner, method, function = mutated(name)
        with monkeypatch.context() as patch:
            patch.setattr(owner, method, function)
            with pytest.raises(EngineError, match=message):
                scenario()


def test_disable_self_checks_stops_the_event_audit_the_bench_would_time(monkeypatch):
    """The bench builds engines through ``engine_alone``, which calls the adapter's
    ``disable_self_checks``: the per-step audit of the pool against the KV events is the
    adapter's cost, not vLLM's. Scenario: ``event_offset`` makes vLLM announce a wrong
    hash; with the audit on, the step after the second block is cached raises; with it
    off (events still on) the same steps run to the end with the same tables."""
    from tests.properties.engines.vllm_event_mutants import mutated

    owner, method, function = mutated("event_offset")
    with monkeypatch.context() as patch:
        patch.setattr(owner, method, function)
        with pytest.raises(EngineError, match="that no BlockStored event announced"):
            _cache_two_blocks_of_a(make((FullAttentionSpec(block_size=2),), 4))
        quiet = make((FullAttentionSpec(block_size=2),), 4)
        quiet.disable_self_checks()
        assert quiet.manager.enable_kv_cache_events  # the audit is off, not the events
        _cache_two_blocks_of_a(quiet)


@pytest.mark.parametrize("num_blocks", [4, 7])  # built with stats and events on, both off
def test_the_bench_times_vllm_as_vllm_serve_builds_it(num_blocks):
    """``engine_alone`` (the bench) rebuilds vLLM's manager as deployed
    (``BuildsAsDeployed``): stats on, KV cache events off, whichever the adapter chose for
    the layout. It then runs as before (the same tables), emits no event, keeps stats;
    asked once a request was added, the adapter refuses."""
    from properties.core.engine import BuildsAsDeployed
    from properties.tools.bench.engines import engine_alone

    engine = engine_alone(make((FullAttentionSpec(block_size=2),), num_blocks))
    assert isinstance(engine, BuildsAsDeployed)
    assert (engine.manager.log_stats, engine.manager.enable_kv_cache_events) == (True, False)
    assert run_prompt(engine, "a", (1, 2, 3, 4, 5)) == ((1, 2, 3),)
    engine.new_step()
    assert engine.manager.take_events() == []
    assert engine.manager.make_prefix_cache_stats() is not None
    with pytest.raises(EngineError, match=r"build_as_deployed\(\) after requests were added"):
        engine.build_as_deployed()
    engine.free("a")
    engine.remove_request("a")
    with pytest.raises(EngineError, match="after requests were added"):  # even when none left
        engine.build_as_deployed()


def test_one_layout_in_four_runs_with_stats_and_events_off():
    """``observes_stats_and_events``: off where ``crc32(describe()) % 4 == 0``. Full bs 2
    with 7 blocks hashes to 0 mod 4 (zlib below), with 4 blocks not. With both off, a
    computed and cached prompt emits no event, the stats are None and the steps and
    reset run without error."""
    import zlib

    from properties.engines.vllm import observes_stats_and_events

    off = make((FullAttentionSpec(block_size=2),), 7)
    on = make((FullAttentionSpec(block_size=2),), 4)
    assert zlib.crc32(off.layout.describe().encode()) % 4 == 0
    assert zlib.crc32(on.layout.describe().encode()) % 4 != 0
    assert not observes_stats_and_events(off.layout) and observes_stats_and_events(on.layout)
    assert (off.manager.log_stats, off.manager.enable_kv_cache_events) == (False, False)
    assert (on.manager.log_stats, on.manager.enable_kv_cache_events) == (True, True)
    assert run_prompt(off, "a", (1, 2, 3, 4, 5)) == ((1, 2, 3),)
    off.new_step()
    assert off.manager.take_events() == []
    assert off.manager.make_prefix_cache_stats() is None
    off.free("a")
    assert off.reset_prefix_cache() is True
    off.new_step()


def test_prefix_cache_stats_and_usage_are_checked_each_step(monkeypatch):
    """Each admission with a lookup is recorded (``record_prefix_cache_stats``) and the
    step's stats must match: "a" (13 tokens, no hit) and "b" (13 tokens, 10 hit) give
    requests 2, queries 26, hits 10; ``usage`` is 1 - free / 19. Mutants: stats that
    drop the hits, and a usage that counts the null block, are each caught at new_step."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.metrics.stats import PrefixCacheStats

    def scenario() -> float:
        engine = full_swa()
        run_prompt(engine, "a", tuple(range(13)))
        engine.add_request(RequestInput("b", tuple(range(10)) + (50, 51, 52)))
        hit = engine.get_computed_blocks("b")
        assert hit.num_tokens == 10
        engine.allocate_slots("b", 3, 10, hit)
        assert engine._admissions == [(13, 0, False), (13, 10, False)]
        usage = engine.manager.usage
        engine.new_step()
        assert engine.reset_prefix_cache() is False  # blocks in use
        engine.new_step()
        return usage

    # 14 + 4 blocks taken of 19 usable: usage 18/19
    assert abs(scenario() - 18 / 19) < 1e-12
    record = PrefixCacheStats.record

    def no_hits(self, num_tokens, num_hits, preempted, hits_by_source=None):
        record(self, num_tokens, 0, preempted, hits_by_source)

    with monkeypatch.context() as patch:
        patch.setattr(PrefixCacheStats, "record", no_hits)
        with pytest.raises(EngineError, match=r"stats .* = \(2, 26, 0, False\).* \(2, 26, 10"):
            scenario()
    with monkeypatch.context() as patch:
        patch.setattr(BlockPool, "get_usage", lambda self: 1 - self.get_num_free_blocks() / 20)
        with pytest.raises(EngineError, match="usage"):
            scenario()


def test_free_queue_is_walked_twice_and_a_cursor_mutant_is_caught(monkeypatch):
    """``free_queue`` compares ``get_all_free_blocks`` with vLLM's cursor walk
    ``iter_blocks_after`` from the head and from after the first block. 4 blocks, "a"
    takes 1: the queue is [2, 3], after the first [3]. A mutant that starts the walk at
    the cursor (not after it) is caught."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    engine = make((FullAttentionSpec(block_size=2),), 4)
    engine.add_request(RequestInput("a", (1, 2)))
    assert engine.allocate_slots("a", 2, 0, engine.get_computed_blocks("a")) == ((1,),)
    assert engine.free_queue() == [2, 3]
    walk = FreeKVCacheBlockQueue.iter_blocks_after

    def from_cursor(self, cursor):
        if cursor is not None:
            yield cursor
        yield from walk(self, cursor)

    monkeypatch.setattr(FreeKVCacheBlockQueue, "iter_blocks_after", from_cursor)
    with pytest.raises(EngineError, match=r"after the first \[2, 3\]"):
        engine.free_queue()


# -- hit rules at their edges (issue 19: branches the ci profile did not reach) ---------


def test_chunked_lookup_stops_at_the_first_uncached_block_of_its_chunk():
    """Chunked local bs 4, chunk 8, a fresh 16-token prompt: the lookup bound 15 puts
    the chunk start at 8 (block 2) and the search covers blocks [2, 15 // 4 = 3); block 2
    is not cached, so the search stops there and the hit is the two null blocks before
    the chunk (8 tokens). The step then needs cdiv(16, 4) = 4 columns: 2 new blocks."""
    engine = make((ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8),), 40)
    engine.add_request(RequestInput("a", tuple(range(16))))
    hit = engine.get_computed_blocks("a")
    assert hit == CacheHit(((0, 0),), 8)
    assert engine.allocate_slots("a", 8, 8, hit) == ((1, 2),)
    assert engine.get_block_ids("a") == ((0, 0, 1, 2),)


def _eagle_fine_window():
    """Full attention bs 4 + a sliding window of bs 2 and w 11 (alignment 4, EAGLE)."""
    from properties.engines.vllm import make_engine

    groups = (FullAttentionSpec(block_size=4), SlidingWindowSpec(block_size=2, sliding_window=11))
    layout = KVCacheLayout(
        groups=tuple(KVCacheGroup((f"l{i}",), spec) for i, spec in enumerate(groups)),
        num_blocks=40,
        max_model_len=64,
        use_eagle=True,
    )
    return make_engine(layout)


def _eagle_short_hit(engine) -> CacheHit:
    """ "a" (24 tokens) computed and freed; "b" shares its first 14 tokens. Full
    attention matches 3 blocks (12 tokens), EAGLE drops one: 8. The window then searches
    up to 8 + 2 (EAGLE's margin) = 10 tokens: blocks 0..4 are cached (w 11 needs
    cdiv(10, 2) + 1 = 6 blocks, more than the 2 of an alignment, so every block is), the
    run from block 4 down to 0 is 5 < 6 blocks: no full match, the run from block 0
    counts. 5 blocks = 10 tokens align down to 8 (4 blocks); the EAGLE drop leaves 3
    blocks (6 tokens), which re-align down to 4: the hit is 4 tokens (full block 1,
    window blocks 7 and 8: "a"'s first ones, full group first in the queue)."""
    run_prompt(engine, "a", tuple(range(24)))
    engine.free("a")
    engine.add_request(RequestInput("b", tuple(range(14)) + tuple(range(100, 110))))
    return engine.get_computed_blocks("b")


def test_eagle_drop_re_aligns_a_fine_window_hit():
    engine = _eagle_fine_window()
    hit = _eagle_short_hit(engine)
    assert hit == CacheHit(((1,), (7, 8)), 4)
    # 24 tokens: 6 full columns (5 new) and 12 window columns (10 new), from the queue
    # front 19.. (the freed blocks of "a" went to its back)
    assert engine.allocate_slots("b", 20, 4, hit) == (
        (19, 20, 21, 22, 23),
        tuple(range(24, 34)),
    )


def test_a_mutant_without_the_eagle_re_alignment_is_caught(monkeypatch):
    """vLLM without the re-alignment after the EAGLE drop (a branch the ci profile did
    not reach before issue 19) returns the 6-token window hit, off the alignment 4."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    from tests.properties.engines.line_mutants import mutated_method

    # the method's source is dedented once: the loop's ``while`` stands at 8 spaces
    old = "# different page sizes, e.g. Gemma4).\n        while ("
    new = "# different page sizes, e.g. Gemma4).\n        while False and ("
    mutant = mutated_method(
        SlidingWindowManager, "find_longest_cache_hit", old, new, "no_eagle_realign"
    )
    monkeypatch.setattr(SlidingWindowManager, "find_longest_cache_hit", classmethod(mutant))
    hit = _eagle_short_hit(_eagle_fine_window())
    assert hit.num_tokens == 6 and hit.num_tokens % 4 != 0


def test_mamba_retention_interval_of_one_block_keeps_every_state():
    """Full attention + Mamba, both bs 4, a 17-token prompt computed 4 tokens a step.
    Interval 4 (one block): every state block ends a segment, so the states at 4, 8, 12
    and 16 (ids 2, 4, 6, 8) all stay cached. Interval 8: the state at 4 (id 2) ends no
    segment and is no replay boundary, so it is not cached and its block, freed when
    the state moves on at 12, goes to the queue front and is the next full block."""
    from properties.engines.vllm import make_engine

    rows = {}
    for interval in (4, 8):
        groups = (FullAttentionSpec(block_size=4), MambaSpec(block_size=4))
        layout = KVCacheLayout(
            groups=tuple(KVCacheGroup((f"l{i}",), spec) for i, spec in enumerate(groups)),
            num_blocks=40,
            max_model_len=64,
            prefix_cache_retention_interval=interval,
        )
        engine = make_engine(layout)
        engine.add_request(RequestInput("a", tuple(range(17))))
        hit = engine.get_computed_blocks("a")
        for done in range(0, 16, 4):
            engine.new_step()
            new = engine.allocate_slots("a", 4, 0, hit) if done == 0 else None
            if done:
                new = engine.allocate_slots("a", 4)
            assert new is not None
            engine.set_num_computed_tokens("a", done + 4)
        mamba = sorted((c.num_tokens, c.block_id) for c in engine.cached_blocks() if c.group_id)
        rows[interval] = (engine.get_block_ids("a"), mamba)
    assert rows[4] == (((1, 3, 5, 7), (0, 0, 6, 8)), [(4, 2), (8, 4), (12, 6), (16, 8)])
    assert rows[8] == (((1, 3, 2, 6), (0, 0, 5, 7)), [(8, 4), (16, 7)])


def test_lookahead_hashes_end_the_full_group_view_before_the_lookup_bound():
    """Full attention bs 4 + a window bs 2 (w 4): hashes per 2 tokens, the full group
    reads them through a 4-token view. EAGLE with 2 lookahead hashes: a hash block is
    hashed once 2 tokens follow it (and nothing is dropped). "a" (16 tokens) is cached;
    "b" (its first 9 tokens) has hashes for 6 tokens (3 blocks: 3 * 2 + 2 <= 9), a view
    of 1 full block, while the lookup bound 8 asks for 2: the view is read to its end and
    the hit is 4 tokens (full block 1; the window's 2 blocks ending at 4: ids 5 and 6, as
    "a" took 1..4 for full attention and 5..12 for the window)."""
    from properties.engines.vllm import make_engine

    groups = (FullAttentionSpec(block_size=4), SlidingWindowSpec(block_size=2, sliding_window=4))
    layout = KVCacheLayout(
        groups=tuple(KVCacheGroup((f"l{i}",), spec) for i, spec in enumerate(groups)),
        num_blocks=60,
        max_model_len=64,
        use_eagle=True,
        num_hash_lookahead_tokens=2,
    )
    engine = make_engine(layout)
    run_prompt(engine, "a", tuple(range(16)))
    assert engine.get_block_ids("a") == ((1, 2, 3, 4), tuple(range(5, 13)))
    engine.new_step()
    engine.add_request(RequestInput("b", tuple(range(9))))
    assert engine.get_computed_blocks("b") == CacheHit(((1,), (5, 6)), 4)


def test_zeroing_lists_the_attention_blocks_each_step_and_a_mutant_is_caught(monkeypatch):
    """Full (bs 4) + Mamba (bs 4): vLLM zeroes new attention blocks (a Mamba group needs
    zeroing). Step 1: ``a`` (its 8 prompt tokens) adds full (1, 2) and Mamba (3); ``b``
    (4 of its 12) adds full (4) and Mamba (5). At the next step vLLM hands over ``[1, 2, 4]``
    (``reference.zeroing.blocks_to_zero``), which the adapter checks. A vLLM that
    forgets to drain its list hands them over again: an EngineError."""
    from properties.core.engine import EngineError

    engine = make((FullAttentionSpec(block_size=4), MambaSpec(block_size=4)), 40)
    engine.new_step()
    for rid, prompt in (("a", tuple(range(10, 18))), ("b", tuple(range(20, 32)))):
        engine.add_request(RequestInput(rid, prompt))
        hit = engine.get_computed_blocks(rid)
        assert engine.allocate_slots(rid, 8 if rid == "a" else 4, 0, hit) is not None
    assert engine._added == [((1, 2), (3,)), ((4,), (5,))]
    engine.new_step()  # checks [1, 2, 4]
    manager = engine.manager
    take = manager.take_new_block_ids
    kept: list[int] = []

    def not_drained() -> list[int]:
        kept.extend(take())
        return list(kept)

    monkeypatch.setattr(manager, "take_new_block_ids", not_drained)
    engine.set_num_computed_tokens("b", 4)
    assert engine.allocate_slots("b", 4) is not None  # full (6), Mamba (7)
    engine.new_step()  # [6]: the first take
    engine.set_num_computed_tokens("b", 8)
    assert engine.allocate_slots("b", 4) is not None
    with pytest.raises(EngineError, match="take_new_block_ids gave"):
        engine.new_step()


def test_block_metrics_lifecycles_by_hand_and_a_mutant_is_caught(monkeypatch):
    """Full bs 2, 4 usable blocks (a layout the adapter gives a metrics collector).
    ``a`` (1-4) gets blocks 1, 2 and ends: queue (3, 4, 2, 1). ``b`` (1-5) hits 1, 2 (one
    access each) and gets 3, ends: 3 (not full) to the front. ``c`` (1-4, 6) hits 1, 2
    again (two accesses) and gets 3 again: 3's first life ends, one event, no gap. At
    the step: events [0], tracked 1, 2, 3. ``c`` ends; ``d`` (6 tokens, no hit) gets 3,
    4, 2: 3 ends another life (0 gaps), 2 ends its life of two accesses (1 gap): events
    [0, 1]. A collector that never emits events is caught at the next step."""
    from properties.core.engine import EngineError
    from properties.engines.vllm import observes_block_metrics

    engine = make((FullAttentionSpec(block_size=2),), 5)
    assert observes_block_metrics(engine.layout)
    engine.new_step()
    run_prompt(engine, "a", (1, 2, 3, 4))
    engine.free("a")
    assert engine.free_queue() == [3, 4, 2, 1]
    run_prompt(engine, "b", (1, 2, 3, 4, 5))
    engine.free("b")
    run_prompt(engine, "c", (1, 2, 3, 4, 6))
    assert engine.get_block_ids("c") == ((1, 2, 3),)
    assert engine._lifecycles.events == [0]
    engine.new_step()  # checks events [0], tracked {1, 2, 3}
    engine.free("c")
    run_prompt(engine, "d", (9, 9, 9, 9, 9, 9))
    assert engine.get_block_ids("d") == ((3, 4, 2),)
    assert engine._lifecycles.events == [0, 1]
    engine.new_step()
    monkeypatch.setattr(engine._metrics, "on_block_evicted", lambda block: None)
    engine.free("d")
    run_prompt(engine, "e", (8, 8, 8, 8, 8, 8))  # reuses tracked blocks: no event now
    with pytest.raises(EngineError, match="block metrics collector"):
        engine.new_step()


def test_connector_blocks_are_checked_each_step_and_a_mutant_is_caught(monkeypatch):
    """vLLM's ``get_block_ids_for_computed_tokens`` must cut each attention row to the
    computed tokens (``reference.connector_blocks.blocks_covering``): a request of 6
    prompt tokens with 3 computed is told 2 blocks of bs 2. A manager that tells the
    whole row is caught at the next step."""
    from properties.core.engine import EngineError

    engine = make((FullAttentionSpec(block_size=2),), 20)
    engine.new_step()
    engine.add_request(RequestInput("a", (1, 2, 3, 4, 5, 6)))
    hit = engine.get_computed_blocks("a")
    assert engine.allocate_slots("a", 6, 0, hit) == ((1, 2, 3),)
    engine.set_num_computed_tokens("a", 3)
    engine.new_step()
    manager = engine.manager
    monkeypatch.setattr(
        manager,
        "get_block_ids_for_computed_tokens",
        lambda request_id, n: manager.get_block_ids(request_id),
    )
    with pytest.raises(EngineError, match="get_block_ids_for_computed_tokens"):
        engine.new_step()


# -- Mamba modes (the hand-computed vectors of tests/reference/test_mamba_modes.py) -------


def _vllm_factory(layout):
    from properties.engines.vllm import make_engine

    return make_engine(layout)


def test_mamba_none_mode_speculative_relocation_and_checkpoints_as_computed_by_hand():
    """vLLM gives the hand-computed rows, new blocks, estimates and cached states of
    tests/reference/test_mamba_modes.py (the reference gives them too)."""
    from tests.reference import test_mamba_modes as vectors

    vectors.check_none_mode_takes_the_state_and_speculative_blocks_at_once(_vllm_factory)
    vectors.check_speculative_blocks_are_relocated_when_the_state_passes_them(_vllm_factory)
    vectors.check_checkpoint_reserves_a_block_keyed_at_its_position(_vllm_factory)
    vectors.check_without_checkpoint_blocks_the_same_chunk_caches_no_state(_vllm_factory)
    vectors.check_checkpoint_outside_the_retention_is_not_kept(
        None, {(1, 0, 4), (2, 0, 8)}, _vllm_factory
    )
    vectors.check_checkpoint_outside_the_retention_is_not_kept(8, {(2, 0, 8)}, _vllm_factory)
    vectors.check_eagle_hit_with_a_mamba_group(_vllm_factory)
    vectors.check_prompt_tail_keyed_at_the_hash_grid(_vllm_factory)


def test_negative_mamba_estimate_after_a_rollback_is_met_at_run_time():
    """The rollback of tests/reference/test_mamba_modes.py: vLLM estimates -1 for the last
    step (the reference 0); the adapter raises KnownDivergenceMet naming the divergence."""
    from properties.core.engine import KnownDivergenceMet
    from properties.engines.vllm import KNOWN_DIVERGENCES, NEGATIVE_MAMBA_ESTIMATE

    eng = make((MambaSpec(block_size=4, num_speculative_blocks=4),), 16, 64)
    eng.add_request(RequestInput("r", tuple(range(6))))
    assert eng.allocate_slots("r", 6, 0, eng.get_computed_blocks("r")) == ((1, 2, 3, 4, 5),)
    eng.set_num_computed_tokens("r", 6)
    eng.append_output_tokens("r", [100])
    eng.new_step()
    eng.set_in_flight("r", 0, 4)
    assert eng.allocate_slots("r", 5) == ((6,),)
    eng.set_num_computed_tokens("r", 7)
    eng.set_in_flight("r", 0, 0)
    eng.append_output_tokens("r", [101])
    eng.new_step()
    with pytest.raises(KnownDivergenceMet) as met:
        eng.allocate_slots("r", 1)
    assert met.value.divergence == NEGATIVE_MAMBA_ESTIMATE
    assert "estimated -1 blocks" in str(met.value)
    (declared,) = [d for d in KNOWN_DIVERGENCES if d.name == NEGATIVE_MAMBA_ESTIMATE]
    assert declared.at_run_time and not declared.applies(eng.layout)
