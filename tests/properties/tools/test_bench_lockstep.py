"""Realistic traces as a property (issue 18 item 4): every bench trace, at scale 1,
replays in lockstep with the reference at the exact level on the optimized engine (same
hits, new block ids, tables and free counts after every call; the same free-queue order
after every call for the recorded traces, at every step boundary for the scale sweep's),
and ``kvconform bench engines`` exits non-zero when an engine's counters differ from the
reference's.

The replays run the lockstep comparison only (every invariant disabled): the invariants
are O(pool) per call and the bench pools hold 10^4 blocks and more; the generated traces
of ``kvconform check`` run them. The scale sweep's traces (up to 4096 requests, 128k
prompts and pools of 10^6 blocks) compare the free queues (O(pool)) at step boundaries
(``replay_trace(..., at_boundaries=True)``): a sweep trace has 17 steps and up to 4112
calls.
"""

from __future__ import annotations

import pytest

from properties.checks.registry import disabled_all_but
from properties.core.engine import CacheHit, EngineError
from properties.engines.reference import ReferenceEngine
from properties.runner.check import config_for
from properties.runner.config import CheckConfig
from properties.runner.run import engine_of, replay_trace
from properties.tools import cli
from properties.tools.bench.engines import (
    HYBRID_6,
    RECIPES,
    SWEEP_RECIPES,
    TraceRecipe,
    recorded_traces,
)


@pytest.fixture
def lockstep_engine(kv_engine: str) -> str:
    """The engine replayed beside the reference: ``--kv-engine`` (CI's engines step runs
    this module with ``--kv-engine vllm``), the optimized engine when that names the
    reference itself (the default)."""
    return "optimized" if kv_engine == "reference" else kv_engine


def _replay(engine: str, recipe: TraceRecipe, scale: int, at_boundaries: bool = False) -> None:
    config = config_for(
        "invariants",
        CheckConfig(engine=engine, level="exact", disabled=disabled_all_but(()), call_timeout=0),
    )
    trace = recorded_traces(scale=scale, directory=None, recipes=(recipe,))[recipe.name]
    run, exc = replay_trace(trace, config, engine_of(config, None), at_boundaries=at_boundaries)
    assert exc is None, f"{recipe.name} (scale {scale}), operation {len(run.operations) - 1}: {exc}"
    assert len(run.operations) == len(trace.operations)


@pytest.mark.parametrize("recipe", [*RECIPES, HYBRID_6], ids=lambda r: r.name)
def test_recorded_trace_replays_in_lockstep(lockstep_engine: str, recipe: TraceRecipe) -> None:
    _replay(lockstep_engine, recipe, scale=1)


@pytest.mark.parametrize("recipe", SWEEP_RECIPES, ids=lambda r: r.name)
def test_sweep_trace_replays_in_lockstep(lockstep_engine: str, recipe: TraceRecipe) -> None:
    _replay(lockstep_engine, recipe, scale=1, at_boundaries=True)


class NoHitEngine(ReferenceEngine):
    """The reference with no prefix hits (a broken lookup): the bench's hit tokens drop."""

    def get_computed_blocks(self, request_id: str) -> CacheHit:
        hit = CacheHit(tuple(() for _ in self.layout.groups), 0)
        self._hits[request_id] = (hit, self.manager.empty_computed_blocks())
        return hit


def make_no_hit_engine(layout) -> NoHitEngine:
    return NoHitEngine(layout)


def _bench(engines: list[str]) -> int:
    """``kvconform bench engines`` on prefix-heavy at scale 32 (the trace is cached under the
    current directory: the tests run in a temporary one)."""
    return cli.main(
        ["bench", "engines", "--engines", *engines, "--scale", "32", "--traces", "prefix-heavy"]
    )


def test_bench_engines_exits_zero_when_counters_match(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    assert _bench(["reference", "optimized"]) == 0
    assert "WARNING" not in capsys.readouterr().out


def test_bench_engines_exits_non_zero_on_a_counter_mismatch(capsys, monkeypatch, tmp_path) -> None:
    """prefix-heavy at scale 32 shares 4 system prompts of 32 tokens among 8 requests, so
    the reference hits tokens; the engine without hits reports 0."""
    monkeypatch.chdir(tmp_path)
    rc = _bench(["reference", f"{__name__}:make_no_hit_engine"])
    out = capsys.readouterr().out
    assert rc == 1
    assert f"{__name__}:make_no_hit_engine hit_tokens 0 != reference 64" in out


def test_bench_engines_exits_non_zero_when_an_engine_fails(capsys, monkeypatch, tmp_path) -> None:
    """An engine that raises on a trace has no counters to compare: it fails the bench."""
    monkeypatch.chdir(tmp_path)
    rc = _bench(["reference", f"{__name__}:make_failing_engine"])
    out = capsys.readouterr().out
    assert rc == 1
    assert f"WARNING: prefix-heavy: {__name__}:make_failing_engine error: " in out


class FailingEngine(ReferenceEngine):
    """The reference whose ``free`` raises."""

    def free(self, request_id: str) -> None:
        raise EngineError(f"free({request_id!r}) is broken")


def make_failing_engine(layout) -> FailingEngine:
    return FailingEngine(layout)
