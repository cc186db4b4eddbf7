"""The gate drives an engine's batched calls (``commit_step``, ``free_requests``) and
compares them with the reference's per-request calls: a batch that does not equal the
successive calls is caught. The engine is the optimized one, with one batched call
mutated at a time; the per-request calls stay correct, so only the batch can fail.

Scenario (by hand): one full-attention group of block size 4, 16 blocks (15 usable, the
null block 0 aside). ``a`` and ``b`` (5-token prompts, one output token each) are
admitted in one step (2 blocks each: ``a`` 1, 2 and ``b`` 3, 4) and both finish in the
next, so the scheduler frees them together. A table is freed tail first; a block with
no hash (the partial second block) goes to the queue's front, a cached one (the full
first block) to its end. Freed in order ``a`` then ``b``: front 4, 2 (``b``'s last), end
1, 3: ``[4, 2, 5, 6, ..., 15, 1, 3]``; in the wrong order ``[2, 4, 5, ..., 15, 3, 1]``.

For ``commit_step``: ``c`` (7 tokens, outputs 9 and 10) fills its second block with its
first output token; ``d`` then asks for ``c``'s 8 tokens and two more: the reference hits
8 tokens (2 blocks). A commit that drops the output tokens leaves the engine's ``c``
without the token its decode step computes: the engine's own check raises in the next
step (a failure of the gate, ``EngineError``).
"""

from __future__ import annotations

import pytest

from properties.checks.lockstep import LockstepEngine
from properties.checks.registry import PropertyViolation
from properties.core.engine import CommitsSteps, EngineError, FreesInBatch
from properties.core.trace import Arrive, Step
from properties.engines.optimized import make_engine as make_optimized
from properties.engines.reference import make_engine as make_reference
from properties.runner.scheduler import Scheduler
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

LAYOUT = KVCacheLayout(
    groups=(KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),),
    num_blocks=16,
    max_model_len=32,
)
OPS = (Arrive("a", (1, 2, 3, 4, 5), (9,)), Arrive("b", (6, 7, 8, 9, 10), (9,)), Step(16), Step(16))


COMMIT_OPS = (
    Arrive("c", (1, 2, 3, 4, 5, 6, 7), (9, 10)),
    Step(16),
    Step(16),
    Step(16),
    Arrive("d", (1, 2, 3, 4, 5, 6, 7, 9, 11, 12)),
    Step(16),
)


def run(engine, ops=OPS) -> LockstepEngine:
    lockstep = LockstepEngine.around(engine, LAYOUT, make_reference(LAYOUT))
    scheduler = Scheduler(lockstep, LAYOUT)
    for op in ops:
        scheduler.apply(op)
    return lockstep


class Counting:
    """Counts the engine's batched calls (the gate must make them)."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, {"commit_step": 0, "free_requests": 0}
        for name in self.calls:
            setattr(engine, name, self._counted(name, getattr(engine, name)))

    def _counted(self, name, call):
        def counted(*args):
            self.calls[name] += 1
            return call(*args)

        return counted


def test_the_gate_makes_the_batched_calls_and_they_agree() -> None:
    engine = make_optimized(LAYOUT)
    assert isinstance(engine, CommitsSteps) and isinstance(engine, FreesInBatch)
    counting = Counting(engine)
    lockstep = run(engine)
    assert counting.calls == {"commit_step": 2, "free_requests": 1}
    assert engine.free_queue() == [4, 2, *range(5, 16), 1, 3]
    assert [c["call"] for c in lockstep.log if c["call"] == "free"] == ["free", "free"]


def test_a_batched_free_in_the_wrong_order_is_caught() -> None:
    engine = make_optimized(LAYOUT)
    batched = engine.free_requests
    engine.free_requests = lambda ids: batched(list(reversed(ids)))
    with pytest.raises(PropertyViolation) as caught:
        run(engine)
    assert "free_requests(['a', 'b'])" in caught.value.message


def test_a_batched_commit_that_drops_the_output_token_is_caught() -> None:
    engine = make_optimized(LAYOUT)
    batched = engine.commit_step
    engine.commit_step = lambda updates: batched([u._replace(output_token=None) for u in updates])
    run(make_optimized(LAYOUT), COMMIT_OPS)  # the same trace passes unmutated
    with pytest.raises(EngineError, match="exceeds the request's 7 tokens"):
        run(engine, COMMIT_OPS)
