"""Power of the attention property: three one-bug engines are caught, the reference is not.

Each buggy engine is the reference adapter with one fault:

(a) ``StaleTableEngine``: its tables keep, per column, the first block id it ever reported
    for a request, so after a preemption the resumed request's table still names blocks the
    manager freed (and handed to another request);
(b) ``UnchainedHashEngine``: block hashes forget the parent, so a block with the same tokens
    but another prefix is a hit;
(c) ``EarlySlidingWindowFreeEngine``: sliding-window blocks are freed one token too early.

A small hand-written scheduling loop drives each engine (arrive, chunked prefill, decode, a
second request sharing tokens, preemption) and calls ``AttentionChecker.check_step`` after
every allocation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest

from properties.checks.attention import AttentionChecker, AttentionMismatch, ScheduledChunk
from properties.core.engine import BlockIds, CacheHit, RequestInput
from properties.engines.reference import ReferenceEngine
from reference.hashing import block_extra_keys, hash_block_tokens
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

# -- the buggy engines -----------------------------------------------------------------------


class StaleTableEngine(ReferenceEngine):
    """(a) A column keeps the first id reported for it, whatever the manager did since."""

    def __init__(self, layout: KVCacheLayout) -> None:
        super().__init__(layout)
        self.seen: dict[str, list[dict[int, int]]] = {}

    def get_block_ids(self, request_id: str) -> BlockIds:
        fresh = super().get_block_ids(request_id)
        seen = self.seen.setdefault(request_id, [{} for _ in fresh])
        out = []
        for memory, row in zip(seen, fresh):
            for col, block in enumerate(row):
                memory.setdefault(col, block)
            out.append(tuple(memory[col] for col in range(len(row))))
        return tuple(out)

    def remove_request(self, request_id: str) -> None:
        super().remove_request(request_id)
        self.seen.pop(request_id, None)


class UnchainedHashEngine(ReferenceEngine):
    """(b) A block's hash covers its own tokens only, not the prefix before it."""

    def _rehash(self, request_id: str) -> None:
        req = self._request(request_id)
        h = req.hash_block_size
        tokens = req.all_token_ids
        req.block_hashes[:] = [
            hash_block_tokens(
                None,
                tokens[j * h : (j + 1) * h],
                block_extra_keys(j * h, (j + 1) * h, req.cache_salt, req.lora_name),
            )
            for j in range(len(tokens) // h)
        ]

    def add_request(self, request: RequestInput) -> None:
        super().add_request(request)
        self._rehash(request.request_id)

    def append_output_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        super().append_output_tokens(request_id, token_ids)
        self._rehash(request_id)


class EarlySlidingWindowFreeEngine(ReferenceEngine):
    """(c) Before each allocation, sliding-window blocks dead one token later are freed."""

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        hit: CacheHit | None = None,
        num_lookahead_tokens: int = 0,
    ) -> BlockIds | None:
        computed = self._request(request_id).num_computed_tokens + num_new_computed_tokens
        for manager in self.manager.coordinator.managers:
            if isinstance(manager.spec, SlidingWindowSpec) and manager.req_to_blocks.get(
                request_id
            ):
                manager.remove_skipped_blocks(request_id, computed + 1)
        return super().allocate_slots(
            request_id, num_new_tokens, num_new_computed_tokens, hit, num_lookahead_tokens
        )


# -- a small scheduling loop -----------------------------------------------------------------


@dataclass
class Running:
    request: RequestInput
    tokens: list[int]
    computed: int = 0
    allocated: bool = False


@dataclass
class Loop:
    """Arrive, schedule chunks (a first allocation adopts the prefix hit), decode, preempt."""

    engine: ReferenceEngine
    checker: AttentionChecker
    live: dict[str, Running] = field(default_factory=dict)

    def arrive(self, rid: str, prompt: Sequence[int]) -> None:
        request = RequestInput(rid, tuple(prompt))
        self.engine.add_request(request)
        self.live[rid] = Running(request, list(prompt))

    def step(self, work: dict[str, int]) -> None:
        """One scheduler step: ``work[rid]`` tokens at most for each request."""
        self.engine.new_step()
        chunks = []
        for rid, n in work.items():
            r = self.live[rid]
            if r.computed == len(r.tokens):  # prefill done: the sampled token joins
                token = 1000 + 7 * len(r.tokens) + len(rid)
                self.engine.append_output_tokens(rid, [token])
                r.tokens.append(token)
            if r.allocated:
                n = min(n, len(r.tokens) - r.computed)
                blocks = self.engine.allocate_slots(rid, n)
            else:
                hit = self.engine.get_computed_blocks(rid)
                r.computed = hit.num_tokens
                n = min(n, len(r.tokens) - r.computed)
                if hit.num_tokens:
                    blocks = self.engine.allocate_slots(rid, n, hit.num_tokens, hit)
                else:
                    blocks = self.engine.allocate_slots(rid, n)
                r.allocated = True
            assert blocks is not None, f"pool too small for {rid}"
            ids = self.engine.get_block_ids(rid)
            chunks.append(ScheduledChunk(r.request, tuple(r.tokens), r.computed, n, ids))
        self.checker.check_step(chunks)
        for chunk in chunks:
            r = self.live[chunk.request.request_id]
            r.computed = chunk.end
            self.engine.set_num_computed_tokens(chunk.request.request_id, r.computed)

    def decode(self, rids: Sequence[str], times: int) -> None:
        for _ in range(times):
            self.step(dict.fromkeys(rids, 1))

    def preempt(self, rid: str) -> None:
        self.engine.free(rid)
        self.engine.set_num_computed_tokens(rid, 0)
        self.live[rid].computed = 0
        self.live[rid].allocated = False

    def finish(self, rid: str) -> None:
        self.engine.free(rid)
        self.engine.remove_request(rid)
        del self.live[rid]


# -- layouts and scenarios -------------------------------------------------------------------

HYBRID = KVCacheLayout(
    groups=(
        KVCacheGroup(("full",), FullAttentionSpec(block_size=4)),
        KVCacheGroup(("swa",), SlidingWindowSpec(block_size=4, sliding_window=6)),
        KVCacheGroup(("chunk",), ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8)),
        KVCacheGroup(("mamba",), MambaSpec(block_size=4)),
    ),
    num_blocks=80,
    max_model_len=64,
)
SMALL_FULL_SWA = KVCacheLayout(
    groups=(
        KVCacheGroup(("full",), FullAttentionSpec(block_size=4)),
        KVCacheGroup(("swa",), SlidingWindowSpec(block_size=4, sliding_window=6)),
    ),
    num_blocks=15,
    max_model_len=32,
)
SWA_ONLY = KVCacheLayout(
    groups=(KVCacheGroup(("swa",), SlidingWindowSpec(block_size=4, sliding_window=4)),),
    num_blocks=16,
    max_model_len=32,
)


def mixed(loop: Loop) -> None:
    """Chunked prefill, decode, a second request sharing a 12-token prefix, a third later."""
    a = list(range(10, 23))  # 13 tokens
    loop.arrive("a", a)
    loop.step({"a": 8})
    loop.step({"a": 8})
    loop.decode(["a"], 3)
    loop.arrive("b", a[:12] + [90, 91, 92])
    loop.step({"a": 1, "b": 8})
    loop.decode(["a", "b"], 4)
    loop.finish("a")
    loop.arrive("c", list(range(40, 50)))
    loop.step({"b": 1, "c": 6})
    loop.step({"b": 1, "c": 6})
    loop.decode(["b", "c"], 3)


def preemption(loop: Loop) -> None:
    """a runs, is preempted, d arrives, a resumes (its block 2 was evicted: a gets a new one,
    and d's next block is a's old one), both decode. 14 usable blocks make the eviction
    happen."""
    loop.arrive("a", list(range(10, 20)))
    loop.step({"a": 10})
    loop.decode(["a"], 2)
    loop.preempt("a")
    loop.arrive("d", list(range(60, 72)))
    loop.step({"d": 12})
    loop.step({"a": 16, "d": 1})
    loop.decode(["a", "d"], 3)


def other_prefix(loop: Loop) -> None:
    """b shares a's second block of tokens, not its first."""
    loop.arrive("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    loop.step({"a": 10})
    loop.arrive("b", [11, 12, 13, 14, 5, 6, 7, 8, 15, 16])
    loop.step({"a": 1, "b": 10})
    loop.decode(["a", "b"], 2)


Scenario = Callable[[Loop], None]
SCENARIOS: dict[str, tuple[Scenario, KVCacheLayout]] = {
    "mixed": (mixed, HYBRID),
    "preemption": (preemption, SMALL_FULL_SWA),
    "other_prefix": (other_prefix, SWA_ONLY),
}


def run(engine_cls: type[ReferenceEngine], scenario: str) -> None:
    drive, layout = SCENARIOS[scenario]
    drive(Loop(engine_cls(layout), AttentionChecker(layout)))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_reference_engine_passes(scenario: str) -> None:
    run(ReferenceEngine, scenario)


@pytest.mark.parametrize(
    ("engine_cls", "scenario", "message"),
    [
        (StaleTableEngine, "preemption", r"request 'a', group 0 \(full\), position 8"),
        (UnchainedHashEngine, "other_prefix", r"request 'b', group 0 \(sliding_window\)"),
        (EarlySlidingWindowFreeEngine, "mixed", r"group 1 \(sliding_window\).*nan"),
    ],
    ids=["stale_table", "unchained_hash", "early_swa_free"],
)
def test_buggy_engine_is_caught(
    engine_cls: type[ReferenceEngine], scenario: str, message: str
) -> None:
    with pytest.raises(AttentionMismatch, match=message):
        run(engine_cls, scenario)
