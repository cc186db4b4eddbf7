"""Probe the universal engine properties on the SGLang adapter with a random scheduler.

Run: ``.engines/sglang/bin/python -W ignore findings/sglang/probe_universal.py [seeds]``.

Checked after every call (bs in {1, 2, 4}, both tree cores, w in {2, 3, 4, 5}):

* U1 hit <= num_tokens - 1 and a multiple of the page size;
* U2 for a running request whose next token is ``p``, every page covering the window
  ``[max(0, p-w+1), p]`` is real in both groups and holds that KV, also after a maximal
  tree eviction (full and SWA); no page of any block table is in its pool's free list;
* U3 a returned hit's pages hold the KV of exactly that prefix: a shadow map records,
  for every full and SWA slot, the token prefix whose last token wrote it;
* U4 ``get_computed_blocks`` leaves pool sizes, evictable/protected sizes and every
  request's block table unchanged.
"""

from __future__ import annotations

import random
import sys

from properties.core.engine import RequestInput
from properties.engines.sglang import SGLangEngine
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, SlidingWindowSpec


def layout(page: int, window: int, pages: int) -> KVCacheLayout:
    return KVCacheLayout(
        groups=(
            KVCacheGroup(("f",), FullAttentionSpec(block_size=page)),
            KVCacheGroup(("s",), SlidingWindowSpec(block_size=page, sliding_window=window)),
        ),
        num_blocks=pages + 1,
        max_model_len=64,
    )


class Probe:
    def __init__(self, engine: SGLangEngine, window: int, rng: random.Random) -> None:
        self.e, self.w, self.rng = engine, window, rng
        self.page = engine.config.page_size
        self.full_kv: dict[int, tuple[int, ...]] = {}
        self.swa_kv: dict[int, tuple[int, ...]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.violations: list[str] = []
        self.n = 0

    def snapshot(self) -> tuple:
        a, c = self.e.allocator, self.e.cache
        return (
            a.full_available_size(),
            a.swa_available_size(),
            c.full_evictable_size(),
            c.swa_evictable_size(),
            c.full_protected_size(),
            c.swa_protected_size(),
            tuple(self.e.get_block_ids(r) for r in sorted(self.tokens)),
        )

    def record_writes(self, rid: str, start: int, end: int) -> None:
        """Tokens [start, end) of ``rid`` are computed: their slots now hold that KV."""
        kv = self.e._get(rid).req.kv
        row = self.e.req_to_token_pool.req_to_token[kv.req_pool_idx]
        mapping = self.e.allocator.full_to_swa_index_mapping
        for pos in range(start, end):
            slot = int(row[pos])
            self.full_kv[slot] = tuple(self.tokens[rid][: pos + 1])
            swa = int(mapping[slot])
            if swa:
                self.swa_kv[swa] = tuple(self.tokens[rid][: pos + 1])

    def bad(self, msg: str) -> None:
        self.violations.append(msg)

    def check_hit(self, rid: str) -> int:
        before = self.snapshot()
        hit = self.e.get_computed_blocks(rid)
        if self.snapshot() != before:
            self.bad(f"U4 get_computed_blocks({rid}) changed state")
        toks = self.tokens[rid]
        L = hit.num_tokens
        if len(toks) - 1 < L or L % self.page:
            self.bad(f"U1 hit {L} for {len(toks)} tokens page {self.page}")
        if L:
            full_ids, swa_ids = hit.block_ids
            kv = self.e.cache.path_device_indices(self.e._get(rid).pending.node).tolist()
            mapping = self.e.allocator.full_to_swa_index_mapping
            for pos in range(L):
                if self.full_kv.get(kv[pos]) != tuple(toks[: pos + 1]):
                    self.bad(
                        f"U3 full slot {kv[pos]} at {pos} of hit {L} for {rid} holds "
                        f"{self.full_kv.get(kv[pos])}"
                    )
                    break
            for pos in range(max(0, L - self.w + 1), L):
                swa = int(mapping[kv[pos]])
                if swa == 0 or self.swa_kv.get(swa) != tuple(toks[: pos + 1]):
                    self.bad(f"U3 SWA of position {pos} of hit {L} for {rid}: slot {swa}")
                    break
        return L

    def check_window(self, rid: str) -> None:
        p = self.computed[rid]
        kv = self.e._get(rid).req.kv
        row = self.e.req_to_token_pool.req_to_token[kv.req_pool_idx].tolist()
        full_ids, swa_ids = self.e.get_block_ids(rid)
        for pos in range(max(0, p - self.w + 1), p):
            page_idx = pos // self.page
            if full_ids[page_idx] == 0 or swa_ids[page_idx] == 0:
                self.bad(
                    f"U2 {rid} next token {p}: page {page_idx} of position {pos} is "
                    f"null ({full_ids[page_idx]}, {swa_ids[page_idx]})"
                )
                return
            swa = int(self.e.allocator.full_to_swa_index_mapping[row[pos]])
            if self.swa_kv.get(swa) != tuple(self.tokens[rid][: pos + 1]):
                self.bad(
                    f"U2 {rid} next token {p}: SWA slot {swa} of position {pos} holds "
                    f"{self.swa_kv.get(swa)}"
                )
                return

    def check_tables(self) -> None:
        """No page of a request's block table is in its pool's free list."""
        a = self.e.allocator
        free_full = set(a.full_attn_allocator.get_all_free_pages().tolist())
        free_swa = set(a.swa_attn_allocator.get_all_free_pages().tolist())
        for rid in self.tokens:
            full_ids, swa_ids = self.e.get_block_ids(rid)
            if free_full & set(full_ids) or free_swa & (set(swa_ids) - {0}):
                self.bad(
                    f"U2 {rid} holds free pages: full {free_full & set(full_ids)} "
                    f"swa {free_swa & (set(swa_ids) - {0})}"
                )

    def stress_evict(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.e.cache.evict(EvictParams(num_tokens=10**6, swa_num_tokens=10**6))

    def step(self) -> None:
        e, rng = self.e, self.rng
        r = rng.random()
        if r < 0.3 and len(self.tokens) < 8:
            rid = f"r{self.n}"
            self.n += 1
            base = rng.choice(
                [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 5, 5, 5]]
            )
            prompt = base[: rng.randint(1, len(base))] + [
                rng.randint(20, 23) for _ in range(rng.randint(0, 4))
            ]
            e.add_request(RequestInput(rid, tuple(prompt)))
            self.tokens[rid], self.computed[rid] = list(prompt), 0
            self.waiting.append(rid)
        elif r < 0.5 and self.waiting:
            rid = self.waiting[0]
            L = self.check_hit(rid)
            hit = e.get_computed_blocks(rid)
            chunk = rng.randint(1, len(self.tokens[rid]) - L)
            out = e.allocate_slots(rid, chunk, L, hit if L else None)
            if out is None:
                return
            self.waiting.pop(0)
            e.set_num_computed_tokens(rid, L + chunk)
            self.record_writes(rid, L, L + chunk)
            self.computed[rid] = L + chunk
            self.running.append(rid)
        elif r < 0.85 and self.running:
            rid = rng.choice(self.running)
            c, toks = self.computed[rid], self.tokens[rid]
            if c >= len(toks):
                e.append_output_tokens(rid, [rng.randint(20, 23)])
                toks.append(self.e._get(rid).tokens[-1])
            n = rng.randint(1, len(toks) - c)
            out = e.allocate_slots(rid, n, num_lookahead_tokens=rng.choice([0, 0, 1]))
            if out is None:
                return
            self.check_window(rid)
            self.stress_evict() if rng.random() < 0.3 else None
            self.check_window(rid)
            e.set_num_computed_tokens(rid, c + n)
            self.record_writes(rid, c, c + n)
            self.computed[rid] = c + n
            if len(toks) > 40:
                self.finish(rid)
        elif self.running:
            rid = rng.choice(self.running)
            if rng.random() < 0.3:  # preempt
                e.free(rid)
                e.set_num_computed_tokens(rid, 0)
                self.computed[rid] = 0
                self.running.remove(rid)
                self.waiting.insert(0, rid)
            else:
                self.finish(rid)

    def finish(self, rid: str) -> None:
        self.e.free(rid)
        self.e.remove_request(rid)
        self.running.remove(rid)
        del self.tokens[rid], self.computed[rid]


def main(seeds: int) -> int:
    found: dict[str, str] = {}
    for seed in range(seeds):
        rng = random.Random(seed)
        page, window = rng.choice([1, 2, 4]), rng.choice([2, 3, 4, 5])
        core = rng.choice(["python", "rust"])
        engine = SGLangEngine(layout(page, window, rng.choice([8, 12, 20, 40])), core)
        probe = Probe(engine, window, rng)
        for _ in range(150):
            probe.step()
            probe.check_tables()
            if probe.violations:
                break
        for v in probe.violations[:1]:
            key = v.split()[0]
            found.setdefault(key, f"seed={seed} page={page} w={window} core={core}: {v}")
    for v in found.values():
        print(v)
    print(f"{seeds} seeds, violation kinds: {sorted(found) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 40))
