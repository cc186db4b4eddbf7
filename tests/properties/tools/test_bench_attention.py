"""The attention bench runs, checks, and counts the scheduled tokens of every step."""

from __future__ import annotations

from properties.tools.bench.attention import (
    bench_attention,
    bench_layout,
    bench_steps,
    format_bench,
)


def test_bench_steps_schedule_prefill_chunks_then_decode() -> None:
    steps = bench_steps(bench_layout(4), prompt_len=16, chunk=8, decode_steps=2)
    # r0: 16 tokens in chunks 8, 8; r1: 12 tokens in 8, 4; then two decode steps of 1 each.
    assert [
        [(c.request.request_id, c.num_computed_before, c.num_scheduled) for c in s] for s in steps
    ] == [
        [("r0", 0, 8), ("r1", 0, 8)],
        [("r0", 8, 8), ("r1", 8, 4)],
        [("r0", 16, 1), ("r1", 12, 1)],
        [("r0", 17, 1), ("r1", 13, 1)],
    ]


def test_bench_rows_and_format() -> None:
    rows = bench_attention("cpu", prompt_len=16, chunk=8, decode_steps=2, block_size=4)
    assert [r.kind for r in rows] == ["full", "sliding_window", "chunked_local"]
    assert all(r.tokens == 16 + 12 + 2 * 2 for r in rows)
    assert all(r.paged_s > 0 and r.dense_s > 0 for r in rows)
    text = format_bench(rows)
    assert "g1:sliding_window" in text and "paged tok/s" in text
