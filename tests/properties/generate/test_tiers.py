"""Scale tiers and swarm testing (issue 18): bounds of drawn examples, the small tier's
stream unchanged, valid swarm modes, the tier runner and the CLI table."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from hypothesis.internal.constants_ast import _constants_from_source

from properties.core.modes import ServingMode
from properties.core.trace import Arrive, Step, validate_references
from properties.engines.under_test import resolve_engine
from properties.generate import strategies as kvst
from properties.runner.check import PropertyResult, config_for, run_property, tiers_for
from properties.runner.config import CheckConfig
from properties.runner.pairs import Declared, all_pairs, count_pairs, features, pair_status
from properties.runner.profiles import tier_examples
from properties.runner.run import layout_strategy
from properties.runner.tiers import run_tier
from properties.tools.parallel import PropertyTask, large_tier_counts
from reference.errors import KVConformError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import MambaSpec

ROOT = Path(__file__).resolve().parents[3]
FEW = settings(
    max_examples=8,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---------------------------------------------------------------------------
# The small tier draws what it drew before


@st.composite
def _old_layouts(draw, max_len: int = 256) -> KVCacheLayout:
    """``layouts()`` as it was before the tiers (every default), kept as the oracle."""
    num_groups = draw(st.one_of(st.integers(1, 6), st.integers(2, 4)))
    group_kinds = draw(
        st.lists(st.sampled_from(kvst.SPEC_KINDS), min_size=num_groups, max_size=num_groups)
    )
    sizes = draw(kvst.block_size_lists(num_groups))
    hash_size = math.gcd(*sizes)
    sizes = [hash_size if k == "mamba" else s for k, s in zip(group_kinds, sizes)]
    lcm = math.lcm(*sizes)
    if num_groups > 1:
        sizes = [lcm if k == "chunked_local" else s for k, s in zip(group_kinds, sizes)]
    page = 64 * lcm
    groups = tuple(
        KVCacheGroup((f"layer.{i}",), draw(kvst._kind_specs(kind, bs, page)))
        for i, (kind, bs) in enumerate(zip(group_kinds, sizes))
    )
    max_model_len = draw(st.integers(lcm, max(lcm, max_len)))
    sizing = KVCacheLayout(groups=groups, num_blocks=2, max_model_len=max_model_len)
    num_blocks = draw(kvst.pool_sizes(sizing, 5, None))
    return dataclasses.replace(sizing, num_blocks=num_blocks)


def _draws(strategy: st.SearchStrategy, n: int = 30) -> list:
    """The first ``n`` examples of a derandomized run over ``strategy``."""
    seen: list = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None)
    @given(strategy)
    def collect(value) -> None:
        seen.append(value)

    collect()
    return seen


def test_small_tier_layouts_draw_what_the_old_strategy_drew() -> None:
    old = _draws(st.tuples(_old_layouts(128), st.integers(0, 9)))
    new = _draws(st.tuples(kvst.layouts(max_len=128), st.integers(0, 9)))
    assert len(old) == 30
    assert new == old


def test_tier_runner_adds_no_literal_to_the_stream_pool() -> None:
    """Hypothesis mixes the collected literals of kvconform's source into every
    derandomized stream (properties.runner.profiles): the tier runner must add none."""
    constants = _constants_from_source(
        (ROOT / "properties/runner/tiers.py").read_bytes(), limit=True
    )
    assert list(constants.integers) + list(constants.strings) + list(constants.floats) == []


# ---------------------------------------------------------------------------
# Bounds of the tiers


def test_tier_table_holds_the_issue_bounds() -> None:
    medium, production = kvst.TIERS["medium"], kvst.TIERS["production"]
    assert (medium.max_len, medium.max_requests, medium.max_blocks) == (8192, 64, 4096)
    assert medium.min_blocks == 256 and 2048 in medium.token_budgets
    assert (production.max_len, production.max_requests) == (131072, 4096)
    assert (production.min_blocks, production.max_blocks) == (10_000, 100_000)
    assert 1024 in production.window_sizes and 128 in production.window_sizes  # gemma3, gpt-oss
    with pytest.raises(ValueError, match="unknown scale tier 'huge'"):
        kvst.tier("huge")
    with pytest.raises(
        KVConformError, match="--tier must be one of small, medium, offline, production"
    ):
        CheckConfig(tier="huge")
    offline = kvst.TIERS["offline"]
    assert offline.workload == "offline" and medium.workload == "online"
    assert (offline.max_len, offline.max_blocks) == (medium.max_len, medium.max_blocks)
    assert offline.max_requests == 128
    with pytest.raises(ValueError, match="workload must be one of online, offline"):
        dataclasses.replace(medium, workload="batch")


@pytest.mark.parametrize("name", ["medium", "production"])
def test_swarm_layouts_stay_within_the_tier(name: str) -> None:
    scale = kvst.TIERS[name]

    @FEW
    @given(kvst.swarm_layouts(scale))
    def check(layout: KVCacheLayout) -> None:
        assert scale.min_blocks <= layout.num_blocks <= scale.max_blocks
        assert layout.max_model_len <= scale.max_len
        for group in layout.groups:
            if not isinstance(group.spec, MambaSpec):
                lcm = layout.scheduler_block_size
                assert group.spec.block_size in scale.block_sizes + (lcm,)
        if name == "production":
            for spec in layout.specs:
                size = getattr(spec, "sliding_window", None) or getattr(
                    spec, "attention_chunk_size", None
                )
                if size is not None:
                    assert size in kvst.PRESET_WINDOWS

    check()


def test_swarm_layouts_reach_every_group_type_and_pressure() -> None:
    scale = kvst.TIERS["medium"]
    for kind in kvst.SPEC_KINDS:
        found = find(
            kvst.swarm_layouts(scale),
            lambda layout, kind=kind: (
                kind in {s.type_name for s in layout.specs} and len(layout.groups) >= 2
            ),
            settings=settings(max_examples=300, derandomize=True, database=None),
        )
        assert kind in {s.type_name for s in found.specs}
    tight = find(
        kvst.swarm_layouts(scale),
        lambda layout: layout.num_blocks <= 2 * scale.min_blocks,
        settings=settings(max_examples=300, derandomize=True, database=None),
    )
    assert tight.num_blocks <= 512


@pytest.mark.parametrize("name", ["medium", "production"])
def test_tier_operations_are_valid_and_bounded(name: str) -> None:
    scale = kvst.TIERS[name]

    @FEW
    @given(st.data())
    def check(data) -> None:
        layout = data.draw(kvst.swarm_layouts(scale))
        ops = data.draw(kvst.tier_operations(layout, scale))
        validate_references(ops)
        arrivals = [op for op in ops if isinstance(op, Arrive)]
        others = [op for op in ops if not isinstance(op, Arrive)]
        assert 1 <= len(arrivals) <= scale.max_requests
        assert len(others) <= scale.max_steps
        assert all(len(a.prompt) + len(a.output) <= layout.max_model_len for a in arrivals)
        assert all(len(a.prompt) >= 1 for a in arrivals)
        assert all(op.token_budget in scale.token_budgets for op in ops if isinstance(op, Step))

    check()


def test_bulk_arrivals_reach_thousands_of_requests_and_long_prompts() -> None:
    layout = kvst.PRESETS["gemma3"].layout(20_000, 131072)
    ops = kvst.bulk_arrivals(layout, (), 0, 4096, seed=3)
    assert [op.request_id for op in ops[:2]] == ["r0", "r1"] and ops[-1].request_id == "r4095"
    assert max(len(op.prompt) for op in ops) > 8192  # one in 32 is a long document
    assert all(len(op.prompt) + len(op.output) <= 131072 for op in ops)
    assert set().union(*(op.prompt for op in ops)) <= set(range(kvst.VOCAB_SIZE))
    assert kvst.bulk_arrivals(layout, (), 0, 3, seed=3) == ops[:3]  # one seed, one stream


def test_batch_arrivals_are_alike_and_share_a_prefix_one_time_in_two() -> None:
    """A batch: one prompt length and one output length for all; the prompts distinct
    (random tails), or all starting with the same cut of a pool prefix (the whole prompt
    when the cut covers it: one prompt sampled many times)."""
    layout = kvst.PRESETS["gemma3"].layout(20_000, 8192)
    pool = (tuple(range(40)),)
    shared = distinct = 0
    for seed in range(40):
        ops = kvst.bulk_arrivals(layout, pool, 5, 16, seed=seed, batch=True)
        assert [op.request_id for op in ops] == [f"r{i}" for i in range(5, 21)]
        assert len({len(op.prompt) for op in ops}) == 1
        assert len({len(op.output) for op in ops}) == 1
        assert all(len(op.prompt) + len(op.output) <= 8192 for op in ops)
        common = len(os.path.commonprefix([op.prompt for op in ops]))
        if len(ops[0].prompt) - common >= 8:  # random tails of 8 tokens or more differ
            assert len({op.prompt for op in ops}) == 16
        if common >= 2 and ops[0].prompt[:2] == (0, 1):
            shared += 1  # (the pool prefix, or all of it, heads every prompt)
        elif common == 0:
            distinct += 1
    assert shared and distinct


def test_one_batch_in_two_is_documents_past_the_widest_window() -> None:
    """On gemma3 (five windows of 1024 tokens, blocks of 16), a batch of documents has
    distinct prompts (no shared head) of ``1024 + 1 .. 1024 + 8 * 16`` tokens: its first
    decode step drops window blocks held once in every row."""
    layout = kvst.PRESETS["gemma3"].layout(20_000, 8192)
    documents = 0
    for seed in range(40):
        ops = kvst.bulk_arrivals(layout, (tuple(range(40)),), 0, 12, seed=seed, batch=True)
        length = len(ops[0].prompt)
        if 1024 < length <= 1024 + 128 and not os.path.commonprefix([o.prompt for o in ops]):
            documents += 1
            assert len({o.prompt for o in ops}) == 12
    assert 10 <= documents <= 30  # about one in two of 40


def test_widest_reach_and_a_document_that_cannot_fit() -> None:
    """The widest window or chunk of a layout (0 with neither); a document longer than
    it keeps the drawn length when it would not fit ``max_model_len``."""
    assert kvst._widest_reach(kvst.PRESETS["gemma3"].layout(20_000, 8192)) == 1024
    assert kvst._widest_reach(kvst.PRESETS["llama4-scout"].layout(20_000, 16384)) == 8192
    full = KVCacheLayout((KVCacheGroup(("l0",), kvst.FullAttentionSpec(16, 1, 8, 2)),), 64, 512)
    assert kvst._widest_reach(full) == 0
    tight = kvst.PRESETS["gpt-oss"].layout(64, 136)  # window 128, blocks of 16
    rng = random.Random(3)
    # 128 + 1..128 tokens and an output of 8 fit 136 only up to 128 + 0: never
    assert all(kvst._past_the_window(rng, tight, 128, 8, 77) == 77 for _ in range(50))
    roomy = kvst.PRESETS["gpt-oss"].layout(64, 4096)
    lengths = [kvst._past_the_window(rng, roomy, 128, 16, 77) for _ in range(200)]
    assert all(128 < n <= 128 + 128 for n in lengths)
    aligned = [n for n in lengths if n % 16 == 0]  # a whole number of blocks: pops too
    assert 60 <= len(aligned) <= 140 and len(set(aligned)) == 8
    # a window that is not a whole number of blocks (40, blocks of 16): past it all the same
    assert all(40 < kvst._past_the_window(rng, roomy, 40, 16, 77) <= 160 for _ in range(200))


def test_tier_operations_draw_batches() -> None:
    """Some large-tier trace starts with a batch (all its arrivals alike)."""
    scale = kvst.TIERS["medium"]

    def is_batch(ops) -> bool:
        arrivals = [op for op in ops if isinstance(op, Arrive)]
        return len(arrivals) > 2 and len({(len(a.prompt), len(a.output)) for a in arrivals}) == 1

    layout = kvst.PRESETS["gemma3"].layout(4096, 8192)
    ops = find(
        kvst.tier_operations(layout, scale),
        lambda ops: is_batch([op for op in ops if isinstance(op, Arrive)][:3]),
        settings=settings(max_examples=200, derandomize=True, database=None),
    )
    assert is_batch(ops[:3])


def test_offline_operations_one_batch_then_steps_until_done() -> None:
    layout = kvst.PRESETS["gpt-oss"].layout(4096, 8192)  # w 128, blocks of 16
    scale = kvst.TIERS["offline"]
    ops = kvst.offline_batch(layout, scale, (), 12, True, 7, 2048, True)
    arrivals = [op for op in ops if isinstance(op, Arrive)]
    steps = [op for op in ops if isinstance(op, Step)]
    assert len(arrivals) == 12 and ops[:12] == tuple(arrivals)  # all at once, first
    # alike documents past the window: one prompt length beyond 128, one output length
    assert len({len(a.prompt) for a in arrivals}) == 1 and len(arrivals[0].prompt) > 128
    assert len({len(a.output) for a in arrivals}) == 1
    prompt_tokens = 12 * len(arrivals[0].prompt)
    # the budget holds every prompt: one prefill step, then one per output token, plus one
    assert all(s == Step(max(2048, prompt_tokens), 0) for s in steps)
    assert len(steps) == 1 + len(arrivals[0].output) + 1
    validate_references(ops)
    # the tier's budget as drawn: the prompts take ceil(tokens / budget) steps (capped)
    mixed = kvst.offline_batch(layout, scale, (), 40, False, 7, 2048, False)
    prompts = sum(len(op.prompt) for op in mixed if isinstance(op, Arrive))
    longest = max(len(op.output) for op in mixed if isinstance(op, Arrive))
    steps = [op for op in mixed if isinstance(op, Step)]
    assert {s.token_budget for s in steps} == {2048}
    assert len(steps) == min(scale.max_steps, -(-prompts // 2048) + longest + 1)
    # outputs past an online turn's 16 tokens (several block boundaries after the first
    # decode step), never past the offline bound
    assert 16 < longest <= kvst.OFFLINE_OUTPUT


def test_offline_tier_runs_served_models_in_lock_step() -> None:
    """The offline tier's layouts are mostly served models, and some example prefills a
    whole batch in one step, so its decode steps are uniform (every item at one count)."""
    scale = kvst.TIERS["offline"]
    few = settings(max_examples=100, derandomize=True, database=None)
    served = find(
        kvst.offline_layouts(scale),
        lambda layout: (
            len(layout.groups) >= 2 and layout.prefix_cache_retention_interval == 0
        ),  # served: sparse retention
        settings=few,
    )
    assert served.num_blocks <= scale.max_blocks and served.max_model_len <= scale.max_len

    def one_step_batch(ops) -> bool:
        arrivals = [op for op in ops if isinstance(op, Arrive)]
        steps = [op for op in ops if isinstance(op, Step)]
        return (
            len(arrivals) >= 8
            and len({len(a.prompt) for a in arrivals}) == 1
            and steps[0].token_budget >= sum(len(a.prompt) for a in arrivals)
        )

    layout = kvst.PRESETS["gemma3"].layout(4096, 8192)
    ops = find(kvst.offline_operations(layout, scale), one_step_batch, settings=few)
    assert one_step_batch(ops)


# ---------------------------------------------------------------------------
# Swarm modes


@FEW
@given(kvst.swarm_modes())
def test_swarm_modes_are_valid(mode: ServingMode) -> None:
    # constructing the mode ran ServingMode's validity rules; restate them by hand
    assert not (mode.num_draft_tokens and mode.async_scheduling)
    assert mode.external_hits or not mode.async_loads
    assert mode.async_loads or not mode.load_failures


def test_swarm_modes_switch_every_feature_on_and_combine_them() -> None:
    few = settings(max_examples=500, derandomize=True, database=None)
    both = find(kvst.swarm_modes(), lambda m: m.load_failures and m.admission_gate, settings=few)
    assert both.async_loads and both.external_hits
    drafts = find(
        kvst.swarm_modes(), lambda m: m.num_draft_tokens and m.external_hits, settings=few
    )
    assert not drafts.async_scheduling


def test_swarm_mode_levels_by_hand() -> None:
    # (scheduling, gate, drafts, connector level): drafts count only with "drafts"; each
    # connector level adds external hits, then asynchronous loads, then failures
    assert kvst._levelled_mode("sync", False, 2, 0) == ServingMode()
    assert kvst._levelled_mode("async", True, 4, 1) == ServingMode(
        async_scheduling=True, admission_gate=True, external_hits=True
    )
    assert kvst._levelled_mode("drafts", False, 3, 2) == ServingMode(
        num_draft_tokens=3, external_hits=True, async_loads=True
    )
    assert kvst._levelled_mode("async", False, 3, 3) == ServingMode(
        async_scheduling=True, external_hits=True, async_loads=True, load_failures=True
    )


def test_swarm_modes_draw_load_failures_with_every_other_mode_feature() -> None:
    few = settings(max_examples=500, derandomize=True, database=None)
    with_async = find(
        kvst.swarm_modes(), lambda m: m.load_failures and m.async_scheduling, settings=few
    )
    assert with_async.async_loads and with_async.external_hits
    with_drafts = find(
        kvst.swarm_modes(), lambda m: m.load_failures and m.num_draft_tokens, settings=few
    )
    assert not with_drafts.async_scheduling and with_drafts.num_draft_tokens in (2, 3, 4)


@FEW
@given(kvst.swarm_layouts(kvst.TIERS["small"]))
def test_small_tier_swarm_layouts_stay_small(layout: KVCacheLayout) -> None:
    assert layout.max_model_len <= 128 and layout.num_blocks >= 5


def test_small_tier_swarm_layouts_switch_pressure_and_groups_independently() -> None:
    small = kvst.TIERS["small"]
    few = settings(max_examples=500, derandomize=True, database=None)

    def need(layout: KVCacheLayout) -> int:
        return layout.blocks_per_request()

    # pressure: one request of max_model_len fits, two do not
    tight = find(
        kvst.swarm_layouts(small),
        lambda lay: (
            {"chunked_local", "mamba"} <= {s.type_name for s in lay.specs}
            and lay.num_blocks <= 2 * need(lay)
            and need(lay) > 5
        ),
        settings=few,
    )
    assert need(tight) + 1 <= tight.num_blocks <= 2 * need(tight)
    roomy = find(
        kvst.swarm_layouts(small),
        lambda lay: "mamba" in {s.type_name for s in lay.specs} and lay.num_blocks > 2 * need(lay),
        settings=few,
    )
    assert roomy.num_blocks > 2 * need(roomy)


def test_production_draws_reach_every_pair_the_reference_supports() -> None:
    """The small tier's production property draws (its layouts and swarm modes, as the
    machine draws them) reach every pair the reference supports within 600 examples of a
    derandomized stream of the draws alone (consecutive examples of a stream are often
    variants of one another; the ci run's own reach, 200 examples with the rules' draws
    between, is gated in tests/properties/tools/test_rule_coverage.py)."""
    engine = resolve_engine("reference", isolation="none")
    layouts = layout_strategy(config_for("production", CheckConfig()), engine)
    counts: dict[tuple[str, str], int] = {}

    @settings(FEW, max_examples=600)
    @given(st.data())
    def draw(data) -> None:
        layout = data.draw(layouts)
        mode = engine.serving_mode(data.draw(kvst.swarm_modes()), True)
        count_pairs(counts, features(layout, mode))

    draw()
    declared = Declared.of(engine, True)
    missed = [p for p in all_pairs() if pair_status(p, counts, declared) == "MISSED"]
    assert missed == []
    assert counts[("async", "load-failures")] > 0 and counts[("drafts", "external-hits")] > 0


def test_invalid_combinations_are_dropped_by_the_rules() -> None:
    assert kvst._valid_mode(True, False, 3, False, True, True) == ServingMode(async_scheduling=True)
    mamba = kvst.PRESETS["jamba"].layout(64, 128, block_size=4, scale_windows=1)
    mode = ServingMode(num_draft_tokens=2, external_hits=True, async_loads=True)
    assert kvst.mode_for_layout(mode, mamba) == ServingMode()


# ---------------------------------------------------------------------------
# The tier runner and its result


def test_run_tier_medium_on_the_reference() -> None:
    config = CheckConfig(engine="reference", level="exact")
    outcome = run_tier("invariants", config, "medium", settings(FEW, max_examples=2))
    assert outcome.failure is None, outcome.failure
    assert outcome.examples == 2 and outcome.steps >= 2


def test_tiers_for_attention_and_profiles() -> None:
    assert tier_examples("ci") == {"medium": 5, "offline": 4, "production": 2}
    assert tiers_for("attention", {"medium": 5, "production": 3}) == {
        "medium": 2,
        "offline": 0,
        "production": 0,
    }
    assert tiers_for("invariants", {"medium": 5, "production": 3}) == {"medium": 5, "production": 3}
    with pytest.raises(KVConformError, match="--profile must be one of"):
        tier_examples("weekly")


def test_tier_examples_option_replaces_each_named_tiers_count() -> None:
    """``--tier-examples 20``: 20 examples of every large tier the run names (the profile's
    counts otherwise); attention and determinism then scale them as they scale the
    profile's."""
    config = CheckConfig(engine="reference", level="exact")
    assert large_tier_counts(PropertyTask("invariants", config, "ci")) == {
        "medium": 5,
        "offline": 4,
        "production": 2,
    }
    task = PropertyTask("invariants", config, "ci", tiers=("medium",), examples_per_tier=20)
    assert large_tier_counts(task) == {"medium": 20}
    task = PropertyTask("attention", config, "ci", examples_per_tier=21)
    assert tiers_for("attention", large_tier_counts(task)) == {
        "medium": 7,
        "offline": 0,
        "production": 0,
    }


def test_run_property_reports_examples_per_tier() -> None:
    config = CheckConfig(engine="reference", level="exact", tier="medium")
    result = run_property(
        "invariants", config, settings(FEW, max_examples=2), None, tiers={"medium": 2}
    )
    assert isinstance(result, PropertyResult) and result.passed, result.failure
    assert set(result.tiers) == {"medium"}  # a large config.tier runs only that tier
    assert result.tiers["medium"][0] == 2 == result.examples


@pytest.mark.slow
def test_cli_check_prints_the_tiers(tmp_path: Path) -> None:
    """The CLI prints each property's result once, with its tiers (``--max-examples``
    alone runs the small tier only, so the large ones are named)."""
    out = subprocess.run(
        [sys.executable, "-m", "properties.tools.cli", "check", "--engine", "reference",
         "--profile", "dev", "--max-examples", "3", "--only", "invariants",
         "--tiers", "medium,production"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    # each result once: the property's line, then its tiers (examples/steps, time)
    tiers = [line for line in out.stdout.splitlines() if line.startswith("    tiers (")]
    assert len(tiers) == 1, out.stdout
    assert "small " in tiers[0] and "medium " in tiers[0] and "production " in tiers[0]
    assert sum(line.startswith("  invariants   PASS") for line in out.stdout.splitlines()) == 1


def test_max_examples_alone_runs_the_small_tier_only() -> None:
    from properties.tools.options import selected_tiers, tier_counts

    assert selected_tiers(None, "ci") is None  # the profile's tiers
    assert selected_tiers(None, "ci", 5) == ()
    assert selected_tiers("medium", "ci", 5) == ("medium",)
    assert selected_tiers("none", "ci") == ()
    assert tier_counts("ci", ("medium",), 20) == {"medium": 20}


def test_chunks_aligned_rounds_each_chunk_up_to_its_block_size() -> None:
    from reference.specs import ChunkedLocalAttentionSpec, FullAttentionSpec

    def chunked(chunk: int) -> KVCacheGroup:
        spec = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=chunk)
        return KVCacheGroup(("c",), spec)

    full = KVCacheGroup(("f",), FullAttentionSpec(block_size=4))
    for chunk, aligned in ((6, 8), (1, 4), (8, 8), (9, 12)):
        layout = KVCacheLayout(groups=(full, chunked(chunk)), num_blocks=40, max_model_len=64)
        out = kvst._chunks_aligned(layout)
        assert out.groups[0] == full
        assert out.groups[1].spec.attention_chunk_size == aligned


def test_a_tier_that_ran_no_example_is_named_a_warning(capsys) -> None:
    """A large tier whose every drawn layout the engine refused ran 0 examples: the result
    lines say so, since that tier proves nothing (SGLang's production tier did, silently)."""
    from types import SimpleNamespace

    from properties.tools.cli import print_result_line

    result = SimpleNamespace(
        name="invariants", passed=True, failure=None, examples=241, steps=7575, seconds=124.9,
        tiers={"small": (236, 7396, 28.6), "medium": (5, 179, 22.4), "production": (0, 0, 73.9)},
        modes=None, skipped=None, flaky=None, known=None,
    )  # fmt: skip
    print_result_line(result)
    lines = capsys.readouterr().out.splitlines()
    warnings = [line for line in lines if "WARNING" in line]
    assert len(warnings) == 1 and "no example ran at the production tier" in warnings[0]
