"""Bench engines ``--hotspots``: the engine's time per function, split by decode and prefill.

The reference engine runs under a fake clock that only two marker functions advance: the
lookup marker (called by every ``get_computed_blocks``) by 3 ticks, the free marker (by
every ``free``) by 5. cProfile reads the same clock, so each marker's self time is known
exactly from its calls, and where it lands (decode or prefill) from when the scheduler
makes those calls: lookups admit prompts (prefill steps), frees end requests (in this
trace, all in the last decode step).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from properties.core.proxy import EngineProxy
from properties.engines.reference import make_engine as make_reference
from properties.tools.bench.engines import (
    BenchError,
    EngineBenchRow,
    bench_engines,
    build_trace,
    replay_timed,
    sweep_recipe,
)
from properties.tools.bench.hotspots import (
    FunctionTime,
    Hotspot,
    format_hotspots,
    function_label,
    hotspots,
)
from properties.tools.cli import main

LOOKUP_TICKS = 3
FREE_TICKS = 5
NUM_REQUESTS = 8


class FakeClock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> float:
        return float(self.now)


CLOCK = FakeClock()


def lookup_marker() -> None:
    CLOCK.now += LOOKUP_TICKS


def free_marker() -> None:
    CLOCK.now += FREE_TICKS


class MarkedEngine(EngineProxy):
    """The reference engine, its lookups and frees each calling a marker function."""

    def get_computed_blocks(self, request_id):
        lookup_marker()
        return super().get_computed_blocks(request_id)

    def free(self, request_id):
        free_marker()
        return super().free(request_id)


LOOKUP = function_label(lookup_marker.__code__)
FREE = function_label(free_marker.__code__)


@pytest.fixture(scope="module")
def profiled():
    trace = build_trace(sweep_recipe(NUM_REQUESTS, 64))
    engine = MarkedEngine(make_reference(trace.layout))
    return replay_timed(engine, trace, CLOCK, functions=True)


def _by_name(times: tuple[FunctionTime, ...]) -> dict[str, FunctionTime]:
    return {t.function: t for t in times}


def test_lookups_are_charged_to_the_prefill_steps(profiled) -> None:
    prefill = _by_name(profiled.prefill_functions)
    assert prefill[LOOKUP].calls == NUM_REQUESTS  # one admission per prompt
    assert prefill[LOOKUP].self_seconds == LOOKUP_TICKS * NUM_REQUESTS
    assert LOOKUP not in _by_name(profiled.decode_functions)  # nothing waits later


def test_frees_are_charged_to_the_decode_steps(profiled) -> None:
    decode = _by_name(profiled.decode_functions)
    assert decode[FREE].calls == NUM_REQUESTS
    assert decode[FREE].self_seconds == FREE_TICKS * NUM_REQUESTS
    assert FREE not in _by_name(profiled.prefill_functions)


def test_a_caller_holds_its_callees_in_its_cumulative_time(profiled) -> None:
    decode = _by_name(profiled.decode_functions)
    free_calls = [t for name, t in decode.items() if name.endswith("(MarkedEngine.free)")]
    assert len(free_calls) == 1
    assert free_calls[0].self_seconds == 0  # the clock only moves inside the marker
    assert free_calls[0].cumulative_seconds == FREE_TICKS * NUM_REQUESTS


def test_only_the_engine_calls_are_profiled(profiled) -> None:
    names = [t.function for t in profiled.decode_functions + profiled.prefill_functions]
    assert names
    assert not [n for n in names if n.startswith("properties/runner/")]  # the scheduler
    assert not [n for n in names if "replay_timed" in n or "_timed" in n]  # the bench
    assert not [n for n in names if "disable" in n]  # the profiler stopping itself


def test_functions_come_most_self_time_first(profiled) -> None:
    for times in (profiled.decode_functions, profiled.prefill_functions):
        keys = [(-t.self_seconds, t.function) for t in times]
        assert keys == sorted(keys)
    assert profiled.decode_functions[0].function == FREE
    assert profiled.prefill_functions[0].function == LOOKUP


def test_without_functions_the_replay_keeps_no_profile() -> None:
    trace = build_trace(sweep_recipe(4, 64))
    replay = replay_timed(make_reference(trace.layout), trace)
    assert replay.decode_functions == () and replay.prefill_functions == ()


def test_hotspots_are_per_unit_and_cut_at_top() -> None:
    times = (
        FunctionTime("a.py:1(f)", 0.002, 0.005, 40),
        FunctionTime("a.py:9(g)", 0.001, 0.001, 10),
    )
    assert hotspots(times, 100, 1) == (Hotspot("a.py:1(f)", 20.0, 50.0, 0.4),)
    assert [h.function for h in hotspots(times, 100, 5)] == ["a.py:1(f)", "a.py:9(g)"]
    assert hotspots(times, 0, 5) == ()  # no decode step (or no prefill): nothing per unit


def test_labels_name_project_installed_and_built_in_functions() -> None:
    label = function_label(lookup_marker.__code__)
    assert label.startswith("tests/properties/tools/test_bench_hotspots.py:")
    assert label.endswith("(lookup_marker)")
    assert function_label(json.dumps.__code__).startswith("json/__init__.py:")
    # an installed package keeps its own name, even in a virtual environment inside the
    # project
    assert function_label(np.unique.__wrapped__.__code__).startswith("numpy/")
    assert function_label("<built-in method builtins.len>") == "{built-in method builtins.len}"
    text = "{method 'take' of 'numpy.ndarray' objects}"
    assert function_label(text) == text


def _row(engine: str, decode, prefill) -> EngineBenchRow:
    return EngineBenchRow("t", engine, "ok", decode_hotspots=decode, prefill_hotspots=prefill)


def test_format_lists_each_function_of_each_row() -> None:
    rows = [
        _row("a", (Hotspot("x.py:1(f)", 12.0, 30.0, 2.0),), (Hotspot("y.py:2(g)", 4.0, 4.0, 1.0),)),
        _row("b", None, None),  # not profiled: no line
    ]
    lines = format_hotspots(rows).splitlines()
    assert lines[0].split() == [
        "trace",
        "engine",
        "per",
        "self",
        "us",
        "cum",
        "us",
        "calls",
        "function",
    ]
    assert lines[1].split() == ["t", "a", "decode", "12.0", "30.0", "2.00", "x.py:1(f)"]
    assert lines[2].split() == ["t", "a", "prefill", "4.0", "4.0", "1.00", "y.py:2(g)"]
    assert len(lines) == 3
    assert format_hotspots([_row("b", None, None)]) == ""


def test_bench_rows_carry_hotspots_only_when_asked() -> None:
    traces = {"s": build_trace(sweep_recipe(4, 64))}
    (plain,) = bench_engines(("reference",), traces)
    assert plain.decode_hotspots is None and plain.prefill_hotspots is None
    (row,) = bench_engines(("reference",), traces, top_functions=3)
    assert row.ok
    assert row.decode_hotspots and len(row.decode_hotspots) == 3
    assert row.prefill_hotspots and len(row.prefill_hotspots) == 3
    # the profiled replay is not one of the timed ones: the row's figures stay its own
    assert row.steps == plain.steps and row.hit_tokens == plain.hit_tokens
    with pytest.raises(BenchError, match="hotspots must be an integer >= 0, got -1"):
        bench_engines(("reference",), traces, top_functions=-1)


def test_cli_prints_the_hotspots(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)  # (the trace is cached under the current directory)
    argv = "bench engines --engines reference --traces sweep-64x2k --scale 16 --hotspots 2 --cpu"
    code = main(argv.split())
    out = capsys.readouterr().out
    assert code == 0, out
    assert "per function" in out
    lines = [line.split() for line in out.splitlines()]
    assert [line[:3] for line in lines if line[2:3] == ["decode"]] == [
        ["sweep-64x2k", "reference", "decode"]
    ] * 2


def test_cli_refuses_a_negative_count(capsys) -> None:
    code = main(["bench", "engines", "--engines", "reference", "--hotspots", "-1"])
    assert code == 2  # a usage error, before any trace is built
    assert "--hotspots must be >= 0, got -1" in capsys.readouterr().err
