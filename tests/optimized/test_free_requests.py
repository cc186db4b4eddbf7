"""``free_requests`` (``FreesInBatch``: the batched ``free`` of requests that end in the
same step) against the successive ``free`` calls it replaces.

Hand layout of the first tests: one full-attention group, bs 2, 20 blocks (ids 1..19
free, in order), prefix caching on. ``a`` (prompt ``1..5``) takes blocks ``1, 2, 3``
(``1, 2`` full and hashed, ``3`` partial); ``b`` (prompt ``1 2 3 4 9 9 9``) hits ``1, 2``
(4 tokens) and takes ``4`` (full, hashed) and ``5`` (partial). ``free(a)`` drops
``3, 2, 1``: ``3`` reaches 0 and goes to the front, ``2`` and ``1`` stay held by ``b``.
``free(b)`` drops ``5, 4, 2, 1``: ``5`` to the front, ``4, 2, 1`` to the back. Queue after
both: ``[5, 3, 6, ..., 19, 4, 2, 1]``, every count 0.
"""

from __future__ import annotations

import pytest

from optimized.control.coordinator import KVCacheCoordinator
from properties.core.engine import CacheHit, FreesInBatch, RequestInput
from properties.core.trace import Step
from properties.engines.optimized import make_engine
from properties.engines.reference import make_engine as make_reference_engine
from properties.runner.scheduler import Scheduler
from properties.tools.bench.engines import (
    DECODE_HEAVY,
    HYBRID_6,
    PREFIX_HEAVY,
    build_trace,
    sweep_recipe,
    timed,
)
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

EXPECTED_QUEUE = [5, 3, *range(6, 20), 4, 2, 1]


@pytest.fixture(params=[2, None], ids=["one-pass", "default"], autouse=True)
def min_batched_free(request, monkeypatch):
    """Every test twice: with the one-pass free from 2 requests on, and with the default
    threshold (small batches read row by row: `_free_few_rows`)."""
    if request.param is not None:
        monkeypatch.setattr(KVCacheCoordinator, "min_batched_free", request.param)
    return request.param


def _hand_layout() -> KVCacheLayout:
    return KVCacheLayout(
        (KVCacheGroup(("l0",), FullAttentionSpec(block_size=2)),),
        num_blocks=20,
        max_model_len=64,
    )


def _two_sharing(engine) -> None:
    """``a`` then ``b`` allocated as the module docstring says."""
    engine.add_request(RequestInput("a", (1, 2, 3, 4, 5)))
    engine.add_request(RequestInput("b", (1, 2, 3, 4, 9, 9, 9)))
    assert engine.get_computed_blocks("a") == CacheHit(((),), 0)
    assert engine.allocate_slots("a", 5, 0, None, 0) == ((1, 2, 3),)
    hit = engine.get_computed_blocks("b")
    assert hit == CacheHit(((1, 2),), 4)
    assert engine.allocate_slots("b", 3, 4, hit, 0) == ((4, 5),)


def test_free_requests_gives_the_hand_computed_queue() -> None:
    engine = make_engine(_hand_layout())
    _two_sharing(engine)
    engine.free_requests(["a", "b"])
    assert engine.free_queue() == EXPECTED_QUEUE
    assert set(engine.ref_counts().values()) <= {0}
    assert engine.num_free_blocks() == 19
    assert engine.get_block_ids("a") == ((),) and engine.get_block_ids("b") == ((),)


@pytest.mark.parametrize("make", [make_engine, make_reference_engine], ids=["opt", "ref"])
def test_successive_frees_give_the_same_queue(make) -> None:
    engine = make(_hand_layout())
    _two_sharing(engine)
    engine.free("a")
    assert engine.free_queue() == [3, *range(6, 20)]
    engine.free("b")
    assert engine.free_queue() == EXPECTED_QUEUE


def test_free_requests_in_the_other_order() -> None:
    """``free(b); free(a)``: ``b`` drops ``5, 4`` to 0 (``5`` front, ``4`` back), ``2, 1``
    stay held; then ``a`` drops ``3`` (front), ``2, 1`` (back) -> ``[3, 5, 6..19, 4, 2, 1]``."""
    engine = make_engine(_hand_layout())
    _two_sharing(engine)
    engine.free_requests(["b", "a"])
    assert engine.free_queue() == [3, 5, *range(6, 20), 4, 2, 1]


def test_free_requests_with_an_unknown_id_frees_the_ones_before_it() -> None:
    engine = make_engine(_hand_layout())
    _two_sharing(engine)
    with pytest.raises(Exception, match="unknown request 'x'"):
        engine.free_requests(["a", "x", "b"])
    assert engine.free_queue() == [3, *range(6, 20)]
    assert engine.get_block_ids("b") == ((1, 2, 4, 5),)


def test_a_request_freed_twice_in_one_batch_raises() -> None:
    engine = make_engine(_hand_layout())
    _two_sharing(engine)
    with pytest.raises(Exception, match="never allocated or freed twice"):
        engine.free_requests(["a", "a"])


def _state(scheduler: Scheduler) -> tuple:
    engine = scheduler.engine
    tables = {rid: engine.get_block_ids(rid) for rid in scheduler.running}
    return tables, engine.num_free_blocks(), engine.free_queue(), engine.ref_counts()


class _Counting:
    """Counts the ids of each ``free_requests`` call of the engine it wraps."""

    def __init__(self, engine) -> None:
        self.batches: list[int] = []
        inner = engine.free_requests

        def free_requests(ids):
            self.batches.append(len(ids))
            return inner(ids)

        engine.free_requests = free_requests


@pytest.mark.parametrize(
    "recipe",
    [DECODE_HEAVY.scaled(32), PREFIX_HEAVY.scaled(32), HYBRID_6.scaled(32), sweep_recipe(24, 64)],
    ids=lambda r: r.name,
)
def test_scheduler_batched_frees_match_successive_frees_and_the_reference(recipe) -> None:
    """The same trace with batched frees, with per-request frees, and on the reference:
    the same steps and the same tables, free counts, free queue and ref counts after
    every step; the sweep's requests end together, so some batch frees several."""
    trace = build_trace(recipe)
    engine = make_engine(trace.layout)
    counting = _Counting(engine)
    batched = Scheduler(engine, trace.layout)
    per_request = Scheduler(make_engine(trace.layout), trace.layout)
    per_request.frees_in_batch = False
    reference = Scheduler(make_reference_engine(trace.layout), trace.layout)
    assert batched.frees_in_batch and not reference.frees_in_batch
    steps = 0
    for op in trace.operations:
        a, b, r = batched.apply(op), per_request.apply(op), reference.apply(op)
        if isinstance(op, Step):
            steps += 1
            assert a == b == r, f"step {steps}"
            assert _state(batched) == _state(per_request) == _state(reference), steps
    assert batched.finished == reference.finished and batched.finished
    if recipe.name.startswith("sweep"):
        assert max(counting.batches) >= 2


def test_bench_timer_exposes_free_requests_only_when_the_engine_has_it() -> None:
    layout = _hand_layout()
    assert isinstance(timed(make_engine(layout)), FreesInBatch)
    assert not isinstance(timed(make_reference_engine(layout)), FreesInBatch)
    assert not isinstance(make_reference_engine(layout), FreesInBatch)


@pytest.mark.parametrize(
    "recipe", [PREFIX_HEAVY.scaled(32), HYBRID_6.scaled(32)], ids=lambda r: r.name
)
@pytest.mark.parametrize("at_step", [1, 4, 10])
def test_freeing_every_running_request_at_once_matches_the_reference(recipe, at_step) -> None:
    """After the ``at_step``-th step that ends with two or more running: every running
    request (shared prefixes, window groups, partial blocks) freed in one
    ``free_requests`` on the optimized engine and one by one on the reference gives the
    same free queue, ref counts and free count."""
    trace = build_trace(recipe)
    ours = Scheduler(make_engine(trace.layout), trace.layout)
    ref = Scheduler(make_reference_engine(trace.layout), trace.layout)
    steps = 0
    for op in trace.operations:
        ours.apply(op), ref.apply(op)
        steps += isinstance(op, Step) and len(ours.running) >= 2
        if steps == at_step:
            break
    running = list(ours.running)
    assert running == list(ref.running) and len(running) >= 2
    ours.engine.free_requests(running)
    for rid in running:
        ref.engine.free(rid)
    assert ours.engine.free_queue() == ref.engine.free_queue()
    assert ours.engine.ref_counts() == ref.engine.ref_counts()
    assert ours.engine.num_free_blocks() == ref.engine.num_free_blocks()


def test_bench_timer_times_free_requests_once_with_its_clock() -> None:
    """A clock that advances 1.0 per reading: a timed call adds exactly 1.0 (two readings),
    so one ``free_requests`` of two requests counts once, not once per request."""
    ticks = iter(range(1000))
    engine = timed(make_engine(_hand_layout()), clock=lambda: float(next(ticks)))
    _two_sharing(engine)
    before = engine.seconds
    engine.free_requests(["a", "b"])
    assert engine.seconds - before == 1.0
    assert engine.engine.free_queue() == EXPECTED_QUEUE
