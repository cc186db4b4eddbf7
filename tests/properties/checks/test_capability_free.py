"""The checks every engine gets, whatever optional capabilities it exposes: I7 (with no
request holding blocks, every block is free or reclaimable) and A2 (an allocation that
fits the free count does not fail)."""

from __future__ import annotations

import pytest

from properties.checks.checker import Checker
from properties.checks.lockstep import LockstepEngine
from properties.checks.registry import CHECKS, PropertyViolation
from properties.core.trace import Arrive, Step
from properties.engines.reference import make_engine
from properties.mutants.reference_mutants import BareEngine, make_bare_leaky_free
from properties.runner.scheduler import Scheduler
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

LAYOUT = KVCacheLayout(
    groups=(KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),),
    num_blocks=16,
    max_model_len=32,
)


class RefusingEngine(BareEngine):
    """Refuses every allocation of request ``r1`` (a pool with room to spare)."""

    def allocate_slots(self, request_id, *args, **kwargs):
        if request_id == "r1":
            return None
        return super().allocate_slots(request_id, *args, **kwargs)


def run(engine, *ops):
    scheduler = Scheduler(LockstepEngine(engine, LAYOUT), LAYOUT)
    for op in ops:
        scheduler.apply(op)


def test_bare_engine_runs_the_capability_free_checks_only() -> None:
    checker = Checker(BareEngine(make_engine(LAYOUT)), LAYOUT)
    active = checker.active_checks()
    assert checker.state.capabilities() == {"shared_pool"}
    assert "idle_pool_free" in active and "allocation_fits" in active
    for name in ("ref_counts_match_owners", "free_queue_contents", "hit_maximality"):
        assert name not in active and CHECKS[name].needs - {"shared_pool"}


def test_a_refused_allocation_that_fits_is_reported() -> None:
    with pytest.raises(PropertyViolation) as caught:
        run(RefusingEngine(make_engine(LAYOUT)), Arrive("r1", (1, 2, 3, 4, 5)), Step(8))
    assert caught.value.name == "allocation_fits"
    assert "needs at most 2 new blocks and 15 were free" in caught.value.message


def test_a_block_leaked_by_free_is_reported_once_nothing_is_held() -> None:
    with pytest.raises(PropertyViolation) as caught:
        run(make_bare_leaky_free(LAYOUT), Arrive("r0", (1, 2, 3, 4, 5), ()), Step(8))
    assert caught.value.name == "idle_pool_free"
    assert "14 blocks are free or reclaimable; the fresh engine had 15" in caught.value.message


def test_the_reference_passes_both() -> None:
    run(
        BareEngine(make_engine(LAYOUT)),
        Arrive("r0", (1, 2, 3, 4, 5), (6, 7)),
        Arrive("r1", (1, 2, 3, 4, 9)),
        Step(32),
        Step(32),
        Step(32),
    )
