"""Block-level load failures: the scan of affected requests and the ``fail`` policy's
order, worked by hand."""

from __future__ import annotations

from properties.runner.load_failures import ScannedRequest, error_order, scan


def test_the_first_request_marks_and_falls_back_a_sharer_keeps_its_tokens() -> None:
    # bs 2: r1 loaded 8 tokens into (3, 4, 5, 6); r2 hit (3, 4, 5) and holds 7; block 5
    # invalid: r1 falls back to its start (index 2: 4 tokens); r2 meets 5 marked already
    # and keeps the 6 tokens it had; blocks 5 and 6 (from r1's first invalid on) evicted
    result = scan(
        [ScannedRequest("r1", (3, 4, 5, 6), 8), ScannedRequest("r2", (3, 4, 5, 7), 6)],
        {5},
        2,
    )
    assert result.affected == ("r1", "r2")
    assert result.num_computed == {"r1": 4, "r2": 6}
    assert result.to_evict == frozenset({5, 6})


def test_blocks_past_the_computed_tokens_are_not_scanned() -> None:
    # r3 computed 3 tokens (blocks 0 and 1 of (8, 9, 10)): an invalid block 10 is not its
    assert scan([ScannedRequest("r3", (8, 9, 10), 3)], {10}, 2).affected == ()
    # two invalid blocks: the first one counts
    result = scan([ScannedRequest("r4", (8, 9, 10), 6)], {9, 10}, 2)
    assert result.num_computed == {"r4": 2}
    assert result.to_evict == frozenset({9, 10})


def test_error_order_holds_each_failed_request_once() -> None:
    assert error_order(["r1"], [], []) == ["r1"]
    assert sorted(error_order(["r1"], ["r2"], ["r3", "r1"])) == ["r1", "r2", "r3"]
    # a whole failure of a request that ended already is passed over
    assert error_order(["r1"], [], [], frozenset({"r1"})) == []
