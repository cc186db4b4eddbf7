"""The trace reducer (properties/runner/reduce.py): a saved trace holds no operation whose
removal keeps the failure, and the reduction keeps the first failing check."""

from __future__ import annotations

import dataclasses

from properties.core.engine import load_engine_factory
from properties.core.trace import Arrive, ResetPrefixCache, Step, Trace, load_trace
from properties.mutants.reference_mutants import MUTANT_INFO
from properties.runner.check import run_property
from properties.runner.config import CheckConfig
from properties.runner.profiles import load_profile
from properties.runner.reduce import TraceSize, is_one_minimal, reduce_trace
from properties.runner.run import engine_of, replay_trace
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

FREE_HEAD_FIRST = "properties.mutants.reference_mutants:make_free_head_first"
FULL = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype_bytes=2)


def _fails_the_same(trace: Trace, check: str, config: CheckConfig, factory) -> bool:
    _run, exc = replay_trace(trace, config, engine_of(config, factory))
    return exc is not None and getattr(exc, "name", type(exc).__name__) == check


def test_redundant_operations_requests_tokens_and_blocks_are_removed() -> None:
    # free_head_first puts a finished request's freed blocks at the head of the free
    # queue in table order; vLLM appends them tail first. The order shows once a request
    # frees two full blocks (8 tokens at bs 4) on a pool of 2 usable blocks. Everything
    # else is noise: the resets, one of the two requests (the reducer tries r0 first, so
    # r1 stays), 3 prompt tokens of r1 and 998 blocks. A 5-token prompt also takes 2
    # blocks but its last one is not full, and the queues agree (replayed on both).
    layout = KVCacheLayout(groups=(KVCacheGroup(("l0",), FULL),), num_blocks=1001, max_model_len=64)
    ops = (
        ResetPrefixCache(),
        Arrive("r0", tuple(range(1, 10))),
        ResetPrefixCache(),
        Arrive("r1", tuple(range(20, 31))),
        ResetPrefixCache(),
        Step(64),
        ResetPrefixCache(),
        Step(64),
    )
    config = CheckConfig(engine=FREE_HEAD_FIRST, level="exact")
    factory = load_engine_factory(FREE_HEAD_FIRST)
    reduced, finished = reduce_trace(Trace(layout, ops), "exact_match", config, factory, 60)
    assert finished
    assert reduced.operations == (Arrive("r1", tuple(range(20, 28))), Step(64))
    assert reduced.layout.num_blocks == 3
    assert reduced.failure["property"] == "exact_match"
    assert TraceSize.of(reduced) == TraceSize(operations=2, requests=1, tokens=8, blocks=3)
    assert is_one_minimal(reduced, "exact_match", config, factory) is None


def test_a_trace_that_does_not_fail_comes_back_unchanged() -> None:
    layout = KVCacheLayout(groups=(KVCacheGroup(("l0",), FULL),), num_blocks=9, max_model_len=64)
    trace = Trace(layout, (Arrive("r0", (1, 2)), Step(8)))
    config = CheckConfig(engine="reference", level="exact")
    assert reduce_trace(trace, "exact_match", config, None, 10) == (trace, False)


def test_the_trace_check_saves_is_one_minimal(tmp_path) -> None:
    """``run_property`` (what ``kvconform check`` runs) on a mutant: removing any single
    operation of the saved trace makes it pass or fail with another check."""
    info = MUTANT_INFO["salt_ignored"]
    # a drawn example's shrunk trace (the reach corpus's session case catches the mutant
    # first, and a corpus case is saved as it ran)
    config = CheckConfig(
        engine=info.target, level="universal", failure_dir=str(tmp_path), reach_corpus=False
    )
    result = run_property(
        "invariants", config, load_profile("ci"), None, info.factory, shrink_seconds=10
    )
    assert not result.passed and result.trace_path is not None
    assert result.first is not None and result.first.check in info.caught_by
    saved = load_trace(result.trace_path)
    check = saved.failure["property"]
    assert check == result.first.check  # one bug, one name: the first check that failed
    assert _fails_the_same(saved, check, config, info.factory)
    for i in range(len(saved.operations)):
        fewer = dataclasses.replace(
            saved, operations=saved.operations[:i] + saved.operations[i + 1 :]
        )
        try:
            same = _fails_the_same(fewer, check, config, info.factory)
        except Exception:  # noqa: BLE001 - an invalid trace (an abort of no arrival) is not a failure
            same = False
        assert not same, f"operation {i} of the saved trace can be removed: {saved.operations[i]!r}"
