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
