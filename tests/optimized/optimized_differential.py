"""Drive the reference manager and the optimized one side by side on the same calls.

:class:`Pair` applies every call to both and compares everything observable after each
one: hits (ids and length), new block ids or None, every live request's table, free count,
free-queue order, ref counts and the set of cached ``(block, group, tokens)`` entries.
:func:`layouts` and :func:`run_trace` draw random layouts and scheduler-like traces
(chunked prefill, shared prefixes, salts, LoRA, lookahead, decode, preemption, reset).
"""

from __future__ import annotations

import dataclasses
import random

from hypothesis import assume
from hypothesis import strategies as st

from optimized.control.kv_cache_manager import KVCacheManager as OptimizedManager
from optimized.control.kv_cache_manager import StepItem
from reference.errors import KVConformError
from reference.kv_cache_manager import KVCacheManager as ReferenceManager
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)


@st.composite
def layouts(draw) -> KVCacheLayout:
    num_groups = draw(st.integers(1, 4))
    groups = []
    for gid in range(num_groups):
        kind = draw(st.sampled_from(["full", "swa", "chunked", "mamba"]))
        bs = draw(st.sampled_from([1, 2, 4, 8]))
        if kind == "full":
            spec = FullAttentionSpec(block_size=bs)
        elif kind == "swa":
            spec = SlidingWindowSpec(block_size=bs, sliding_window=draw(st.integers(1, 24)))
        elif kind == "chunked":
            spec = ChunkedLocalAttentionSpec(
                block_size=bs, attention_chunk_size=draw(st.integers(1, 24))
            )
        else:
            spec = MambaSpec(block_size=bs)
        groups.append(KVCacheGroup((f"l{gid}",), spec))
    # retention: dense (None), sparse (0) or an interval of 1..3 scheduler blocks; a value
    # the layout rejects (an interval without a sliding-window or Mamba group) is dropped
    retention = draw(st.sampled_from([None, 0, 1, 2, 3]))
    try:
        layout = KVCacheLayout(
            tuple(groups),
            num_blocks=draw(st.integers(4, 80)),
            max_model_len=draw(st.sampled_from([64, 96, 128])),
            enable_caching=draw(st.booleans()),
        )
        if retention is not None:
            interval = retention * layout.scheduler_block_size
            layout = dataclasses.replace(layout, prefix_cache_retention_interval=interval)
    except KVConformError:
        assume(False)
    return layout


class Divergence(AssertionError):
    pass


class Pair:
    """The two managers and the two request objects of each id."""

    def __init__(
        self,
        layout: KVCacheLayout,
        min_batched_apply: int | None = None,
        columns: bool = False,
        compiled: bool = False,
    ) -> None:
        self.layout = layout
        #: batched steps go to the optimized manager as columns (``schedule_columns``, the
        #: adapter's call, which sets quiet decode items aside) instead of ``StepItem``\ s
        self.columns = columns
        self.ref = ReferenceManager(layout)
        #: ``compiled``: the loud decode items through the compiled pass (numba), else
        #: through the Python paths these tests pin
        self.opt = OptimizedManager(layout, max_num_reqs=2, compiled=compiled)
        if min_batched_apply is not None:
            # 0: every decode step with work goes through the vectorised apply
            self.opt.min_batched_apply = min_batched_apply
        self.ref_reqs: dict = {}
        self.opt_reqs: dict = {}
        self.held: set[str] = set()

    def same(self, what: str, expected, observed) -> None:
        if expected != observed:
            raise Divergence(f"{what}: reference {expected!r}, optimized {observed!r}")

    def add(self, rid: str, prompt, salt=None, lora=None) -> None:
        self.ref_reqs[rid] = self.ref.make_request(rid, prompt, salt, lora)
        self.opt_reqs[rid] = self.opt.make_request(rid, prompt, salt, lora)

    def lookup(self, rid: str):
        rc, rn = self.ref.get_computed_blocks(self.ref_reqs[rid])
        oc, on = self.opt.get_computed_blocks(self.opt_reqs[rid])
        self.same(f"hit of {rid}", (rc.block_ids(), rn), (oc.block_ids(), on))
        return (rc, rn), (oc, on)

    def allocate(self, rid: str, new: int, hit=None, lookahead: int = 0):
        (rc, rn), (oc, on) = hit if hit is not None else ((None, 0), (None, 0))
        r = self.ref.allocate_slots(self.ref_reqs[rid], new, rn, rc, lookahead)
        o = self.opt.allocate_slots(self.opt_reqs[rid], new, on, oc, lookahead)
        r_ids = None if r is None else [[b.block_id for b in g] for g in r]
        self.same(f"allocate_slots({rid}, {new}, hit {rn}, la {lookahead})", r_ids, o)
        if r is not None:
            self.held.add(rid)
        self.check_state()
        return r_ids

    def step(self, batch) -> list:
        """``batch``: (rid, new, lookahead); reference per request, optimized batched."""
        r_out = []
        for rid, new, la in batch:
            r = self.ref.allocate_slots(self.ref_reqs[rid], new, 0, None, la)
            r_out.append(None if r is None else [[b.block_id for b in g] for g in r])
            if r is None:
                break  # schedule_step stops after the first None
            self.held.add(rid)
        if self.columns:
            opt = self.opt.schedule_columns(
                [self.opt_reqs[rid] for rid, _, _ in batch],
                [new for _, new, _ in batch],
                [la for _, _, la in batch],
            )
        else:
            items = [StepItem(self.opt_reqs[rid], new, 0, None, la) for rid, new, la in batch]
            opt = self.opt.schedule_step(items)
        o_out = [None if r is None else [list(g) for g in r] for r in opt]
        self.same("schedule_step results", r_out, o_out)
        self.check_state()
        return r_out

    def set_computed(self, rid: str, n: int) -> None:
        self.ref_reqs[rid].num_computed_tokens = n
        self.opt_reqs[rid].num_computed_tokens = n

    def append(self, rid: str, tokens) -> None:
        self.ref_reqs[rid].append_output_token_ids(tokens)
        self.opt_reqs[rid].append_output_token_ids(tokens)

    def free(self, rid: str) -> None:
        self.ref.free(self.ref_reqs[rid])
        self.opt.free(self.opt_reqs[rid])
        self.held.discard(rid)
        self.check_state()

    def new_step(self) -> None:
        self.ref.new_step_starts()
        self.opt.new_step_starts()

    def reset(self) -> None:
        self.same(
            "reset_prefix_cache", self.ref.reset_prefix_cache(), self.opt.reset_prefix_cache()
        )
        self.check_state()

    def check_state(self) -> None:
        self.same("free count", self.ref.get_num_free_blocks(), self.opt.get_num_free_blocks())
        self.same(
            "free queue",
            self.ref.block_pool.free_block_queue.block_ids(),
            self.opt.block_pool.free_block_queue.block_ids(),
        )
        self.same("ref counts", self.ref.block_pool.ref_counts(), self.opt.block_pool.ref_counts())
        ref_cached = sorted(
            (b.block_id, int.from_bytes(k[-4:], "big"), b.num_cached_tokens)
            for k, entries in self.ref.block_pool.cached.items()
            for b in entries.values()
        )
        self.same("cached blocks", ref_cached, sorted(self.opt.block_pool.cached_block_entries()))
        for rid in sorted(self.ref_reqs):
            self.same(f"table of {rid}", self.ref.get_block_ids(rid), self.opt.get_block_ids(rid))
        self.check_thresholds()

    def check_thresholds(self) -> None:
        """Each held row's decode threshold is a lower bound of the first count at which a
        group has work (:meth:`~optimized.control.managers.base.SingleTypeKVCacheManager.
        decode_work_threshold_of`, least over the classes): a higher one would settle a
        loud item as quiet."""
        opt = self.opt
        managers = opt.coordinator.managers
        for rid, row in opt.coordinator.row_of.items():
            if row >= len(opt._next_work):
                continue
            least = min(managers[g].decode_work_threshold_of(row) for g in opt._class_reps)
            if opt._next_work[row] > least:
                raise Divergence(
                    f"decode threshold of {rid} (row {row}): {opt._next_work[row]} above "
                    f"the rows' counts' {least}"
                )


def run_trace(
    pair: Pair, seed: int, num_steps: int, batched: bool, plain_decode: bool = False
) -> dict:
    """A scheduler-like random trace; returns counters (steps, hits, preemptions).
    ``plain_decode``: every running request gets one new token and no lookahead per step
    (a plain decode step, prefill chunks of one token included)."""
    rng = random.Random(seed)
    layout = pair.layout
    mml = layout.max_model_len
    prefixes = [[rng.randrange(6) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    waiting: list[str] = []
    running: list[str] = []
    counts = {"hits": 0, "preemptions": 0, "steps": 0}
    next_id = 0
    for _ in range(num_steps):
        counts["steps"] += 1
        pair.new_step()
        for _ in range(rng.randrange(3)):
            prompt = list(rng.choice(prefixes)) + [
                rng.randrange(6) for _ in range(rng.randrange(8))
            ]
            prompt = prompt[: mml - 8] or [1]
            rid = f"r{next_id}"
            next_id += 1
            salt = rng.choice([None, None, "s"])
            lora = rng.choice([None, None, "a"])
            pair.add(rid, prompt, salt, lora)
            waiting.append(rid)
        if rng.random() < 0.05 and not running:
            pair.reset()
        # running requests: decode (batched or not)
        batch = []
        for rid in list(running):
            req = pair.ref_reqs[rid]
            if req.num_tokens >= mml - 1 or rng.random() < 0.08:
                pair.free(rid)
                running.remove(rid)
                continue
            if req.num_computed_tokens == req.num_tokens:
                tok = [rng.randrange(6)]
                pair.append(rid, tok)
            remaining = req.num_tokens - req.num_computed_tokens
            new = min(remaining, rng.choice([1, 1, 1, 2, 5]))
            la = rng.choice([0, 0, 0, 2])
            if plain_decode:
                new, la = 1, 0
            batch.append((rid, new, la))
        if batched and batch:
            out = pair.step(batch)
            while len(out) < len(batch):  # stopped at a None: the rest in a new batch
                out += pair.step(batch[len(out) :])
        else:
            out = [pair.allocate(rid, new, None, la) for rid, new, la in batch]
        for (rid, new, _), res in zip(batch, out):
            if res is None:
                # preempt it
                pair.free(rid)
                pair.set_computed(rid, 0)
                running.remove(rid)
                waiting.append(rid)
                counts["preemptions"] += 1
            else:
                pair.set_computed(rid, pair.ref_reqs[rid].num_computed_tokens + new)
        # admit waiting requests
        for rid in list(waiting)[:2]:
            hit = pair.lookup(rid)
            num_hit = hit[0][1]
            req = pair.ref_reqs[rid]
            remaining = req.num_tokens - num_hit
            new = min(remaining, rng.choice([remaining, 4, 9]))
            if new == 0 and num_hit == 0:
                continue
            res = pair.allocate(rid, new, hit if num_hit else None, rng.choice([0, 0, 3]))
            if res is None:
                if rng.random() < 0.5:
                    pair.free(rid) if rid in pair.held else None
                continue
            counts["hits"] += num_hit
            pair.set_computed(rid, num_hit + new)
            waiting.remove(rid)
            running.append(rid)
    return counts
