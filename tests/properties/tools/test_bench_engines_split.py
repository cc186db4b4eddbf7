"""Bench engines: the decode / prefill split, speedups over vLLM, the timing proxy, the
6-group hybrid and the scale sweep recipes (reference and optimized engines, tiny traces;
no timing asserted)."""

from __future__ import annotations

from properties.core.engine import PlansSteps
from properties.engines.optimized import make_engine as make_optimized
from properties.engines.reference import make_engine as make_reference
from properties.tools.bench.engines import (
    HYBRID_6,
    SWEEP_RECIPES,
    EngineBenchRow,
    bench_engines,
    build_trace,
    recipe_layout,
    replay_timed,
    sweep_recipe,
    timed,
    with_speedups,
)


def test_sweep_recipe_prefills_everything_in_one_step() -> None:
    r = sweep_recipe(64, 2048)
    assert r.name == "sweep-64x2k"
    assert r.token_budget == 64 * 2048 and r.concurrency == 64
    assert r.arrivals_per_step == (64, 64)
    names = [s.name for s in SWEEP_RECIPES]
    assert names[0] == "sweep-64x2k" and "sweep-4096x2k" in names and "sweep-64x128k" in names


def test_hybrid6_layout_has_six_groups_of_four_kinds() -> None:
    layout = recipe_layout(HYBRID_6.scaled(32))
    kinds = [g.spec.type_name for g in layout.groups]
    assert len(kinds) == 6
    assert set(kinds) == {"full", "sliding_window", "chunked_local", "mamba"}
    assert kinds.count("sliding_window") == 2 and kinds.count("mamba") == 2


def test_replay_splits_decode_and_prefill_steps() -> None:
    trace = build_trace(sweep_recipe(8, 64).scaled(1))
    replay = replay_timed(make_reference(trace.layout), trace)
    # one prefill step (all 8 prompts end in it), then decode steps with all 8 requests
    assert replay.prefills == 8
    assert replay.decode_items == 8 * len(replay.decode_seconds)
    assert len(replay.decode_seconds) >= 15
    assert replay.max_running == 8


def test_timed_engine_keeps_the_batched_capability() -> None:
    trace = build_trace(sweep_recipe(4, 64))
    assert isinstance(timed(make_optimized(trace.layout)), PlansSteps)
    assert not isinstance(timed(make_reference(trace.layout)), PlansSteps)


def test_optimized_matches_reference_counters_on_hybrid6() -> None:
    trace = build_trace(HYBRID_6.scaled(32))
    rows = bench_engines(("reference", "optimized"), {"hybrid-6": trace}, memory=True)
    ref, opt = rows
    assert ref.ok and opt.ok
    for field in ("steps", "busy_steps", "hit_tokens", "preemptions", "finished"):
        assert getattr(ref, field) == getattr(opt, field), field
    assert opt.kib_per_req is not None and opt.kib_per_req > 0


def test_speedups_are_against_the_vllm_row() -> None:
    def row(engine: str, dec: float, pre: float) -> EngineBenchRow:
        return EngineBenchRow("t", engine, "ok", decode_ms=dec, prefill_ms_per_req=pre)

    rows = with_speedups([row("vllm", 2.0, 10.0), row("optimized", 0.1, 1.0)])
    assert rows[1].decode_speedup == 20.0 and rows[1].prefill_speedup == 10.0
    assert rows[0].decode_speedup == 1.0
    alone = with_speedups([row("optimized", 0.1, 1.0)])
    assert alone[0].decode_speedup is None
