"""Hand-written scenarios for the LMDeploy adapter (``properties/engines/lmdeploy.py``).

Expected ids follow from LMDeploy's allocators on a fresh pool: its physical GPU
allocator hands out blocks in ascending order from 1 (block 0 is the reserved dummy
block), and a freed block goes back to the front of its free list (a stack). Run with
``.engines/lmdeploy/bin/python -W ignore -m pytest
tests/properties/engines/test_lmdeploy_adapter.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from properties.core.engine import CachedBlock, EngineError, RequestInput, UnsupportedLayoutError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

pytestmark = pytest.mark.engine

_ROOT = Path(__file__).resolve().parents[3]
if not (_ROOT / ".engines" / "lmdeploy" / ".kvconform-complete").exists():
    pytest.skip("LMDeploy is not installed (.engines/lmdeploy)", allow_module_level=True)
pytest.importorskip("lmdeploy.pytorch.paging.scheduler")

from properties.engines.lmdeploy import (  # noqa: E402
    KNOWN_DIVERGENCES,
    LogicalClock,
    adapter_key,
    config_for,
    make_engine,
    uses_window_manager,
)


def full(bs: int = 4, num_blocks: int = 16, caching: bool = True) -> KVCacheLayout:
    group = KVCacheGroup(("l0",), FullAttentionSpec(block_size=bs))
    return KVCacheLayout((group,), num_blocks, 64, enable_caching=caching)


def window(bs: int = 2, w: int = 4, num_blocks: int = 20) -> KVCacheLayout:
    group = KVCacheGroup(("l0",), SlidingWindowSpec(block_size=bs, sliding_window=w))
    return KVCacheLayout((group,), num_blocks, 64)


def hybrid(bs: int = 4, w: int = 4, num_blocks: int = 16) -> KVCacheLayout:
    groups = (
        KVCacheGroup(("full",), FullAttentionSpec(block_size=bs)),
        KVCacheGroup(("swa",), SlidingWindowSpec(block_size=bs, sliding_window=w)),
    )
    return KVCacheLayout(groups, num_blocks, 64)


def admit(engine, rid: str, prompt: tuple[int, ...], n: int | None = None, lookahead: int = 0):
    """Add ``rid``, look it up, admit ``n`` tokens after the hit (all of them by default);
    returns the hit and the new blocks."""
    engine.add_request(RequestInput(rid, prompt))
    hit = engine.get_computed_blocks(rid)
    n = len(prompt) - hit.num_tokens if n is None else n
    return hit, engine.allocate_slots(rid, n, hit.num_tokens, hit, lookahead)


# ----------------------------------------------------------------- the configuration
def test_config_follows_lmdeploys_engine():
    """One window width for every group: the window manager with that width; a hybrid of
    full and window layers keeps every block (window -1), as LMDeploy's gemma config."""
    assert config_for(window(bs=2, w=6)).window_size == 6
    assert config_for(hybrid()).window_size == -1
    assert config_for(full()).window_size == -1
    two_windows = KVCacheLayout(
        (
            KVCacheGroup(("a",), SlidingWindowSpec(block_size=4, sliding_window=8)),
            KVCacheGroup(("b",), SlidingWindowSpec(block_size=4, sliding_window=8)),
        ),
        16,
        64,
    )
    assert config_for(two_windows).window_size == 8
    assert uses_window_manager(two_windows) and not uses_window_manager(hybrid())


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (MambaSpec(block_size=4), "Mamba"),
        (ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8), "chunked_local"),
        (FullAttentionSpec(block_size=8), "one block size"),
    ],
)
def test_refused_layouts_say_why(spec, reason):
    layout = KVCacheLayout(
        (
            KVCacheGroup(("a",), FullAttentionSpec(block_size=4)),
            KVCacheGroup(("b",), spec),
        ),
        16,
        64,
    )
    with pytest.raises(UnsupportedLayoutError, match=reason):
        make_engine(layout)


def test_adapter_key_partitions_roots_by_lora_and_salt():
    assert adapter_key(None, None) is None
    assert adapter_key("a", None) == "a"
    assert adapter_key(None, "s") == "lora=None;salt='s'"
    assert adapter_key("a", "s") != adapter_key("a", None)


def test_the_logical_clock_ticks_once_per_read():
    clock = LogicalClock()
    assert (clock.perf_counter(), clock.perf_counter(), clock.time()) == (1.0, 2.0, 3.0)


def test_lmdeploy_reads_access_times_from_the_logical_clock():
    """After an engine is built, LMDeploy's allocator stamps whole ticks: two requests
    admitted one after the other get strictly increasing access times."""
    engine = make_engine(full())
    admit(engine, "a", tuple(range(4)))
    admit(engine, "b", tuple(range(10, 14)))
    allocator = engine.block_manager.allocator
    a, b = (engine._requests[r].seq.logical_blocks.get_real_blocks() for r in "ab")
    assert allocator.get_access_time(a)[0] < allocator.get_access_time(b)[0]


# -------------------------------------------------------------- prefix hits (the trie)
def test_a_prefix_hit_through_the_trie():
    """bs 4, 16 blocks (15 usable). A: 10 tokens -> blocks 1, 2, 3; its two full blocks
    enter the trie at allocation. B: A's first 8 tokens + 4 others (12): LMDeploy's match
    stops before the last token, so it hits blocks 1, 2 (8 tokens) and gets block 4.
    Refs (owners, the trie's own reference left out): 1 and 2 held by both."""
    engine = make_engine(full())
    hit, new = admit(engine, "a", tuple(range(10)))
    assert (hit.num_tokens, new) == (0, ((1, 2, 3),))
    engine.set_num_computed_tokens("a", 10)
    hit, new = admit(engine, "b", tuple(range(8)) + (50, 51, 52, 53))
    assert hit.block_ids == ((1, 2),) and hit.num_tokens == 8
    assert new == ((4,),)
    assert engine.get_block_ids("b") == ((1, 2, 4),)
    refs = engine.ref_counts()
    assert (refs[1], refs[2], refs[3], refs[4], refs[5]) == (2, 2, 1, 1, 0)
    assert engine.num_free_blocks() == 11
    assert sorted((c.block_id, c.num_tokens) for c in engine.cached_blocks()) == [
        (1, 4),
        (2, 8),
        (4, 12),
    ]


def test_a_lookup_changes_no_count():
    """get_computed_blocks is a tentative match rolled back: free count, ref counts and
    the trie's hit statistics are as before; the request holds nothing."""
    engine = make_engine(full())
    admit(engine, "a", tuple(range(12)))
    engine.set_num_computed_tokens("a", 12)
    engine.add_request(RequestInput("b", tuple(range(12)) + (7,)))
    before = (engine.num_free_blocks(), engine.ref_counts(), engine.block_trie.stats.snapshot())
    hit = engine.get_computed_blocks("b")
    assert hit.num_tokens == 12 and hit.block_ids == ((1, 2, 3),)
    after = (engine.num_free_blocks(), engine.ref_counts(), engine.block_trie.stats.snapshot())
    assert after == before
    assert engine.get_block_ids("b") == ((),)


def test_the_last_token_is_never_a_hit():
    """A 12-token prompt fully cached hits 8 tokens (bs 4): the block of the last token
    must be computed."""
    engine = make_engine(full())
    admit(engine, "a", tuple(range(12)))
    engine.set_num_computed_tokens("a", 12)
    engine.add_request(RequestInput("b", tuple(range(12))))
    assert engine.get_computed_blocks("b").num_tokens == 8


def test_lora_and_salt_keep_prefixes_apart():
    engine = make_engine(full())
    admit(engine, "a", tuple(range(12)))
    engine.set_num_computed_tokens("a", 12)
    engine.add_request(RequestInput("salted", tuple(range(12)) + (1,), cache_salt="s"))
    engine.add_request(RequestInput("lora", tuple(range(12)) + (1,), lora_name="x"))
    assert engine.get_computed_blocks("salted").num_tokens == 0
    assert engine.get_computed_blocks("lora").num_tokens == 0


def test_free_keeps_the_prefix_cached_and_evictable():
    """After A (12 tokens, blocks 1-3, all three in the trie) is freed, every block is
    free or evictable (15), none is owned, the trie still serves a hit of 8."""
    engine = make_engine(full())
    admit(engine, "a", tuple(range(12)))
    engine.set_num_computed_tokens("a", 12)
    engine.free("a")
    engine.remove_request("a")
    assert engine.num_free_blocks() == 15
    assert set(engine.ref_counts().values()) == {0}
    assert {c.block_id for c in engine.cached_blocks()} == {1, 2, 3}
    engine.add_request(RequestInput("b", tuple(range(12))))
    assert engine.get_computed_blocks("b").num_tokens == 8


def test_reset_evicts_the_trie_once_nothing_is_held():
    engine = make_engine(full())
    admit(engine, "a", tuple(range(12)))
    assert engine.reset_prefix_cache() is False
    engine.free("a")
    assert engine.reset_prefix_cache() is True
    assert engine.cached_blocks() == []
    assert engine.num_free_blocks() == 15
    assert engine.block_manager.get_num_free_gpu_blocks() == 15


def test_eviction_makes_room_for_a_new_request():
    """5 blocks (4 usable), bs 4. A (12 tokens) fills 3 blocks, all cached, and is
    freed; B (16 other tokens) needs 4: LMDeploy evicts A's path leaf by leaf."""
    engine = make_engine(full(num_blocks=5))
    admit(engine, "a", tuple(range(12)))
    engine.set_num_computed_tokens("a", 12)
    engine.free("a")
    hit, new = admit(engine, "b", tuple(range(100, 116)))
    assert hit.num_tokens == 0 and len(new[0]) == 4
    assert engine.num_free_blocks() == 0
    assert {c.block_id for c in engine.cached_blocks()} == set(new[0])


# ------------------------------------------------------- chunks, lookahead and decode
def test_a_chunk_allocates_its_tokens_and_no_lookahead():
    """bs 4, a 20-token prompt admitted 8 tokens at a time with 2 lookahead slots:
    LMDeploy's non-final chunk (kv_token_limit 8) takes 2 blocks and no prealloc; the last
    chunk (12 tokens, final) takes cdiv(20 + 2, 4) - 2 = 4 more."""
    engine = make_engine(full())
    _, new = admit(engine, "a", tuple(range(20)), n=8, lookahead=2)
    assert new == ((1, 2),)
    assert engine._requests["a"].seq.kv_token_limit == 8
    engine.set_num_computed_tokens("a", 8)
    assert engine.allocate_slots("a", 12, num_lookahead_tokens=2) == ((3, 4, 5, 6),)
    assert engine._requests["a"].seq.kv_token_limit is None


def test_decode_with_lookahead():
    """bs 4: a 7-token prompt with 1 lookahead slot: cdiv(8, 4) = 2 blocks; its output
    token is position 7; the decode with 4 lookahead slots needs cdiv(12, 4) = 3."""
    engine = make_engine(full())
    _, new = admit(engine, "a", tuple(range(7)), lookahead=1)
    assert new == ((1, 2),)
    engine.set_num_computed_tokens("a", 7)
    engine.append_output_tokens("a", [99])
    assert engine.allocate_slots("a", 1, num_lookahead_tokens=4) == ((3,),)
    engine.set_num_computed_tokens("a", 8)
    engine.append_output_tokens("a", [98])
    assert engine.allocate_slots("a", 1) == ((),)


def test_a_refused_decode_changes_nothing_and_keeps_the_request_running():
    """3 blocks (2 usable), bs 4. A holds both (8 tokens); its decode at position 8 needs
    a third: LMDeploy's schedule_running refuses and preempts; the adapter puts the
    sequence back to RUNNING with its table, and a free then releases both blocks."""
    engine = make_engine(full(num_blocks=3, caching=False))
    admit(engine, "a", tuple(range(8)))
    engine.set_num_computed_tokens("a", 8)
    engine.append_output_tokens("a", [1])
    assert engine.allocate_slots("a", 1) is None
    seq = engine._requests["a"].seq
    assert seq.status.name == "RUNNING"
    assert engine.get_block_ids("a") == ((1, 2),)
    engine.free("a")
    assert engine.num_free_blocks() == 2


def test_a_refused_admission_rolls_its_match_back():
    """3 blocks (2 usable), bs 4. A (8 tokens, blocks 1 and 2, both cached) is freed;
    C (A's 8 tokens + 4 others) hits 8 tokens and needs a third block: none is free, and
    the hit's two blocks are not evictable while C's tentative match holds them, so
    LMDeploy refuses; the match is rolled back (reference counts and the free count as
    before, C's table empty)."""
    engine = make_engine(full(num_blocks=3))
    admit(engine, "a", tuple(range(8)))
    engine.set_num_computed_tokens("a", 8)
    engine.free("a")
    engine.remove_request("a")
    engine.add_request(RequestInput("c", tuple(range(8)) + (5, 5, 5, 5)))
    hit = engine.get_computed_blocks("c")
    assert (hit.num_tokens, hit.block_ids) == (8, ((1, 2),))
    before = (engine.ref_counts(), engine.num_free_blocks())
    assert before[1] == 2
    assert engine.allocate_slots("c", 4, 8, hit) is None
    assert (engine.ref_counts(), engine.num_free_blocks()) == before
    assert engine.get_block_ids("c") == ((),)


# ------------------------------------------------------------------ sliding windows
def test_window_frees_blocks_behind_the_window():
    """bs 2, w 4 (LMDeploy keeps keys from history - 4). A 10-token prompt in chunks of
    4, 4, 2: blocks 1, 2 then 3, 4; at history 8 the window starts at block 2, so blocks
    0 and 1 (ids 1, 2) are dropped and one of them (1) is reused for positions 8-9; at
    history 10 block 2 (id 3) is dropped and reused for position 10."""
    engine = make_engine(window())
    _, new = admit(engine, "a", tuple(range(10)), n=4)
    assert new == ((1, 2),)
    engine.set_num_computed_tokens("a", 4)
    assert engine.allocate_slots("a", 4) == ((3, 4),)
    engine.set_num_computed_tokens("a", 8)
    assert engine.allocate_slots("a", 2) == ((1,),)
    assert engine.get_block_ids("a") == ((0, 0, 3, 4, 1),)
    assert engine.num_free_blocks() == 16
    engine.set_num_computed_tokens("a", 10)
    engine.append_output_tokens("a", [7])
    assert engine.allocate_slots("a", 1) == ((3,),)
    assert engine.get_block_ids("a") == ((0, 0, 0, 4, 1, 3),)


def test_window_layouts_never_hit():
    """LMDeploy's executor turns prefix caching off for any sliding window."""
    engine = make_engine(window())
    assert engine.block_trie.enabled is False
    admit(engine, "a", tuple(range(10)))
    engine.set_num_computed_tokens("a", 10)
    engine.add_request(RequestInput("b", tuple(range(10)) + (1,)))
    assert engine.get_computed_blocks("b").num_tokens == 0


def test_a_hybrid_reports_one_table_for_every_group_and_one_pool():
    engine = make_engine(hybrid())
    assert engine.separate_group_pools is True
    admit(engine, "a", tuple(range(10)))
    assert engine.get_block_ids("a") == ((1, 2, 3), (1, 2, 3))
    (pool,) = engine.pool_usage()
    assert (pool.name, pool.group_ids, pool.num_blocks, pool.num_free) == ("kv", (0, 1), 15, 12)
    assert CachedBlock(1, 1, 4) in engine.cached_blocks()


def test_protocol_misuse_is_an_engine_error():
    engine = make_engine(full())
    admit(engine, "a", tuple(range(8)))
    with pytest.raises(EngineError, match="holds blocks"):
        engine.get_computed_blocks("a")
    with pytest.raises(EngineError, match="unknown request_id"):
        engine.free("nobody")


# ------------------------------------------------------------------ the findings
@pytest.mark.parametrize(
    ("trace", "check"),
    [
        ("trie-dedup-writes-shared-block.json", "exclusive_write"),
        ("window-overdrop.json", "window_liveness"),
    ],
)
def test_each_finding_trace_fails_on_lmdeploy(trace, check):
    """A replay runs every check (the declared divergences only turn checks off, or
    leave layouts out, in drawn runs): each finding's trace fails on its check."""
    from properties.core.trace import load_trace
    from properties.engines.under_test import resolve_engine
    from properties.runner.config import CheckConfig
    from properties.runner.run import replay_trace

    path = _ROOT / "findings" / "lmdeploy" / trace
    assert json.loads(path.read_text())["failure"]["property"] == check
    config = CheckConfig(engine="lmdeploy", level="universal")
    _run, failure = replay_trace(load_trace(path), config, resolve_engine("lmdeploy"))
    assert failure is not None and getattr(failure, "name", None) == check, failure


def test_the_declared_divergences_name_their_findings():
    names = {d.name for d in KNOWN_DIVERGENCES}
    assert names == {"lmdeploy-trie-dedup-writes-shared-block", "lmdeploy-window-overdrop"}
    readme = (_ROOT / "findings" / "lmdeploy" / "README.md").read_text()
    for d in KNOWN_DIVERGENCES:
        assert d.finding.startswith("findings/lmdeploy/README.md#")
        assert d.finding.split("#")[1] in readme


# ------------------------------------------------------------------ the mutants
def _check_mutant(name: str) -> str:
    """``kvconform check --only invariants`` (the ci profile's small tier, in process)
    against mutant ``name``: its output; the run must fail."""
    command = [
        sys.executable, "-W", "ignore", "-m", "properties.tools.cli", "check",
        "--engine", f"tests.properties.engines.lmdeploy_mutants:make_{name}",
        "--isolation", "none", "--level", "universal", "--profile", "ci",
        "--only", "invariants", "--tiers", "none", "--workers", "1", "--shrink-seconds", "5",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    done = subprocess.run(command, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode != 0, done.stdout[-2000:]
    return done.stdout


def test_the_gate_catches_the_window_one_block_early_mutant():
    """A window block dropped one allocation early: a query reads a freed key (W3)."""
    assert "first failure [window_liveness]" in _check_mutant("window_one_block_early")


def test_the_gate_catches_the_trie_keeps_no_reference_mutant():
    """The trie attaches a block without its own reference: the block a request holds
    looks like a cached block only the trie holds, so it is counted obtainable while the
    request holds it: free + held > the pool's capacity (S1)."""
    output = _check_mutant("trie_keeps_no_reference")
    assert "first failure [pool_accounting_per_pool]" in output


def test_a_kept_session_is_reclaimed_by_the_admission_that_needs_its_blocks():
    """5 blocks (4 usable), bs 4. Request k (the second: it keeps its session) computes
    10 tokens (blocks 1, 2, 3; 1 and 2 cached) and is freed and removed: its stopped
    sequence keeps the three blocks, yet all 4 count as obtainable and none is owned.
    A 16-token request of other tokens needs all 4: LMDeploy reclaims the stopped
    sequence, evicts blocks 1 and 2 from the trie and admits it; the next step ends the
    kept session."""
    engine = make_engine(full(num_blocks=5))
    engine.add_request(RequestInput("first", (1,)))
    engine.remove_request("first")
    admit(engine, "k", tuple(range(10)))
    engine.set_num_computed_tokens("k", 10)
    engine.free("k")
    engine.remove_request("k")
    session = engine._kept_sessions[1]
    assert session.num_blocks == 3 and session.status.name == "STOPPED"
    assert engine.block_manager.get_num_free_gpu_blocks() == 1
    assert engine.num_free_blocks() == 4
    assert set(engine.ref_counts().values()) == {0}
    _, new = admit(engine, "big", tuple(range(100, 116)))
    assert len(new[0]) == 4 and session.num_blocks == 0
    engine.new_step()
    assert 1 not in engine.scheduler.sessions and engine._kept_sessions == {}


def test_a_preempted_request_is_reclaimed_and_admitted_again():
    """The second request keeps its session, but a preemption (free, then 0 computed
    tokens) reclaims it at once: its blocks come back (to the front of LMDeploy's free
    list, in their order) and it is admitted again on them."""
    engine = make_engine(full(caching=False))
    engine.add_request(RequestInput("first", (1,)))
    admit(engine, "p", tuple(range(10)))
    engine.set_num_computed_tokens("p", 10)
    engine.free("p")
    assert engine.block_manager.get_num_free_gpu_blocks() == 12  # kept until the restart
    engine.set_num_computed_tokens("p", 0)
    assert engine.block_manager.get_num_free_gpu_blocks() == 15
    hit = engine.get_computed_blocks("p")
    assert engine.allocate_slots("p", 10, 0, hit) == ((1, 2, 3),)


def test_the_schedule_metrics_match_the_adapters_figures():
    """The prefix-hit example again: A queries 10 tokens and hits none, B queries 12 and
    hits 8 (the lookups, rolled back, count nothing); 4 of the 16 blocks are held by the
    two running requests, counted once; without the request-level metric the usage is
    the pool's, ``1 - 11 / 16`` (the reserved dummy block counts as used). new_step reads
    the metrics and agrees; a metric that disagrees is an engine error."""
    engine = make_engine(full())
    admit(engine, "a", tuple(range(10)))
    engine.set_num_computed_tokens("a", 10)
    admit(engine, "b", tuple(range(8)) + (50, 51, 52, 53))
    stats = engine.block_trie.stats
    assert (stats.num_query_tokens, stats.num_hit_tokens) == (22, 8)
    engine.request_usage_metric = True
    engine.new_step()
    assert engine.scheduler.schedule_metrics.cache_usage == 4 / 16
    engine.request_usage_metric = False
    engine.new_step()
    assert engine.scheduler.schedule_metrics.cache_usage == 1 - 11 / 16
    stats.num_hit_tokens += 1
    with pytest.raises(EngineError, match="schedule_metrics"):
        engine.new_step()
