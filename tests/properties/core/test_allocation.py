"""Allocation values, allocate(engine, allocation) and EngineProxy."""

from __future__ import annotations

import pytest

from properties.core.allocation import Allocation, TakesAllocations, allocate
from properties.core.engine import (
    CacheHit,
    CommitsSteps,
    ExposesFreeQueue,
    ExposesRefCounts,
    PlansSteps,
    SupportsServingModes,
)
from properties.core.proxy import EngineProxy

HIT = CacheHit(((3, 4),), 8)


class PositionalEngine:
    """Records the arguments of its allocate_slots; names them its own way."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def allocate_slots(self, rid, n, n_hit=0, hit=None, lookahead=0, **keywords):
        self.calls.append(((rid, n, n_hit, hit, lookahead), keywords))
        return ((7,),)


def test_keywords_are_only_the_non_default_serving_mode_ones() -> None:
    assert Allocation("r0", 8).keywords() == {}
    gated = Allocation("r0", 8, full_sequence_must_fit=True)
    assert gated.keywords() == {"full_sequence_must_fit": True}
    load = Allocation("r0", 0, 8, HIT, num_external_computed_tokens=4, delay_cache_blocks=True)
    assert load.keywords() == {"num_external_computed_tokens": 4, "delay_cache_blocks": True}


def test_describe_names_the_call_without_the_hit() -> None:
    assert Allocation("r3", 8, 4, HIT, 2).describe() == (
        "allocate_slots('r3', num_new_tokens=8, num_new_computed_tokens=4, num_lookahead_tokens=2)"
    )
    assert (
        Allocation("r3", 8, full_sequence_must_fit=True)
        .describe()
        .endswith("num_lookahead_tokens=0, full_sequence_must_fit=True)")
    )


def test_allocate_passes_five_positional_arguments_and_the_keywords() -> None:
    engine = PositionalEngine()
    assert allocate(engine, Allocation("r0", 1)) == ((7,),)
    allocate(engine, Allocation("r1", 8, 8, HIT, 3, full_sequence_must_fit=True))
    assert engine.calls == [
        (("r0", 1, 0, None, 0), {}),
        (("r1", 8, 8, HIT, 3), {"full_sequence_must_fit": True}),
    ]


class ValueEngine(TakesAllocations):
    def __init__(self) -> None:
        self.seen: list[Allocation] = []

    def allocate(self, allocation: Allocation):
        self.seen.append(allocation)
        return ()


class OverridingEngine(ValueEngine):
    """A subclass that redefines allocate_slots: allocate() must go through it."""

    def allocate_slots(self, *args, **kwargs):
        self.seen.append(("allocate_slots", args, kwargs))
        return None


def test_a_class_taking_allocations_gets_the_value_and_its_protocol_call_builds_it() -> None:
    engine = ValueEngine()
    value = Allocation("r0", 4, num_lookahead_tokens=1)
    allocate(engine, value)
    assert engine.seen[0] is value
    engine.allocate_slots("r1", 2, 0, None, 0, delay_cache_blocks=True)
    assert engine.seen[1] == Allocation("r1", 2, delay_cache_blocks=True)
    overriding = OverridingEngine()
    allocate(overriding, Allocation("r2", 5))
    assert overriding.seen == [("allocate_slots", ("r2", 5, 0, None, 0), {})]


class FullEngine(PositionalEngine):
    def ref_counts(self):
        return {1: 2}

    def free_queue(self):
        return [5, 6]

    def schedule_step(self, items):
        return [None]

    def set_in_flight(self, request_id, num_in_flight_tokens, num_pending_tokens):
        self.calls.append((("set_in_flight", request_id), {}))

    def cache_blocks(self, request_id, num_tokens):
        pass


def test_proxy_around_offers_exactly_the_inner_capabilities_and_forwards() -> None:
    inner = FullEngine()
    proxy = EngineProxy.around(inner)
    assert isinstance(proxy, ExposesRefCounts) and isinstance(proxy, ExposesFreeQueue)
    assert isinstance(proxy, PlansSteps) and isinstance(proxy, SupportsServingModes)
    assert not isinstance(proxy, CommitsSteps)
    assert proxy.ref_counts() == {1: 2} and proxy.free_queue() == [5, 6]
    proxy.allocate_slots("r0", 3, 0, None, 1)
    proxy.set_in_flight("r0", 3, 1)
    assert inner.calls == [(("r0", 3, 0, None, 1), {}), (("set_in_flight", "r0"), {})]
    bare = EngineProxy(inner)
    assert not isinstance(bare, ExposesRefCounts) and not isinstance(bare, PlansSteps)
    plain = EngineProxy.around(PositionalEngine())
    assert not isinstance(plain, ExposesFreeQueue)


def test_an_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="num_drafts"):
        ValueEngine().allocate_slots("r0", 1, num_drafts=2)
