"""The reach corpus (``properties/runner/reach.py``, ``properties/tools/reach_grow.py``):
traces that first reached something, replayed by every check before it draws.

* every shipped case passes on the reference (exact level, invariants and attention):
  a case guards reach, it is never a known failure;
* a case runs only on engines that can run it (its spec types, settings, serving calls);
* the mutant ``delay_cache_ignored`` passes the ci attention stream at its level (a
  strict xfail of ``tests/properties/mutants/test_mutants.py`` says so) but is caught by
  the corpus before the stream starts, its message naming the case;
* ``reach add`` refuses a trace that fails on the reference; ``reach grow`` keeps only
  traces that reach new keys, minimised, each passing on the reference.
"""

from __future__ import annotations

import pytest
from hypothesis import settings

from properties.core.trace import Arrive, Step, Trace, write_trace
from properties.engines.under_test import resolve_engine
from properties.runner.check import run_property
from properties.runner.config import CheckConfig
from properties.runner.reach import load_reach_corpus, runnable_cases
from properties.tools.reach_grow import add_case, grow, passes_on_reference
from reference.errors import KVConformError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

DELAY_CACHE_IGNORED = "properties.mutants.reference_mutants:make_delay_cache_ignored"


@pytest.mark.parametrize("case", load_reach_corpus(), ids=lambda c: c.name)
def test_every_shipped_case_passes_on_the_reference(case) -> None:
    assert passes_on_reference(case.trace) is None
    assert case.reached and case.why


def test_the_corpus_holds_the_hand_written_load_failure() -> None:
    names = {case.name for case in load_reach_corpus()}
    assert {"failed-async-load-retry", "loading-blocks-not-hit"} <= names


def test_a_case_runs_only_where_the_engine_can_run_it() -> None:
    cases = load_reach_corpus()
    load_failure = next(c for c in cases if c.name == "failed-async-load-retry")
    reference = resolve_engine("reference")
    assert load_failure in runnable_cases(cases, reference, serving_calls=True)
    # without the serving-mode calls no connector can load: not runnable
    assert load_failure not in runnable_cases(cases, reference, serving_calls=False)


def test_the_corpus_catches_a_mutant_the_ci_stream_misses(tmp_path) -> None:
    config = CheckConfig(engine=DELAY_CACHE_IGNORED, failure_dir=str(tmp_path))
    engine = resolve_engine(DELAY_CACHE_IGNORED, isolation="none")
    result = run_property("attention", config, settings.get_profile("ci"), None, engine)
    assert not result.passed and result.examples == 0  # before the stream drew anything
    assert result.check == "attention" and result.reach >= 1
    assert "reach corpus case 'failed-async-load-retry'" in result.failure
    assert result.trace_path is not None and result.trace_path.is_file()


def test_the_pairs_a_case_runs_count_in_the_pair_table() -> None:
    """The case ``lookahead-sparse-retention`` (a window group with lookahead hashes and
    sparse retention) counts the pair ``lookahead-hashes x retention=sparse`` in the
    invariants property's pairs with a single drawn example, which is drawn without
    production settings (so the pair is the case's alone)."""
    engine = resolve_engine("reference")
    config = CheckConfig(engine="reference")
    one = settings(settings.get_profile("ci"), max_examples=1)
    with_corpus = run_property("invariants", config, one, None, engine)
    assert with_corpus.reach >= 1
    assert with_corpus.pairs.get(("lookahead-hashes", "retention=sparse"), 0) >= 1
    off = CheckConfig(engine="reference", reach_corpus=False)
    without = run_property("invariants", off, one, None, engine)
    assert ("lookahead-hashes", "retention=sparse") not in without.pairs


def test_reach_add_takes_a_good_trace_and_refuses_a_broken_one(tmp_path) -> None:
    layout = KVCacheLayout(
        (KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),), num_blocks=3, max_model_len=64
    )
    good = Trace(layout, (Arrive("r0", (1, 2, 3)), Step(8)))
    path = write_trace(good, tmp_path / "good.json")
    added = add_case(str(path), "small", "a test", (), tmp_path / "corpus")
    assert added.is_file() and load_reach_corpus(tmp_path / "corpus")[0].name == "small"
    bad = tmp_path / "bad.json"  # a pool of one block: no layout, no case
    bad.write_text(path.read_text().replace('"num_blocks": 3', '"num_blocks": 1'))
    with pytest.raises(KVConformError):
        add_case(str(bad), "bad", "a test", (), tmp_path / "corpus")


def test_reach_grow_keeps_only_new_reach_minimised(tmp_path) -> None:
    kept, drawn = grow(3, seed=5, directory=tmp_path)
    assert drawn == 3 and kept
    known: set[str] = set()
    for case in kept:
        assert passes_on_reference(case.trace) is None
        assert set(case.reached) - known, "a case kept for nothing new"
        known |= set(case.reached)
    again, _ = grow(3, seed=5, directory=tmp_path)  # the same draws reach nothing new
    assert again == []
