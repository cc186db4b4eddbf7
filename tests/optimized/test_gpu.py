"""The paged path on CUDA agrees with the dense reference (skips without a CUDA device)."""

from __future__ import annotations

import pytest
import torch

from properties.checks.attention import AttentionChecker, AttentionMismatch, ScheduledChunk
from properties.tools.bench.attention import bench_attention, bench_layout, bench_steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_bench_steps_check_on_cuda(backend: str) -> None:
    layout = bench_layout(16)
    checker = AttentionChecker(layout, device="cuda", backend=backend)
    for step in bench_steps(layout, prompt_len=96, chunk=32, decode_steps=4):
        checker.check_step(step)
    assert checker.caches[0].key.device.type == "cuda"


def test_null_block_read_is_caught_on_cuda() -> None:
    layout = bench_layout(16)
    checker = AttentionChecker(layout, device="cuda")
    (step,) = bench_steps(layout, prompt_len=32, chunk=32, decode_steps=0)[:1]
    checker.check_step(step)
    c = step[0]
    broken = tuple((0,) + row[1:] if gid == 0 else row for gid, row in enumerate(c.block_ids))
    tokens = c.token_ids + (5,)
    bad = ScheduledChunk(c.request, tokens, len(c.token_ids), 1, broken)
    with pytest.raises(AttentionMismatch, match="group 0"):
        checker.check_step([bad])


def test_bench_runs_on_cuda() -> None:
    rows = bench_attention("cuda", prompt_len=64, chunk=32, decode_steps=2)
    assert [r.kind for r in rows] == ["full", "sliding_window", "chunked_local"]
