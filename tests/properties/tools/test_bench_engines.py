"""Engine bench: recorded traces (deterministic, cached, drained), rows, ratios, table.

Only the reference engine runs here, on traces shrunk with ``scale=32``; no timing is
asserted, only how the rows are put together from what was measured.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from properties.core.trace import Arrive, Step, load_trace
from properties.engines.reference import make_engine
from properties.runner.scheduler import Scheduler
from properties.tools.bench.engines import (
    DECODE_HEAVY,
    PREFIX_HEAVY,
    BenchError,
    EngineBenchRow,
    bench_engines,
    build_trace,
    engine_mismatches,
    format_engine_bench,
    percentile,
    pool_blocks,
    recorded_traces,
)

SCALE = 32
REF_ALIAS = "properties.engines.reference:make_engine"


@pytest.fixture(scope="module")
def tiny_traces():
    return recorded_traces(scale=SCALE, directory=None)


@pytest.fixture(scope="module")
def tiny_rows(tiny_traces):
    return bench_engines(("reference", REF_ALIAS), tiny_traces)


# -- traces ------------------------------------------------------------------------


def test_recorded_traces_are_deterministic(tiny_traces):
    again = recorded_traces(scale=SCALE, directory=None)
    assert list(again) == ["decode-heavy", "prefix-heavy"]
    assert again == tiny_traces


def test_recorded_traces_are_cached_as_json(tmp_path, tiny_traces):
    first = recorded_traces(scale=SCALE, directory=tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2
    assert files[0].startswith("decode-heavy-") and files[1].startswith("prefix-heavy-")
    assert first == tiny_traces
    assert load_trace(tmp_path / files[0]) == tiny_traces["decode-heavy"]
    # Second use reads the files: an edited file is what comes back.
    path = tmp_path / files[1]
    data = json.loads(path.read_text(encoding="utf-8"))
    data["seed"] = 999
    path.write_text(json.dumps(data), encoding="utf-8")
    second = recorded_traces(scale=SCALE, directory=tmp_path)
    assert second["prefix-heavy"].seed == 999
    assert second["decode-heavy"] == tiny_traces["decode-heavy"]


def test_corrupt_cache_file_is_rebuilt(tmp_path, tiny_traces):
    recorded_traces(scale=SCALE, directory=tmp_path)
    path = next(tmp_path.glob("prefix-heavy-*.json"))
    path.write_text("{not json", encoding="utf-8")
    again = recorded_traces(scale=SCALE, directory=tmp_path)
    assert again["prefix-heavy"] == tiny_traces["prefix-heavy"]
    assert load_trace(path) == tiny_traces["prefix-heavy"]


def test_decode_heavy_shape_at_scale_32(tiny_traces):
    trace = tiny_traces["decode-heavy"]
    arrivals = [op for op in trace.operations if isinstance(op, Arrive)]
    steps = [op for op in trace.operations if isinstance(op, Step)]
    # 256 / 32 = 8 requests of 2048 / 32 = 64 prompt tokens, 24..40 outputs.
    assert len(arrivals) == 8
    assert all(len(a.prompt) == 64 for a in arrivals)
    assert all(24 <= len(a.output) <= 40 for a in arrivals)
    assert {s.token_budget for s in steps} == {256}
    # gemma3: 5 sliding groups (w = 1024 // 32 = 32) + 1 full group, bs 16.
    windows = [getattr(g.spec, "sliding_window", None) for g in trace.layout.groups]
    assert windows == [32, 32, 32, 32, 32, None]
    assert trace.layout.max_model_len == 128


def test_prefix_heavy_prompts_share_few_system_prompts(tiny_traces):
    trace = tiny_traces["prefix-heavy"]
    arrivals = [op for op in trace.operations if isinstance(op, Arrive)]
    assert len(arrivals) == 8
    # 1024 // 32 = 32-token system prompts, suffixes of 64 // 32 .. 256 // 32 = 2..8 tokens.
    assert all(34 <= len(a.prompt) <= 40 for a in arrivals)
    assert len({a.prompt[:32] for a in arrivals}) <= 4
    assert len({a.prompt[:32] for a in arrivals}) < len(arrivals)
    assert {op.token_budget for op in trace.operations if isinstance(op, Step)} == {128}
    windows = [getattr(g.spec, "sliding_window", None) for g in trace.layout.groups]
    assert windows == [4, None]  # gpt-oss: w = 128 // 32


@pytest.mark.parametrize("name", ["decode-heavy", "prefix-heavy"])
def test_traces_end_with_a_minimal_drain(tiny_traces, name):
    """Replayed on the reference every request finishes, and not one step earlier."""
    trace = tiny_traces[name]
    ops = trace.operations
    assert isinstance(ops[-1], Step)
    full = Scheduler(make_engine(trace.layout), trace.layout)
    for op in ops:
        full.apply(op)
    assert full.is_idle()
    assert len(full.finished) == 8
    short = Scheduler(make_engine(trace.layout), trace.layout)
    for op in ops[:-1]:
        short.apply(op)
    assert not short.is_idle()


def test_arrivals_come_a_few_at_a_time_between_steps(tiny_traces):
    ops = tiny_traces["decode-heavy"].operations
    run = 0
    runs = []
    for op in ops:
        if isinstance(op, Arrive):
            run += 1
        elif run:
            runs.append(run)
            run = 0
    assert sum(runs) == 8
    assert all(1 <= r <= 4 for r in runs)
    assert len(runs) >= 2


def test_pool_blocks_worked_example():
    # decode-heavy (see the docstring): 1 + 32 * (5 * 65 + 131) + 4 * (6 * 128 - 456).
    assert pool_blocks(DECODE_HEAVY) == 15841
    # prefix-heavy, gpt-oss bs 16, P = 1280, T = 1300: full cdiv(1300, 16) = 82, sliding
    # min(82, cdiv(127, 16) + 1) = 9 -> steady 91; peak 2 * 80 = 160; prefills cdiv(4096,
    # 1280) = 4 -> 1 + 32 * 91 + 4 * 69 = 3189.
    assert pool_blocks(PREFIX_HEAVY) == 3189


def test_bad_scale_is_a_clear_error():
    with pytest.raises(BenchError, match="scale must be an integer >= 1, got 0"):
        recorded_traces(scale=0, directory=None)


def test_build_trace_is_deterministic_for_one_recipe():
    recipe = PREFIX_HEAVY.scaled(64)
    assert build_trace(recipe) == build_trace(recipe)


# -- rows and ratios -----------------------------------------------------------------


def test_one_row_per_trace_and_engine(tiny_rows):
    assert [(r.trace, r.engine) for r in tiny_rows] == [
        ("decode-heavy", "reference"),
        ("decode-heavy", REF_ALIAS),
        ("prefix-heavy", "reference"),
        ("prefix-heavy", REF_ALIAS),
    ]
    assert all(r.ok for r in tiny_rows)


def test_ratios_come_from_the_measured_totals(tiny_rows):
    for base, other in (tiny_rows[0:2], tiny_rows[2:4]):
        assert base.ratio == 1.0
        assert other.ratio == pytest.approx(other.total_s / base.total_s)
    for row in tiny_rows:
        assert row.mean_ms == pytest.approx(1000 * row.total_s / row.steps)
        assert row.p50_ms <= row.p99_ms
        assert row.total_s > 0


def test_counters_match_the_trace(tiny_traces, tiny_rows):
    for row in tiny_rows:
        trace = tiny_traces[row.trace]
        assert row.steps == sum(isinstance(op, Step) for op in trace.operations)
        assert row.finished == 8
    # The same engine twice: every sanity counter agrees, so no warning.
    assert engine_mismatches(tiny_rows) == []
    # prefix-heavy shares system prompts: some hits; decode-heavy prompts are random.
    assert tiny_rows[0].hit_tokens == 0
    assert tiny_rows[2].hit_tokens > 0


def test_repeat_keeps_one_row_per_engine(tiny_traces):
    rows = bench_engines(("reference",), {"prefix-heavy": tiny_traces["prefix-heavy"]}, repeat=2)
    assert len(rows) == 1 and rows[0].ok and rows[0].ratio == 1.0


def test_bad_repeat_and_engines_are_clear_errors(tiny_traces):
    with pytest.raises(BenchError, match="repeat must be an integer >= 1, got 0"):
        bench_engines(("reference",), tiny_traces, repeat=0)
    with pytest.raises(BenchError, match="engines must name at least one engine"):
        bench_engines((), tiny_traces)


def test_missing_module_gives_a_not_installed_row(tiny_traces):
    one = {"prefix-heavy": tiny_traces["prefix-heavy"]}
    rows = bench_engines(("reference", "kvconform_no_such_module:make_engine"), one)
    assert rows[1].status.startswith("not installed: ")
    assert rows[1].total_s is None and rows[1].ratio is None
    assert "not installed" in format_engine_bench(rows)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is importable")
def test_vllm_without_vllm_says_how_to_install(tiny_traces):
    rows = bench_engines(("reference", "vllm"), {"prefix-heavy": tiny_traces["prefix-heavy"]})
    assert rows[1].status == "not installed: run ci/engines/vllm"


# -- helpers and table -------------------------------------------------------------


def test_percentile_nearest_rank():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 50) == 50.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(BenchError, match="empty"):
        percentile([], 50)


def _row(trace: str, engine: str, total: float, hits: int) -> EngineBenchRow:
    return EngineBenchRow(trace, engine, "ok", 10, 9, hits, 0, 4, 100 * total, 1.0, 2.0, total)


def test_mismatch_warning_names_the_counter():
    rows = [_row("t", "reference", 2.0, 2048), _row("t", "vllm", 3.0, 1024)]
    assert engine_mismatches(rows) == ["WARNING: t: vllm hit_tokens 1024 != reference 2048"]
    assert format_engine_bench(rows).splitlines()[-1].startswith("WARNING: t: vllm")


def test_table_is_aligned_with_one_line_per_row():
    rows = [
        _row("decode-heavy", "reference", 2.0, 0),
        EngineBenchRow("decode-heavy", "vllm", "not installed: run ci/engines/vllm"),
    ]
    lines = format_engine_bench(rows).splitlines()
    assert len(lines) == 3
    assert lines[0].split()[:2] == ["trace", "engine"]
    # Right-aligned numeric columns: "total s" ends at the same column on every line.
    end = lines[0].index("total s") + len("total s")
    assert lines[1][:end].endswith("2.000")
    assert lines[2][:end].endswith("-")
    assert lines[2].endswith("not installed: run ci/engines/vllm")
