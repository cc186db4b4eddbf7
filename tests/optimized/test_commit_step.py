"""``commit_step`` (the batched end of a step) against the per-request calls it replaces:
the same trace through the scheduler with and without it must give the same steps and the
same engine state after every step."""

from __future__ import annotations

import pytest

from optimized.control.request import Request, commit_updates
from properties.core.engine import CommitsSteps, StepUpdate
from properties.core.trace import Step
from properties.engines.optimized import make_engine
from properties.engines.reference import make_engine as make_reference_engine
from properties.runner.scheduler import Scheduler
from properties.tools.bench.engines import DECODE_HEAVY, HYBRID_6, PREFIX_HEAVY, build_trace, timed
from reference.request import RequestStatus


def _state(scheduler: Scheduler) -> tuple:
    engine = scheduler.engine
    tables = {rid: engine.get_block_ids(rid) for rid in scheduler.running}
    computed = {rid: s.num_computed_tokens for rid, s in scheduler.requests.items()}
    return tables, computed, engine.num_free_blocks(), engine.free_queue(), engine.ref_counts()


@pytest.mark.parametrize("recipe", [DECODE_HEAVY, PREFIX_HEAVY, HYBRID_6], ids=lambda r: r.name)
def test_commit_step_matches_per_request_calls(recipe) -> None:
    trace = build_trace(recipe.scaled(32))
    batched = Scheduler(make_engine(trace.layout), trace.layout)
    per_request = Scheduler(make_engine(trace.layout), trace.layout)
    per_request.commits = False
    assert batched.commits
    steps = 0
    for op in trace.operations:
        a, b = batched.apply(op), per_request.apply(op)
        if isinstance(op, Step):
            steps += 1
            assert a == b, f"step {steps}"
            assert _state(batched) == _state(per_request), f"after step {steps}"
    assert batched.finished == per_request.finished and batched.finished


def test_commit_step_sets_tokens_and_appends() -> None:
    trace = build_trace(DECODE_HEAVY.scaled(32))
    engine = make_engine(trace.layout)
    scheduler = Scheduler(engine, trace.layout)
    first = next(op for op in trace.operations if not isinstance(op, Step))
    scheduler.apply(first)
    prompt = len(first.prompt)
    engine.commit_step([StepUpdate(first.request_id, prompt, 7)])
    request = engine.requests[first.request_id]
    assert request.num_computed_tokens == prompt
    assert request.num_tokens == prompt + 1
    assert request.all_token_ids[-1] == 7
    engine.commit_step([StepUpdate(first.request_id, 0, None)])
    assert request.num_computed_tokens == 0 and request.num_tokens == prompt + 1


def test_bench_timer_exposes_commit_step_only_when_the_engine_has_it() -> None:
    layout = build_trace(DECODE_HEAVY.scaled(32)).layout
    assert isinstance(timed(make_engine(layout)), CommitsSteps)
    assert not isinstance(timed(make_reference_engine(layout)), CommitsSteps)


def test_commit_updates_writes_in_place_and_hashes_each_completed_block() -> None:
    # H = 4, 5 prompt tokens (1 hash); 3 updates append 9, 3, 3 -> 8 tokens, 2 hashes,
    # the second hash that of a request built with all 8 tokens at once
    req = Request("a", [1, 2, 3, 4, 5], 4)
    assert len(req.block_hashes) == 1
    assert commit_updates({"a": req}, [("a", 5, 9)]) is None
    assert (req.num_computed_tokens, req.num_tokens, len(req.block_hashes)) == (5, 6, 1)
    assert commit_updates({"a": req}, [("a", 6, 3), ("a", 7, 3)]) is None
    assert req.all_token_ids == [1, 2, 3, 4, 5, 9, 3, 3]
    assert req.block_hashes == Request("b", [1, 2, 3, 4, 5, 9, 3, 3], 4).block_hashes
    assert len(req.block_hashes) == 2
    # preemption without a token; an unknown id stops there (earlier updates applied)
    assert commit_updates({"a": req}, [("a", 0, None), ("zz", 1, 1), ("a", 3, 4)]) == "zz"
    assert req.num_computed_tokens == 0 and req.status is RequestStatus.PREEMPTED
    assert req.num_tokens == 8
