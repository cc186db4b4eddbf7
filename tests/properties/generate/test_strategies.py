"""Generators and presets: validity, coverage of every category, hand-written preset shapes."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from properties.core.trace import Abort, Arrive, Preempt, Step, validate_references
from properties.generate.presets import PRESETS, get_preset, hybrid_attention_block_size
from properties.generate.strategies import (
    MAX_BLOCK_SIZE,
    MAX_LCM,
    SPEC_KINDS,
    VOCAB_SIZE,
    WINDOW_CATEGORIES,
    layouts,
    lookaheads,
    operations,
    prefix_pools,
    preset_layouts,
    prompts,
    request_inputs,
    specs,
    window_category,
    windows,
)
from reference.errors import KVConformError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

EXAMPLES = settings(max_examples=200, derandomize=True, database=None, deadline=None)
FEW = settings(max_examples=50, derandomize=True, database=None, deadline=None)
# Coverage checks need an example, not a minimal one: no shrinking keeps them fast.
FIND = settings(max_examples=2000, derandomize=True, database=None, phases=[Phase.generate])
SHRINK = settings(max_examples=200, derandomize=True, database=None)


def find_layout(condition, strategy=None):
    return find(layouts() if strategy is None else strategy, condition, settings=FIND)


def kinds_of(layout: KVCacheLayout) -> list[str]:
    return [s.type_name for s in layout.specs]


def fixed_layout() -> KVCacheLayout:
    """SWA bs 4 + full bs 8: lcm 8, gcd 4."""
    return KVCacheLayout(
        groups=(
            KVCacheGroup(("a",), SlidingWindowSpec(block_size=4, sliding_window=5)),
            KVCacheGroup(("b",), FullAttentionSpec(block_size=8)),
        ),
        num_blocks=40,
        max_model_len=64,
    )


# -- window categories -------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "block_size", "category"),
    [
        (1, 4, "one"),
        (3, 4, "sub_block"),
        (4, 4, "one_block"),
        (6, 4, "non_multiple"),
        (8, 4, "multi_block"),
        (1, 1, "one"),
        (5, 1, "multi_block"),
        (33, 16, "non_multiple"),
    ],
)
def test_window_category_examples(size, block_size, category):
    assert window_category(size, block_size) == category


@pytest.mark.parametrize("category", WINDOW_CATEGORIES)
def test_windows_reach_every_category(category):
    assert (
        window_category(
            find(windows(8), lambda w: window_category(w, 8) == category, settings=FIND), 8
        )
        == category
    )


# -- specs and layouts -------------------------------------------------------------


@EXAMPLES
@given(st.integers(1, MAX_BLOCK_SIZE).flatmap(lambda bs: st.tuples(st.just(bs), specs(bs))))
def test_specs_have_the_requested_block_size(bs_and_spec):
    block_size, spec = bs_and_spec
    assert spec.block_size == block_size
    assert spec.type_name in SPEC_KINDS


@EXAMPLES
@given(layouts())
def test_every_generated_layout_is_valid(layout):
    sizes = layout.block_sizes
    assert 1 <= len(layout.groups) <= 6
    lcm = math.lcm(*sizes)
    for g in layout.groups:
        if g.spec.type_name == "chunked_local" and len(layout.groups) > 1:
            assert g.spec.block_size == lcm  # vLLM's chunked hit search needs it
        else:
            assert 1 <= g.spec.block_size <= MAX_BLOCK_SIZE
    assert lcm <= MAX_LCM
    assert layout.max_model_len >= math.lcm(*sizes)
    assert layout.num_blocks >= 5
    assert not layout.partial_hits_enabled
    for spec in layout.specs:
        if isinstance(spec, MambaSpec):
            assert spec.block_size == math.gcd(*sizes) == layout.hash_block_size
    # Pages are unified, as after vLLM's planning: every group's page is equal.
    assert len({s.page_size_bytes for s in layout.specs}) == 1
    # One full-length request fits in the pool.
    assert layout.num_blocks > layout.blocks_per_request()
    # Rebuilding runs KVCacheLayout's validation again.
    assert dataclasses.replace(layout) == layout


def test_layouts_shrink_to_one_full_group_with_block_size_one():
    layout = find(layouts(), lambda layout: True, settings=SHRINK)
    assert kinds_of(layout) == ["full"]
    assert layout.block_sizes == (1,)
    assert layout.num_blocks == 5


@pytest.mark.parametrize("kind", SPEC_KINDS)
def test_every_kind_occurs(kind):
    assert kind in kinds_of(find_layout(lambda layout: kind in kinds_of(layout)))


@pytest.mark.parametrize("category", WINDOW_CATEGORIES)
def test_sliding_window_categories_all_occur(category):
    def has(layout):
        return any(
            isinstance(s, SlidingWindowSpec)
            and window_category(s.sliding_window, s.block_size) == category
            for s in layout.specs
        )

    assert has(find_layout(has))


@pytest.mark.parametrize("category", WINDOW_CATEGORIES)
def test_chunk_categories_all_occur(category):
    def has(layout):
        return any(
            isinstance(s, ChunkedLocalAttentionSpec)
            and window_category(s.attention_chunk_size, s.block_size) == category
            for s in layout.specs
        )

    assert has(find_layout(has))


def test_group_kinds_interleave():
    layout = find_layout(
        lambda layout: kinds_of(layout)[:3] == ["sliding_window", "full", "sliding_window"]
    )
    assert kinds_of(layout)[:3] == ["sliding_window", "full", "sliding_window"]


def test_six_groups_and_mixed_block_sizes_occur():
    layout = find_layout(
        lambda layout: len(layout.groups) == 6 and len(set(layout.block_sizes)) >= 3
    )
    assert len(layout.groups) == 6
    assert math.lcm(*layout.block_sizes) <= MAX_LCM


def test_mamba_next_to_coarser_attention_gets_the_gcd():
    layout = find_layout(
        lambda layout: (
            "mamba" in kinds_of(layout) and max(layout.block_sizes) > min(layout.block_sizes)
        )
    )
    mamba = [s for s in layout.specs if isinstance(s, MambaSpec)]
    assert all(s.block_size == min(layout.block_sizes) for s in mamba)


def test_tiny_and_roomy_pools_occur():
    tiny = find_layout(lambda layout: layout.num_blocks <= 2 * layout.blocks_per_request() + 2)
    assert tiny.num_blocks <= 2 * tiny.blocks_per_request() + 2
    roomy = find_layout(lambda layout: layout.num_blocks >= 6 * layout.blocks_per_request())
    assert roomy.num_blocks >= 6 * roomy.blocks_per_request()


@FEW
@given(layouts(max_groups=2, max_blocks=50, max_len=32))
def test_layout_bounds_are_respected(layout):
    assert len(layout.groups) <= 2
    assert layout.num_blocks <= 50
    assert layout.max_model_len <= max(32, layout.scheduler_block_size)


def test_bad_layout_arguments():
    with pytest.raises(ValueError, match="max_groups"):
        layouts(max_groups=0).example()
    with pytest.raises(ValueError, match="kinds"):
        layouts(kinds=("mla",)).example()


# -- presets -----------------------------------------------------------------------

# (name, kinds in group order, default block size, layers of the first group); written by
# hand from the spec's grouping rule (section 2.6) and each model's config.
PRESET_SHAPES = [
    ("gemma2", ["sliding_window", "full"], 16, ("layers.0", "layers.2")),
    ("gemma3", ["sliding_window"] * 5 + ["full"], 16, ("layers.0",)),
    ("gpt-oss", ["sliding_window", "full"], 16, ("layers.0", "layers.2")),
    ("mistral-7b", ["sliding_window"], 16, ("layers.0", "layers.1")),
    ("llama4-scout", ["chunked_local"] * 3 + ["full"], 16, ("layers.0",)),
    ("jamba", ["mamba"] * 7 + ["full"], 80, ("layers.0",)),
    ("qwen3-next", ["mamba"] * 3 + ["full"], 544, ("layers.0",)),
]


@pytest.mark.parametrize(("name", "kinds", "block_size", "first_layers"), PRESET_SHAPES)
def test_presets_build_with_documented_groups(name, kinds, block_size, first_layers):
    preset = PRESETS[name]
    layout = preset.layout(num_blocks=100, max_model_len=4096)
    assert kinds_of(layout) == kinds
    assert len(layout.groups) == preset.expected_num_groups
    assert layout.block_sizes == (block_size,) * len(kinds)
    assert layout.groups[0].layer_names == first_layers
    assert not layout.partial_hits_enabled
    assert len({s.page_size_bytes for s in layout.specs}) == 1
    assert set(PRESETS) == {shape[0] for shape in PRESET_SHAPES}


@pytest.mark.parametrize(
    ("name", "window"),
    [
        ("gemma2", 4096),
        ("gemma3", 1024),
        ("gpt-oss", 128),
        ("mistral-7b", 4096),
        ("llama4-scout", 8192),
    ],
)
def test_presets_carry_real_windows(name, window):
    layout = PRESETS[name].layout(num_blocks=100, max_model_len=8192)
    sizes = {
        getattr(s, "sliding_window", None) or getattr(s, "attention_chunk_size", None)
        for s in layout.specs
    } - {None}
    assert sizes == {window}


def test_jamba_attention_layer_is_layer_four():
    layout = PRESETS["jamba"].layout(num_blocks=100, max_model_len=4096)
    assert layout.groups[-1].layer_names == ("layers.4",)
    assert isinstance(layout.groups[-1].spec, FullAttentionSpec)


def test_hybrid_block_size_rule():
    # Jamba: 8 heads * 2 * 128 * 2 B = 4096 B/token; state (8192*3 + 8192*16) * 2 = 311296 B.
    assert hybrid_attention_block_size(4096, 311296) == 80
    # Qwen3-Next: 2 * 2 * 256 * 2 = 2048 B/token; (8192*3 + 32*128*128) * 2 = 1097728 B.
    assert hybrid_attention_block_size(2048, 1097728) == 544


def test_scale_windows_divides_with_a_minimum_of_one():
    gemma3 = PRESETS["gemma3"].layout(
        num_blocks=50, max_model_len=64, block_size=4, scale_windows=256
    )
    assert {s.sliding_window for s in gemma3.specs if isinstance(s, SlidingWindowSpec)} == {4}
    gpt_oss = PRESETS["gpt-oss"].layout(
        num_blocks=50, max_model_len=64, block_size=4, scale_windows=1000
    )
    assert gpt_oss.specs[0].sliding_window == 1
    scout = PRESETS["llama4-scout"].layout(
        num_blocks=50, max_model_len=64, block_size=2, scale_windows=1024
    )
    assert scout.specs[0].attention_chunk_size == 8
    with pytest.raises(KVConformError, match="scale_windows"):
        PRESETS["gemma3"].layout(num_blocks=50, max_model_len=64, scale_windows=0)


def test_small_block_size_mamba_preset_keeps_equal_block_sizes():
    # At bs 4 the Jamba attention page (16384 B) divides the Mamba page (311296 = 19 * 16384);
    # padding keeps the attention block size at 4 instead of 76.
    layout = PRESETS["jamba"].layout(num_blocks=100, max_model_len=64, block_size=4)
    assert layout.block_sizes == (4,) * 8


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(KVConformError, match="unknown model preset 'llama3'.*gemma3"):
        get_preset("llama3")


@FEW
@given(preset_layouts())
def test_preset_layouts_are_valid_and_small(layout):
    assert layout.max_model_len >= layout.scheduler_block_size
    assert not layout.partial_hits_enabled
    assert layout.num_blocks > layout.blocks_per_request()


def test_preset_layouts_reach_every_preset():
    for name in PRESETS:
        layout = find(
            preset_layouts(), lambda lay, n=name: lay.name.split("/")[0] == n, settings=FIND
        )
        assert layout.name.split("/")[0] == name


def test_preset_windows_slide_within_short_traces():
    layout = find(
        preset_layouts(names=["gemma3"]),
        lambda lay: lay.specs[0].sliding_window < lay.max_model_len // 2,
        settings=FIND,
    )
    assert layout.specs[0].sliding_window < layout.max_model_len // 2


# -- prompts and operations ----------------------------------------------------------


@EXAMPLES
@given(st.data())
def test_request_inputs_fit_the_model(data):
    layout = data.draw(layouts(max_groups=3))
    pool = data.draw(prefix_pools(layout))
    arrive = data.draw(request_inputs(layout, pool, "r7"))
    assert arrive.request_id == "r7"
    assert len(arrive.prompt) >= 1
    assert len(arrive.prompt) + len(arrive.output) <= layout.max_model_len
    assert all(0 <= t < VOCAB_SIZE for t in arrive.prompt + arrive.output)
    assert arrive.cache_salt in (None, "s1")
    assert arrive.lora_name in (None, "lora-a")


def test_prompts_reach_max_model_len():
    layout = fixed_layout()
    prompt = find(prompts(layout), lambda p: len(p) == 64, settings=FIND)
    assert len(prompt) == 64


def test_prompts_share_a_prefix_and_diverge_inside_a_block():
    layout = fixed_layout()

    def shares(pool_and_prompts):
        pool, a, b = pool_and_prompts
        common = 0
        while common < min(len(a), len(b)) and a[common] == b[common]:
            common += 1
        return common >= 8 and common % 4 != 0 and a != b

    strategy = prefix_pools(layout).flatmap(
        lambda pool: st.tuples(st.just(pool), prompts(layout, pool), prompts(layout, pool))
    )
    assert shares(find(strategy, shares, settings=FIND))


def test_salted_and_lora_requests_occur():
    layout = fixed_layout()
    strategy = request_inputs(layout, (), "r0")
    assert find(strategy, lambda a: a.cache_salt == "s1", settings=FIND).cache_salt == "s1"
    assert find(strategy, lambda a: a.lora_name == "lora-a", settings=FIND).lora_name == "lora-a"


@EXAMPLES
@given(st.data())
def test_operations_are_well_formed(data):
    layout = data.draw(st.one_of(layouts(max_groups=3), preset_layouts()))
    ops = data.draw(operations(layout, max_ops=30))
    assert 1 <= len(ops) <= 30
    assert isinstance(ops[0], Arrive) and ops[0].request_id == "r0"
    validate_references(ops)
    arrivals = [op.request_id for op in ops if isinstance(op, Arrive)]
    assert arrivals == [f"r{i}" for i in range(len(arrivals))]
    has_mamba = any(isinstance(s, MambaSpec) for s in layout.specs)
    for op in ops:
        if isinstance(op, Step):
            assert op.token_budget >= 1
            assert 0 <= op.num_lookahead_tokens <= (0 if has_mamba else 4)
        if isinstance(op, Arrive):
            assert len(op.prompt) + len(op.output) <= layout.max_model_len


def test_every_operation_kind_and_chunked_budgets_occur():
    layout = fixed_layout()
    ops = find(
        operations(layout),
        lambda ops: (
            {type(op).__name__ for op in ops}
            >= {"Arrive", "Step", "Abort", "Preempt", "ResetPrefixCache"}
        ),
        settings=FIND,
    )
    assert any(isinstance(op, Abort) for op in ops)
    assert any(isinstance(op, Preempt) for op in ops)
    small = find(
        operations(layout),
        lambda ops: any(isinstance(op, Step) and op.token_budget < 4 for op in ops),
        settings=FIND,
    )
    assert any(isinstance(op, Step) and op.token_budget < 4 for op in small)


MAMBA_LAYOUT = KVCacheLayout(
    groups=(
        KVCacheGroup(("m",), MambaSpec(block_size=4)),
        KVCacheGroup(("f",), FullAttentionSpec(block_size=4)),
    ),
    num_blocks=20,
    max_model_len=16,
)


@FEW
@given(lookaheads(MAMBA_LAYOUT))
def test_lookaheads_are_zero_with_mamba(n):
    assert n == 0


def test_lookaheads_are_sometimes_positive_without_mamba():
    assert 1 <= find(lookaheads(fixed_layout()), lambda n: n > 0, settings=FIND) <= 4
