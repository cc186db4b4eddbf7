"""An engine's own host tier (``OwnsHostTier``, ``docs/spec.md`` "An engine's own host
tier"): its answers validated at the boundary, the shadow following every copy between
the tiers, and the checks X3-X7 on hand-built tiers (expected values worked out by hand
in each test)."""

from __future__ import annotations

import pytest
import torch

from properties.checks.answers import AnswerError, check_host_pools, check_host_transfers
from properties.checks.attention import AttentionChecker, AttentionMismatch
from properties.checks.checker import Checker
from properties.checks.host_invariants import (
    backed_up_blocks_not_free,
    host_hit_content,
    host_pool_accounting,
    host_transfers_pinned,
)
from properties.checks.invariants import idle_pool_free_per_pool
from properties.checks.registry import CHECKS, PropertyViolation
from properties.checks.state import AllocateEvent, ExternalLoadEvent, OtherTables, PoolEvent
from properties.core.engine import (
    HOST_FETCH,
    HOST_LOAD,
    HOST_STORE,
    HOST_WRITE,
    HostPoolUsage,
    HostTransfer,
    OwnsHostTier,
    PoolUsage,
)
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec


def _layout() -> KVCacheLayout:
    """One full-attention group of bs 2, 16 usable blocks."""
    return KVCacheLayout(
        groups=(KVCacheGroup(("full",), FullAttentionSpec(block_size=2)),),
        num_blocks=17,
        max_model_len=32,
    )


class HostTierStandIn:
    """An engine with one device pool and a host pool of 8 blocks whose figures and
    copies the test sets by hand (``OwnsHostTier`` and ``ReportsPools``)."""

    separate_group_pools = True

    def __init__(self) -> None:
        self.free = 16
        self.host = HostPoolUsage("full", (0,), 8, 8, ())
        self.transfers: list[HostTransfer] = []
        self.tables: dict[str, tuple[tuple[int, ...], ...]] = {}

    def num_free_blocks(self) -> int:
        return self.free

    def pool_usage(self) -> tuple[PoolUsage, ...]:
        return (PoolUsage("full", (0,), 16, self.free),)

    def host_hit(self, request_id: str) -> int:
        return 0

    def host_pools(self) -> tuple[HostPoolUsage, ...]:
        return (self.host,)

    def take_host_transfers(self) -> list[HostTransfer]:
        out, self.transfers = self.transfers, []
        return out

    def get_block_ids(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        return self.tables.get(request_id, ((),))


def _checker(engine: HostTierStandIn) -> Checker:
    checker = Checker(engine, _layout())  # type: ignore[arg-type]
    assert "host_tier" in checker.state.capabilities()
    return checker


def _write_prefix(checker: Checker, rid: str, tokens: list[int], table: tuple[int, ...]) -> None:
    """The shadow learns that ``rid`` computed ``tokens`` into ``table`` (bs 2)."""
    checker.on_add(rid, tokens, None, None)
    req = checker.requests[rid]
    req.refresh_ids()
    for p in range(len(tokens)):
        checker.state.shadow.write(0, table[p // 2], p % 2, req.ids[p])


def test_the_stand_in_owns_a_host_tier_and_the_checks_need_it() -> None:
    assert isinstance(HostTierStandIn(), OwnsHostTier)
    for name in ("host_hit_content", "host_transfers_pinned", "host_load_source"):
        assert "host_tier" in CHECKS[name].needs
    assert CHECKS["host_load_source"].on == "host_transfer"
    assert CHECKS["storage_fetch_source"].label == "X7"
    assert CHECKS["backed_up_blocks_not_free"].needs == frozenset({"host_tier", "pools"})


def test_host_answers_are_validated() -> None:
    layout = _layout()
    good = check_host_pools("host_pools()", [HostPoolUsage("full", (0,), 8, 6, (1, 2))], layout)
    assert good == (HostPoolUsage("full", (0,), 8, 6, (1, 2)),)
    with pytest.raises(AnswerError, match="9 free of 8 blocks"):
        check_host_pools("host_pools()", [HostPoolUsage("full", (0,), 8, 9, ())], layout)
    with pytest.raises(AnswerError, match=r"id 9 in held of host pool 'full', outside \[1, 9\)"):
        check_host_pools("host_pools()", [HostPoolUsage("full", (0,), 8, 2, (9,))], layout)
    with pytest.raises(AnswerError, match="groups"):
        check_host_pools("host_pools()", [HostPoolUsage("full", (), 8, 2, ())], layout)
    ok = [HostTransfer(HOST_WRITE, 0, 3, 1), HostTransfer(HOST_STORE, 0, 0, 1, "k")]
    assert check_host_transfers("t()", ok, layout) == ok
    with pytest.raises(AnswerError, match="not a HostTransfer"):
        check_host_transfers("t()", [HostTransfer("copy", 0, 3, 1)], layout)
    with pytest.raises(AnswerError, match="null block"):
        check_host_transfers("t()", [HostTransfer(HOST_LOAD, 0, 0, 1)], layout)
    with pytest.raises(AnswerError, match="names device block 3"):
        check_host_transfers("t()", [HostTransfer(HOST_FETCH, 0, 3, 1, "k")], layout)
    with pytest.raises(AnswerError, match="has key ''"):
        check_host_transfers("t()", [HostTransfer(HOST_STORE, 0, 0, 1)], layout)


def test_a_load_of_a_host_block_no_write_filled_fails_x6() -> None:
    checker = _checker(HostTierStandIn())
    with pytest.raises(PropertyViolation, match=r"\[host_load_source\].*host block 2"):
        checker.on_host_transfers([HostTransfer(HOST_LOAD, 0, 5, 2)])


def test_a_fetch_of_a_key_no_store_wrote_fails_x7() -> None:
    checker = _checker(HostTierStandIn())
    checker.on_host_transfers([HostTransfer(HOST_WRITE, 0, 3, 1)])
    checker.on_host_transfers([HostTransfer(HOST_STORE, 0, 0, 1, "a")])
    checker.on_host_transfers([HostTransfer(HOST_FETCH, 0, 0, 2, "a")])  # written: fine
    with pytest.raises(PropertyViolation, match=r"\[storage_fetch_source\].*'b'"):
        checker.on_host_transfers([HostTransfer(HOST_FETCH, 0, 0, 3, "b")])


def test_content_follows_write_store_fetch_and_load_x3() -> None:
    """r0 computes ``[1, 2, 3, 4]`` into blocks 3 and 4; both go to host blocks 1 and 2,
    block 2 on to storage and back into host block 5; r1 (same tokens) loads host blocks
    1 and 5 into its blocks 7 and 8: they hold its prefix. Loading host block 2's twin
    into the wrong place (block 8 from host 1) shows."""
    engine = HostTierStandIn()
    checker = _checker(engine)
    _write_prefix(checker, "r0", [1, 2, 3, 4], (3, 4))
    checker.on_host_transfers(
        [
            HostTransfer(HOST_WRITE, 0, 3, 1),
            HostTransfer(HOST_WRITE, 0, 4, 2),
            HostTransfer(HOST_STORE, 0, 0, 2, "p2"),
            HostTransfer(HOST_FETCH, 0, 0, 5, "p2"),
            HostTransfer(HOST_LOAD, 0, 7, 1),
            HostTransfer(HOST_LOAD, 0, 8, 5),
        ]
    )
    checker.on_add("r1", [1, 2, 3, 4, 5], None, None)
    r1 = checker.requests["r1"]
    r1.refresh_ids()
    state = checker.state
    event = ExternalLoadEvent(r1, ((7, 8),), 0, 4, OtherTables(state, "r1"))
    assert host_hit_content(state, event) is None
    checker.on_host_transfers([HostTransfer(HOST_LOAD, 0, 8, 1)])  # positions 0-1 into 8
    message = host_hit_content(state, event)
    assert message is not None and message.startswith(
        "request 'r1' loaded positions [0, 4) from the host tier, group 0: block 8 slot 0 "
        "(position 2)"
    )


def test_host_pool_accounting_x4() -> None:
    engine = HostTierStandIn()
    checker = _checker(engine)
    state = checker.state
    checker.on_host_transfers(
        [HostTransfer(HOST_WRITE, 0, 3, 1), HostTransfer(HOST_WRITE, 0, 4, 2)]
    )
    engine.host = HostPoolUsage("full", (0,), 8, 6, (1, 2))
    state.invalidate()
    assert host_pool_accounting(state, PoolEvent({}, 16)) is None
    engine.host = HostPoolUsage("full", (0,), 8, 5, (1, 2))  # one block neither free nor held
    state.invalidate()
    assert host_pool_accounting(state, PoolEvent({}, 16)) == (
        "host pool 'full': 5 free + 2 held + 0 staging != 8 blocks (1 blocks neither free "
        "nor holding a copy)"
    )
    engine.host = HostPoolUsage("full", (0,), 8, 5, (1, 2), staging=(6,))  # a fetch's block
    state.invalidate()
    assert host_pool_accounting(state, PoolEvent({}, 16)) is None
    engine.host = HostPoolUsage("full", (0,), 8, 5, (1, 2), staging=(2,))
    state.invalidate()
    assert host_pool_accounting(state, PoolEvent({}, 16)) == (
        "host pool 'full': blocks [2] are both held and staging"
    )
    engine.host = HostPoolUsage("full", (0,), 8, 5, (1, 2, 2))
    state.invalidate()
    assert host_pool_accounting(state, PoolEvent({}, 16)) == (
        "host pool 'full': blocks [2] are held twice"
    )
    engine.host = HostPoolUsage("full", (0,), 8, 5, (1, 2, 3))  # 3: never written
    state.invalidate()
    assert "blocks [3] hold a copy that no write ever filled" in host_pool_accounting(
        state, PoolEvent({}, 16)
    )
    engine.host = HostPoolUsage("full", (0,), 8, 5, (1, 2, 3), (3,))  # 3: a queued write
    state.invalidate()
    assert host_pool_accounting(state, PoolEvent({}, 16)) is None
    engine.host = HostPoolUsage("full", (0,), 8, 6, (1, 2), (3,))  # dropped while in flight
    state.invalidate()
    assert "blocks [3] were dropped while a copy in flight" in host_pool_accounting(
        state, PoolEvent({}, 16)
    )


def test_a_block_being_backed_up_is_not_handed_out_nor_free_x5() -> None:
    engine = HostTierStandIn()
    checker = _checker(engine)
    state = checker.state
    checker.on_add("r2", [9, 9, 9, 9], None, None)
    engine.host = HostPoolUsage("full", (0,), 8, 7, (1,), (1,), (5,))
    state.invalidate()
    new = AllocateEvent(state.requests["r2"], ((4, 5),), None, 4, 4, start=0)
    assert host_transfers_pinned(state, new) == (
        "request 'r2' got block 5 (group 0, index 1) while a backup to the host tier that "
        "the engine has not acknowledged still reads it"
    )
    adopted = AllocateEvent(state.requests["r2"], ((5, 6),), None, 4, 4, start=2)
    assert host_transfers_pinned(state, adopted) is None  # 5 is an adopted (hit) block
    # pool level: 15 free + block 5 read by the backup = 16: fine; 16 + 1 > 16: counted free
    engine.free = 15
    state.invalidate()
    assert backed_up_blocks_not_free(state, PoolEvent({}, 15)) is None
    engine.free = 16
    state.invalidate()
    assert "a block being backed up is counted free" in backed_up_blocks_not_free(
        state, PoolEvent({}, 16)
    )


def test_idle_pools_less_the_blocks_copies_pin_s2() -> None:
    engine = HostTierStandIn()
    checker = _checker(engine)
    state = checker.state
    engine.free = 13
    engine.host = HostPoolUsage("full", (0,), 8, 7, (1,), (1,), (5,), 3)  # a node's path
    state.invalidate()
    assert idle_pool_free_per_pool(state, PoolEvent({}, 13)) is None
    engine.host = HostPoolUsage("full", (0,), 8, 7, (1,), (1,), (5,), 2)
    state.invalidate()
    assert idle_pool_free_per_pool(state, PoolEvent({}, 13)) == (
        "no request holds blocks, but pool 'full' (groups [0]) has 13 blocks free or "
        "reclaimable; the fresh engine had 16 (2 pinned by copies to or from the host)"
    )


def test_the_attention_caches_follow_the_copies() -> None:
    """Block 3's K/V goes to host block 1, to storage ``k``, back into host block 2 and
    into device block 9: block 9 then holds block 3's K/V; a load of a host block no
    write filled, or a fetch of a key no store wrote, raises."""
    checker = AttentionChecker(_layout())
    cache = checker.caches[0]
    cache.key[3] = torch.arange(cache.key[3].numel(), dtype=cache.key.dtype).view_as(cache.key[3])
    cache.value[3] = 2 * cache.key[3]
    checker.host_transfers(
        [
            HostTransfer(HOST_WRITE, 0, 3, 1),
            HostTransfer(HOST_STORE, 0, 0, 1, "k"),
            HostTransfer(HOST_FETCH, 0, 0, 2, "k"),
            HostTransfer(HOST_LOAD, 0, 9, 2),
        ]
    )
    assert torch.equal(cache.key[9], cache.key[3]) and torch.equal(cache.value[9], cache.value[3])
    with pytest.raises(AttentionMismatch, match="host block 4, which no write filled"):
        checker.host_transfers([HostTransfer(HOST_LOAD, 0, 9, 4)])
    with pytest.raises(AttentionMismatch, match="storage key 'x', which no store wrote"):
        checker.host_transfers([HostTransfer(HOST_FETCH, 0, 0, 4, "x")])
