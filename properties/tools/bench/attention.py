"""Bench: tokens per second of the paged attention path against the dense reference.

The same steps go through both paths: two requests (prompts of ``prompt_len`` and
``prompt_len * 3 // 4`` tokens) are prefilled in chunks of ``chunk`` tokens, then decoded for
``decode_steps`` steps together, over a layout with a full, a sliding-window and a
chunked-local group. Per group, the paged time covers the K/V writes through the slot mapping
plus the attention through the block table (inputs already tensors on the device); the dense
time covers the float64 pure-Python reference. The content model's vectors are generated (and
memoised) before timing, so neither side pays for them, and a throwaway checker runs the
first step once so that torch's first-call costs are not timed. Outputs are compared as in
:class:`AttentionChecker`, so a bench run is also a check. ``num_threads`` sets torch's CPU
threads (1 avoids spinning threads on a shared machine; ``None`` leaves torch's default).

Example::

    print(format_bench(bench_attention("cpu")))
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from properties.checks.attention import AttentionChecker, ScheduledChunk
from properties.core.engine import RequestInput
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec, cdiv


@dataclass(frozen=True)
class BenchRow:
    """Timing of one group over every step of the bench."""

    group: int
    kind: str
    backend: str
    device: str
    tokens: int
    paged_s: float
    dense_s: float

    @property
    def paged_tokens_per_s(self) -> float:
        return self.tokens / self.paged_s if self.paged_s > 0 else float("inf")

    @property
    def dense_tokens_per_s(self) -> float:
        return self.tokens / self.dense_s if self.dense_s > 0 else float("inf")

    @property
    def speedup(self) -> float:
        return self.dense_s / self.paged_s if self.paged_s > 0 else float("inf")


def bench_layout(block_size: int = 16) -> KVCacheLayout:
    """Full, SWA (w = 4 blocks) and chunked (C = 8 blocks) groups of one block size."""
    bs = block_size
    return KVCacheLayout(
        groups=(
            KVCacheGroup(("full",), FullAttentionSpec(block_size=bs)),
            KVCacheGroup(("swa",), SlidingWindowSpec(block_size=bs, sliding_window=4 * bs)),
            KVCacheGroup(
                ("chunk",), ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=8 * bs)
            ),
        ),
        num_blocks=256,
        max_model_len=1024,
    )


def bench_steps(
    layout: KVCacheLayout, prompt_len: int, chunk: int, decode_steps: int
) -> list[list[ScheduledChunk]]:
    """The scheduled chunks of every step; each request owns fresh, contiguous block ids."""
    lengths = {"r0": prompt_len, "r1": prompt_len * 3 // 4}
    total = {rid: n + decode_steps for rid, n in lengths.items()}
    bs = layout.groups[0].spec.block_size
    next_id = 1
    rows: dict[str, tuple[int, ...]] = {}
    for rid, n in total.items():
        rows[rid] = tuple(range(next_id, next_id + cdiv(n, bs)))
        next_id += cdiv(n, bs)
    tokens = {
        rid: tuple((7 * i + 3 * k) % 1000 for i in range(n))
        for k, (rid, n) in enumerate(total.items())
    }
    steps: list[list[ScheduledChunk]] = []
    done = dict.fromkeys(lengths, 0)
    while any(done[r] < lengths[r] for r in lengths):
        step = []
        for rid, n in lengths.items():
            if done[rid] < n:
                m = min(chunk, n - done[rid])
                step.append(_chunk(rid, tokens[rid], done[rid], m, rows[rid], len(layout.groups)))
                done[rid] += m
        steps.append(step)
    for _ in range(decode_steps):
        steps.append(
            [
                _chunk(rid, tokens[rid], done[rid], 1, rows[rid], len(layout.groups))
                for rid in lengths
            ]
        )
        for rid in lengths:
            done[rid] += 1
    return steps


def _chunk(
    rid: str, tokens: tuple[int, ...], before: int, n: int, row: tuple[int, ...], num_groups: int
) -> ScheduledChunk:
    end = before + n
    return ScheduledChunk(
        RequestInput(rid, tokens[:end]), tokens[:end], before, n, (row,) * num_groups
    )


def bench_attention(
    device: str = "cpu",
    seed: int = 0,
    *,
    prompt_len: int = 192,
    chunk: int = 64,
    decode_steps: int = 16,
    block_size: int = 16,
    num_kv_heads: int = 1,
    head_size: int = 8,
    backend: str = "torch",
    num_threads: int | None = None,
) -> list[BenchRow]:
    """Time the paged path and the dense reference per group over the same steps."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    layout = bench_layout(block_size)
    steps = bench_steps(layout, prompt_len, chunk, decode_steps)
    options = dict(
        device=device, seed=seed, num_kv_heads=num_kv_heads, head_size=head_size, backend=backend
    )
    warmup = AttentionChecker(layout, **options)
    for gid in range(len(layout.groups)):
        warmup.run_group(gid, warmup.prepare_group(gid, steps[0]))
    checker = AttentionChecker(layout, **options)
    _warm(checker, steps)
    paged = [0.0] * len(layout.groups)
    dense = [0.0] * len(layout.groups)
    tokens = 0
    for step in steps:
        tokens += sum(c.num_scheduled for c in step)
        for gid in range(len(layout.groups)):
            inputs = checker.prepare_group(gid, step)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            observed = checker.run_group(gid, inputs)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            expected = checker.dense_outputs(gid, step)
            t2 = time.perf_counter()
            paged[gid] += t1 - t0
            dense[gid] += t2 - t1
            checker.compare(gid, step, expected, observed)
    return [
        BenchRow(gid, g.spec.type_name, backend, device, tokens, paged[gid], dense[gid])
        for gid, g in enumerate(layout.groups)
    ]


def _warm(checker: AttentionChecker, steps: list[list[ScheduledChunk]]) -> None:
    content = checker.content
    for step in steps:
        for c in step:
            hashes = checker.hashes(c)
            for gid in range(len(checker.layout.groups)):
                for p in c.positions:
                    content.key(hashes, p, gid)
                    content.value(hashes, p, gid)
                    content.query(hashes, p, gid)


def format_bench(rows: list[BenchRow]) -> str:
    """A fixed-width table, one line per group."""
    head = (
        f"{'group':<18} {'backend':<7} {'device':<6} {'tokens':>6} {'paged tok/s':>12} "
        f"{'dense tok/s':>12} {'speedup':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{f'g{r.group}:{r.kind}':<18} {r.backend:<7} {r.device:<6} {r.tokens:>6} "
            f"{r.paged_tokens_per_s:>12.0f} {r.dense_tokens_per_s:>12.0f} {r.speedup:>7.1f}x"
        )
    return "\n".join(lines)
