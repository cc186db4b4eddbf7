"""The optimized manager against the reference on random layouts and traces: every hit,
allocation, table, free count, free-queue order, ref count and cached entry must agree,
per request and through the batched ``schedule_step``."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.optimized.optimized_differential import Pair, layouts, run_trace


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**32 - 1))
def test_per_request_calls_match_reference(layout, seed) -> None:
    run_trace(Pair(layout), seed, num_steps=30, batched=False)


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**32 - 1))
def test_batched_step_matches_reference(layout, seed) -> None:
    run_trace(Pair(layout), seed, num_steps=30, batched=True)


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**32 - 1))
def test_vectorised_decode_apply_matches_reference(layout, seed) -> None:
    """Every working decode item through ``apply_decode_items``, however few."""
    run_trace(Pair(layout, min_batched_apply=0), seed, num_steps=30, batched=True)


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**32 - 1))
def test_plain_decode_steps_as_columns_match_reference(layout, seed) -> None:
    """One token per running request, steps as columns: quiet items are settled from their
    rows' decode thresholds, the loud ones applied one by one (or batched)."""
    pair = Pair(layout, columns=True)
    counts = run_trace(pair, seed, num_steps=40, batched=True, plain_decode=True)
    assert counts["steps"] == 40


@settings(max_examples=40, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**32 - 1))
def test_mixed_steps_as_columns_match_reference(layout, seed) -> None:
    """Columns with chunks and lookahead too (quiet shortcut refused), loud items batched."""
    run_trace(Pair(layout, min_batched_apply=0, columns=True), seed, num_steps=30, batched=True)


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**32 - 1))
def test_compiled_decode_steps_match_reference(layout, seed) -> None:
    """Plain decode steps as columns with the loud items through the compiled pass
    (:mod:`optimized.control.compiled_decode`) wherever the layout allows it."""
    pair = Pair(layout, columns=True, compiled=True)
    counts = run_trace(pair, seed, num_steps=40, batched=True, plain_decode=True)
    assert counts["steps"] == 40


@settings(max_examples=40, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**32 - 1))
def test_compiled_mixed_steps_match_reference(layout, seed) -> None:
    """Columns with chunks and lookahead too, the compiled pass on."""
    run_trace(Pair(layout, columns=True, compiled=True), seed, num_steps=30, batched=True)
