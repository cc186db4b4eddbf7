"""SchedulerOptions: validation, JSON round trip, the deterministic per-request and
per-step inputs of the scheduler level (priorities, pause pattern)."""

from __future__ import annotations

import pytest

from properties.core.scheduler_options import (
    PAUSED_ALL,
    PAUSED_NEW,
    UNPAUSED,
    SchedulerOptions,
    pause_state,
    request_priority,
)
from reference.errors import KVConformError


def test_defaults_describe_as_default_and_differences_by_name() -> None:
    assert SchedulerOptions().describe() == "default"
    assert SchedulerOptions(policy="priority", max_loras=1).describe() == (
        "policy=priority max_loras=1"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "lifo"}, "policy must be one of"),
        ({"max_loras": -1}, "max_loras must be an integer >= 0"),
        ({"max_num_seqs": True}, "max_num_seqs must be an integer"),
        ({"prefill_schedule_interval": 0}, "must be >= 1"),
        ({"pauses": 1}, "pauses must be a boolean"),
    ],
)
def test_bad_options_are_one_line_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(KVConformError, match=message):
        SchedulerOptions(**kwargs)


def test_json_round_trip_and_unknown_fields() -> None:
    options = SchedulerOptions(policy="priority", pauses=True, long_prefill_token_threshold=8)
    assert SchedulerOptions.from_json(options.to_json()) == options
    assert SchedulerOptions.from_json(None) == SchedulerOptions()
    with pytest.raises(KVConformError, match=r"options: unknown fields \['nope'\]"):
        SchedulerOptions.from_json({"nope": 1})
    with pytest.raises(KVConformError, match="must be an object"):
        SchedulerOptions.from_json([1])


def test_priorities_are_deterministic_and_use_the_three_levels() -> None:
    ids = [f"r{i}" for i in range(12)]
    first = [request_priority(r) for r in ids]
    assert first == [request_priority(r) for r in ids]
    assert set(first) == {0, 1, 2}


def test_the_pause_pattern_by_hand() -> None:
    """Period 7: phases 3 and 4 PAUSED_NEW, 6 PAUSED_ALL."""
    want = [UNPAUSED, UNPAUSED, PAUSED_NEW, PAUSED_NEW, UNPAUSED, PAUSED_ALL, UNPAUSED]
    assert [pause_state(k) for k in range(1, 8)] == want
    assert [pause_state(k) for k in range(8, 15)] == want
