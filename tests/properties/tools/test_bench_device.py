"""``kvconform bench device``: the CPU runs the same code path on tiny shapes (no timing is
asserted, only what the run must have done), CUDA runs skip cleanly without a device."""

from __future__ import annotations

import pytest
import torch

from properties.tools.bench.device import (
    DeviceBenchConfig,
    bench_device,
    cuda_missing,
    format_device_bench,
)
from properties.tools.bench.engines import BenchError
from properties.tools.cli import main


def test_cpu_run_uploads_the_hand_counted_entries() -> None:
    # 4 requests of 32, 31, 30, 29 tokens (bs 16); step s schedules position 32 - i + s, so
    # requests 1 and 2 open their third block at timed steps 1 and 2 (request 0 at the
    # warm-up step 0), in the full and the sliding group (w = 128: nothing slides out):
    # 2 entries per step
    config = DeviceBenchConfig(device="cpu", sizes=(4,), context=32, steps=2)
    (row,) = bench_device(config)
    assert (row.requests, row.context, row.device) == (4, 32, "cpu")
    assert row.entries_per_step == 2.0
    assert row.step_ms > 0 and row.table_attn_ms > 0 and row.sdpa_ms > 0
    assert row.flex_ms is not None and row.note == ""
    text = format_device_bench([row])
    assert text.splitlines()[0].split()[:3] == ["requests", "context", "device"]
    assert text.splitlines()[1].split()[:3] == ["4", "32", "cpu"]


def test_bad_config_is_one_line_error() -> None:
    with pytest.raises(BenchError, match="sizes must be integers >= 1"):
        DeviceBenchConfig(sizes=(0,))
    with pytest.raises(BenchError, match="context must be an integer >= 1"):
        DeviceBenchConfig(context=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_bench_skips_cleanly_without_cuda(capsys) -> None:
    assert cuda_missing("cuda") is not None and cuda_missing("cpu") is None
    assert main(["bench", "device"]) == 0
    assert "no CUDA device here, skipped" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_run_uploads_the_hand_counted_entries() -> None:
    config = DeviceBenchConfig(device="cuda", sizes=(4,), context=32, steps=2)
    (row,) = bench_device(config)
    assert row.entries_per_step == 2.0 and row.device.startswith("cuda")
