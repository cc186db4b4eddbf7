"""The checks' reads at the large tiers (issue 18): the O(pool) reads leave the per-call
path (light snapshots, one table read per call, the cached blocks read only when the
shadow's contents allow a longer hit) without changing any verdict, and the small tier
reads as before."""

from __future__ import annotations

import pytest

from properties.checks.checker import Checker
from properties.checks.lockstep import LockstepEngine
from properties.checks.oracles import ShadowCache, content_bound_longest_hit, extend_prefix_ids
from properties.checks.registry import CHECKS, PropertyViolation, disabled_all_but
from properties.checks.state import CheckState, OtherTables, TrackedRequest
from properties.core.engine import CacheHit
from properties.core.trace import Arrive, Step
from properties.engines.reference import ReferenceEngine
from properties.runner.scheduler import Scheduler
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec

LAYOUT = KVCacheLayout(
    groups=(KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),),
    num_blocks=16,
    max_model_len=32,
)
LAYOUT2 = KVCacheLayout(
    groups=(
        KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),
        KVCacheGroup(("l1",), FullAttentionSpec(block_size=4)),
    ),
    num_blocks=16,
    max_model_len=32,
)
PROMPT = tuple(range(1, 10))  # 9 tokens: 2 full blocks of 4, a hit of at most 8


class CountingEngine(ReferenceEngine):
    """The reference, counting its ``cached_blocks`` and ``get_block_ids`` reads."""

    def __init__(self, layout: KVCacheLayout) -> None:
        super().__init__(layout)
        self.cached_reads = 0
        self.table_reads: list[str] = []

    def cached_blocks(self):
        self.cached_reads += 1
        return super().cached_blocks()

    def get_block_ids(self, request_id: str):
        self.table_reads.append(request_id)
        return super().get_block_ids(request_id)


class NoHitEngine(CountingEngine):
    """Finds no prefix hit (a broken lookup): H3 must see the 8 servable tokens."""

    def get_computed_blocks(self, request_id: str) -> CacheHit:
        hit = CacheHit(((),), 0)
        self._hits[request_id] = (hit, self.manager.empty_computed_blocks())
        return hit


def _run(engine: ReferenceEngine, every_call: bool) -> LockstepEngine:
    """r0 computes the prompt (its 2 full blocks cached), then r1 with the same prompt
    looks up."""
    lockstep = LockstepEngine(engine, LAYOUT)
    lockstep.checker.check_every_call = every_call
    scheduler = Scheduler(lockstep, LAYOUT)
    for op in (Arrive("r0", PROMPT, (50,)), Step(16), Arrive("r1", PROMPT, (51,)), Step(16)):
        scheduler.apply(op)
    lockstep.on_step_boundary()
    return lockstep


@pytest.mark.parametrize("every_call", [True, False], ids=["small", "large"])
def test_a_shorter_hit_than_the_cache_serves_is_caught_at_every_tier(every_call) -> None:
    with pytest.raises(PropertyViolation) as caught:
        _run(NoHitEngine(LAYOUT), every_call)
    assert caught.value.name == "hit_maximality"
    assert "engine hit 0 tokens, but every group can serve 8" in caught.value.message


def test_the_large_tiers_read_the_cached_blocks_only_when_a_longer_hit_is_possible() -> None:
    small, large = CountingEngine(LAYOUT), CountingEngine(LAYOUT)
    _run(small, every_call=True)
    _run(large, every_call=False)
    # two lookups (r0 finds nothing, r1 hits 8): the small tier reads the cache for H3
    # on each; at the large tiers r1's hit of 8 equals the content bound, and r0's
    # lookup comes before any write (bound 0)
    assert small.cached_reads >= 2
    assert large.cached_reads == 0


def test_the_large_tiers_read_again_only_the_called_requests_table() -> None:
    engine = CountingEngine(LAYOUT)
    checker = Checker(engine, LAYOUT)
    checker.check_every_call = False
    state = checker.state
    state.table_of("a"), state.table_of("b")
    engine.table_reads.clear()
    state.invalidate(["b"])
    state.table_of("a"), state.table_of("b")
    assert engine.table_reads == ["b"]
    state.invalidate(None)  # a call naming no request (new_step, reset): every table
    state.table_of("a")
    assert engine.table_reads == ["b", "a"]
    checker.check_every_call = True  # the small tier: every table, every call
    state.table_of("b")
    engine.table_reads.clear()
    state.invalidate(["a"])
    state.table_of("b")
    assert engine.table_reads == ["b"]


def test_snapshots_hold_the_o_pool_reads_only_where_a_check_compares_them() -> None:
    engine = ReferenceEngine(LAYOUT)
    checker = Checker(engine, LAYOUT)
    num_free, refs, queue, pools = checker.snapshot()
    assert num_free == 15 and refs is not None and queue == list(range(1, 16)) and pools is None
    checker.check_every_call = False
    assert checker.snapshot() == (15, None, None, None)
    lockstep_only = Checker(ReferenceEngine(LAYOUT), LAYOUT, disabled_all_but(()))
    assert lockstep_only.snapshot() == (15, None, None, None)
    assert {"lookup_no_side_effects", "failed_allocation"} <= set(CHECKS)


def test_content_bound_follows_the_last_slot_of_each_block() -> None:
    shadow = ShadowCache(LAYOUT, shared_pool=True)
    ids = extend_prefix_ids([], PROMPT, None, None)
    assert content_bound_longest_hit(LAYOUT, shadow, ids, 8, 4) == 0
    for p in range(8):  # block 7 holds positions 0..3, block 9 positions 4..7
        shadow.write(0, 7 if p < 4 else 9, p % 4, ids[p])
    assert shadow.blocks_ending(0, ids[3]) == {7} and shadow.blocks_ending(0, ids[7]) == {9}
    assert content_bound_longest_hit(LAYOUT, shadow, ids, 8, 4) == 8
    assert content_bound_longest_hit(LAYOUT, shadow, ids, 7, 4) == 4  # 7 rounds down
    shadow.write(0, 9, 3, 12345)  # block 9's last slot overwritten: it ends no prefix
    assert shadow.blocks_ending(0, ids[7]) == set()
    assert content_bound_longest_hit(LAYOUT, shadow, ids, 8, 4) == 4


def test_content_bound_of_a_mamba_group_reads_the_state_slot() -> None:
    layout = KVCacheLayout(
        groups=(KVCacheGroup(("m0",), MambaSpec(block_size=4, shapes=((2,),))),),
        num_blocks=8,
        max_model_len=32,
    )
    shadow = ShadowCache(layout, shared_pool=True)
    ids = extend_prefix_ids([], PROMPT, None, None)
    shadow.write(0, 3, -1, ids[7])  # the state of tokens [0, 8)
    assert shadow.blocks_ending(0, ids[7]) == {3}
    assert content_bound_longest_hit(layout, shadow, ids, 8, 4) == 8


class TablesOnly:
    """An engine that only answers tables (``tables``: request id -> table)."""

    def __init__(self, tables: dict) -> None:
        self.tables = tables

    def num_free_blocks(self) -> int:
        return 10

    def get_block_ids(self, request_id: str):
        return self.tables[request_id]


def _holding(engine: TablesOnly, shared_pool: bool = True) -> CheckState:
    engine.separate_group_pools = not shared_pool
    state = CheckState(engine, LAYOUT2)
    for rid in engine.tables:
        state.requests[rid] = TrackedRequest(rid, [1], None, None, holds_blocks=True)
    return state


def test_other_tables_name_a_holder_from_the_index() -> None:
    engine = TablesOnly({"a": ((1, 2), (9,)), "b": ((3, 4), (5,)), "c": ((4,), (6,))})
    state = _holding(engine)
    others = OtherTables(state, "a")
    assert sorted(others) == ["b", "c"] and others["b"] == ((3, 4), (5,))
    assert others.holder(0, 4) == "b"  # b was read before c
    assert others.holder(1, 3) == "b"  # one pool: any group
    assert others.holder(0, 1) is None  # a's own block
    state.requests["b"].holds_blocks = False  # freed: no longer a holder
    assert others.holder(0, 4) == "c" and others.holder(0, 3) is None
    state.forget("c")  # removed (Checker.on_remove)
    del state.requests["c"]
    assert others.holder(0, 4) is None


def test_the_index_follows_a_table_read_again() -> None:
    engine = TablesOnly({"a": ((1,), (2,)), "b": ((3,), (4,))})
    state = _holding(engine, shared_pool=False)
    assert OtherTables(state, "a").holder(1, 4) == "b"
    assert OtherTables(state, "a").holder(1, 3) is None  # separate pools: group 1 only
    engine.tables["b"] = ((3,), (7,))  # b's SWA block 4 freed, 7 taken
    state.invalidate(["b"])
    assert OtherTables(state, "a").holder(1, 4) is None
    assert OtherTables(state, "a").holder(1, 7) == "b"
