"""``edge_layouts``: the hit rules' edges the generic draws rarely make (issue 19)."""

from __future__ import annotations

import pytest
from hypothesis import find, given, settings

from properties.generate.strategies import edge_case_kinds, edge_layouts
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

EXAMPLES = settings(max_examples=100, derandomize=True, database=None, deadline=None)


def test_edge_cases_are_kept_by_the_engine_kinds() -> None:
    assert edge_case_kinds(("full", "sliding_window", "chunked_local", "mamba")) == (0, 1, 2, 3)
    assert edge_case_kinds(("full", "sliding_window")) == (3,)
    assert edge_case_kinds(("chunked_local",)) == (0,)
    assert edge_case_kinds(("sliding_window",)) == ()
    with pytest.raises(ValueError, match="no case made of"):
        find(edge_layouts(kinds=("sliding_window",)), lambda layout: True, settings=EXAMPLES)


@EXAMPLES
@given(edge_layouts())
def test_each_edge_layout_is_one_of_its_cases(layout) -> None:
    specs = [g.spec for g in layout.groups]
    kinds = tuple(type(s) for s in specs)
    sizes = [s.block_size for s in specs]
    base = min(sizes)
    assert base in (2, 4)
    assert layout.max_model_len >= 4 * layout.scheduler_block_size
    if kinds[-1] is ChunkedLocalAttentionSpec:
        # alone or beside full attention of its block size; a chunk of 2..4 blocks
        assert kinds in (
            (ChunkedLocalAttentionSpec,),
            (FullAttentionSpec, ChunkedLocalAttentionSpec),
        )
        assert sizes == [base] * len(sizes)
        assert specs[-1].attention_chunk_size in (2 * base, 3 * base, 4 * base)
    elif kinds == (FullAttentionSpec, MambaSpec):
        assert sizes == [base, base]
    else:
        # full attention of 2b beside a window of b wider than the alignment 2b
        assert kinds == (FullAttentionSpec, SlidingWindowSpec)
        assert sizes == [2 * base, base]
        assert 3 * base + 2 <= specs[1].sliding_window <= 8 * base


@EXAMPLES
@given(edge_layouts(kinds=("full", "sliding_window")))
def test_an_engine_of_full_and_window_kinds_gets_the_fine_window_only(layout) -> None:
    assert [type(g.spec) for g in layout.groups] == [FullAttentionSpec, SlidingWindowSpec]


@EXAMPLES
@given(edge_layouts(kinds=("full", "sliding_window"), settings=frozenset({"eagle"})))
def test_the_fine_window_comes_with_eagle_where_the_engine_declares_it(layout) -> None:
    assert layout.use_eagle
    assert layout.num_hash_lookahead_tokens in (0, 2)
    assert not any(g.is_eagle_group for g in layout.groups)  # none flagged: all drop


@EXAMPLES
@given(edge_layouts(settings=frozenset({"retention"})))
def test_no_edge_layout_has_eagle_where_the_engine_does_not_declare_it(layout) -> None:
    assert not layout.use_eagle and layout.num_hash_lookahead_tokens == 0
