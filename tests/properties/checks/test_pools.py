"""The per-pool checks S1-S3 (``docs/spec.md``, "Separate pools") and the ``ReportsPools``
capability: its answers validated at the boundary, carried by the exec protocol, and the
checks on hand-built pools (expected values worked out by hand in each test)."""

from __future__ import annotations

import sys

import pytest

from properties.checks.answers import AnswerError, check_pool_usage
from properties.checks.invariants import (
    allocation_fits_per_pool,
    idle_pool_free_per_pool,
    pool_accounting_per_pool,
)
from properties.checks.registry import CHECKS
from properties.checks.state import CheckState, FailedAllocationEvent, PoolEvent
from properties.core.engine import PoolUsage, ReportsPools, RequestInput
from properties.engines.exec_engine import ExecEngineFactory
from properties.engines.reference import ReferenceEngine
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, SlidingWindowSpec


def _layout(num_blocks: int = 17) -> KVCacheLayout:
    return KVCacheLayout(
        groups=(
            KVCacheGroup(("full",), FullAttentionSpec(block_size=4)),
            KVCacheGroup(("swa",), SlidingWindowSpec(block_size=4, sliding_window=8)),
        ),
        num_blocks=num_blocks,
        max_model_len=64,
    )


class TwoPools:
    """A stand-in for an engine with a full pool (group 0) and a SWA pool (group 1) whose
    figures the test sets by hand."""

    separate_group_pools = True

    def __init__(self, full: int = 16, swa: int = 16) -> None:
        self.capacity = {"full": full, "swa": swa}
        self.free = dict(self.capacity)

    def num_free_blocks(self) -> int:
        return min(self.free.values())

    def pool_usage(self) -> tuple[PoolUsage, ...]:
        return (
            PoolUsage("full", (0,), self.capacity["full"], self.free["full"]),
            PoolUsage("swa", (1,), self.capacity["swa"], self.free["swa"]),
        )


def _state(engine: TwoPools) -> CheckState:
    state = CheckState(engine, _layout())  # type: ignore[arg-type]
    assert "pools" in state.capabilities() and "shared_pool" not in state.capabilities()
    return state


def test_registry_runs_the_pool_checks_only_for_engines_reporting_pools() -> None:
    for name in ("pool_accounting_per_pool", "idle_pool_free_per_pool"):
        assert CHECKS[name].on == "pool" and CHECKS[name].needs == frozenset({"pools"})
    assert CHECKS["allocation_fits_per_pool"].on == "failed_allocation"
    assert not CHECKS["pool_accounting_per_pool"].runs_with({"shared_pool", "ref_counts"})


def test_p1_free_plus_held_within_each_pool() -> None:
    engine = TwoPools()
    state = _state(engine)
    # r0 holds full blocks 1, 2, 3 and SWA blocks 0 (null), 2, 3; r1 shares full block 3
    tables = {"r0": ((1, 2, 3), (0, 2, 3)), "r1": ((3, 4), (5, 6))}
    engine.free = {"full": 12, "swa": 12}  # full: 12 + |{1,2,3,4}| = 16; swa: 12 + |{2,3,5,6}|
    assert pool_accounting_per_pool(state, PoolEvent(tables, 12)) is None
    state.invalidate()
    engine.free = {"full": 12, "swa": 13}  # swa: 13 + |{2,3,5,6}| = 17 > 16
    message = pool_accounting_per_pool(state, PoolEvent(tables, 12))
    assert message == "pool 'swa' (groups [1]): 13 free + 4 held by requests > its 16 blocks"


def test_p1_pool_capacity_must_not_change() -> None:
    engine = TwoPools()
    state = _state(engine)
    engine.capacity["full"] = 20
    state.invalidate()
    message = pool_accounting_per_pool(state, PoolEvent({}, 16))
    assert message is not None and message.startswith("pool 'full' is now 20 blocks")


def test_p2_idle_pools_are_back_to_their_fresh_free_counts() -> None:
    # the full pool is the smaller one: num_free_blocks() (the min) hides the SWA leak
    engine = TwoPools(full=12, swa=16)
    state = _state(engine)
    assert state.initial_free == 12
    engine.free["swa"] = 15
    state.invalidate()
    assert engine.num_free_blocks() == state.initial_free  # I7 sees nothing
    message = idle_pool_free_per_pool(state, PoolEvent({}, engine.num_free_blocks()))
    assert message == (
        "no request holds blocks, but pool 'swa' (groups [1]) has 15 blocks free or "
        "reclaimable; the fresh engine had 16"
    )
    # while a request holds blocks the check does not apply
    assert idle_pool_free_per_pool(state, PoolEvent({"r": ((1,), (1,))}, 12)) is None


def test_p3_failed_allocation_that_fits_every_pool() -> None:
    engine = TwoPools()
    state = _state(engine)
    # bs 4, empty rows: 8 slots need 2 blocks in each pool
    fits = (2, None, None, {"full": 3, "swa": 2})
    event = FailedAllocationEvent("r", None, fits, None, num_slots=8)
    assert allocation_fits_per_pool(state, event) == (
        "allocate_slots('r') for 8 slots returned None, but every pool had the blocks it "
        "needs (full: 2 of 3 free; swa: 2 of 2 free)"
    )
    # 12 slots need 3 SWA blocks but 2 are free: None is allowed
    assert allocation_fits_per_pool(state, FailedAllocationEvent("r", None, fits, None, 12)) is None
    # a row of 2 SWA blocks already: 12 slots need 1 more, 3 more in the full pool
    rows = ((), (5, 6))
    assert allocation_fits_per_pool(state, FailedAllocationEvent("r", None, fits, rows, 12))
    # without the per-pool free counts (a batched item after the first) nothing is claimed
    unknown = (2, None, None, None)
    event = FailedAllocationEvent("r", None, unknown, None, 8)
    assert allocation_fits_per_pool(state, event) is None


@pytest.mark.parametrize(
    ("answer", "wrong"),
    [
        ((), "not a non-empty sequence"),
        ((PoolUsage("full", (0,), 16, 3),), "do not partition"),
        ((PoolUsage("a", (0,), 16, 3), PoolUsage("a", (1,), 16, 3)), "not a new string"),
        ((PoolUsage("a", (0, 1), 16, 17),), "17 free of 16 blocks"),
        ((PoolUsage("a", (0,), 16, 1), PoolUsage("b", (0, 1), 16, 1)), "do not partition"),
        (["full"], "not a PoolUsage"),
    ],
)
def test_bad_pool_answers_are_named(answer, wrong: str) -> None:
    with pytest.raises(AnswerError, match=wrong):
        check_pool_usage("engine: pool_usage()", answer, _layout())


class OnePoolReference(ReferenceEngine):
    """The reference engine reporting its one shared pool through ``ReportsPools``."""

    def pool_usage(self) -> tuple[PoolUsage, ...]:
        groups = tuple(range(len(self.layout.groups)))
        return (PoolUsage("shared", groups, self.layout.num_blocks - 1, self.num_free_blocks()),)


def make_one_pool_reference(layout: KVCacheLayout) -> OnePoolReference:
    return OnePoolReference(layout)


def test_pool_usage_travels_over_the_exec_protocol() -> None:
    target = f"{__name__}:make_one_pool_reference"
    factory = ExecEngineFactory([sys.executable, "-m", "properties.engines.serve", target])
    layout = _layout()
    try:
        engine = factory(layout)
        assert isinstance(engine, ReportsPools)
        assert engine.pool_usage() == [PoolUsage("shared", (0, 1), 16, 16)]
        engine.add_request(RequestInput("r", tuple(range(10))))
        assert engine.allocate_slots("r", 10, 0, None) is not None
        # 10 tokens, bs 4: 3 blocks in each of the two groups, from the one pool
        assert engine.pool_usage() == [PoolUsage("shared", (0, 1), 16, 10)]
    finally:
        factory.close()


# ------------------------------------------------- copies with separate pools (issue 39)
def test_copy_group_is_the_hit_row_holding_the_source_at_the_destinations_column():
    """Block ids are per pool, so a copy's pair alone names no pool: the group is the one
    whose hit row has the source where the request's row now has the destination. Full
    pool block 1 at column 0 stays 1, the Mamba row's 1 became 3: group 1."""
    from properties.checks.checker import copy_group
    from properties.core.engine import CacheHit

    hit = CacheHit(((1, 43), (1,)), 2)
    table = ((1, 43, 44), (3,))
    assert copy_group(hit, table, 1, 3) == 1
    assert copy_group(hit, table, 43, 3) is None  # no row has 43 turned into 3
    assert copy_group(None, table, 1, 3) is None


def test_shadow_copy_with_separate_pools_stays_in_its_group():
    """With separate pools a copy in group 1 copies group 1's block: group 0's block of
    the same id keeps its content; a copy of unknown group forgets the destination."""
    from properties.checks.oracles import ShadowCache
    from reference.specs import MambaSpec

    layout = KVCacheLayout(
        groups=(
            KVCacheGroup(("full",), FullAttentionSpec(block_size=1)),
            KVCacheGroup(("mamba",), MambaSpec(block_size=32)),
        ),
        num_blocks=9,
        max_model_len=32,
    )
    shadow = ShadowCache(layout, shared_pool=False)
    shadow.write(0, 3, 0, 11)  # full block 3 holds prefix 11
    shadow.write(1, 1, -1, 22)  # Mamba block 1 holds the state of prefix 22
    shadow.copy(1, 3, 1)
    assert shadow.holds(1, 3, -1, 22)
    assert shadow.holds(0, 3, 0, 11)
    assert not shadow.holds(0, 1, 0, 22)
    shadow.copy(1, 3, None)  # no known group: block 3 is forgotten in every pool
    assert not shadow.holds(1, 3, -1, 22)
    assert not shadow.holds(0, 3, 0, 11)
