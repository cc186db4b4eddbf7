"""The in-process call deadline (``properties/core/deadline.py``): what it charges a call.

A call that runs past its deadline raises ``CallTimeoutError``; time the interpreter
spends collecting garbage inside the call does not count. A collection is made slow on
purpose by a ``gc.callbacks`` entry that sleeps when a collection starts.
"""

from __future__ import annotations

import gc
import time

import pytest

from properties.core.deadline import call_deadline, deadline_available
from properties.core.engine import CallTimeoutError

pytestmark = pytest.mark.skipif(
    not deadline_available(), reason="deadlines need SIGALRM in the main thread"
)

SLOW_COLLECTION_S = 0.6


def _busy(seconds: float) -> None:
    """Python work (interruptible at any bytecode) for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.fixture
def slow_collections():
    def sleep_at_start(phase: str, info: dict) -> None:
        if phase == "start":
            time.sleep(SLOW_COLLECTION_S)

    gc.callbacks.append(sleep_at_start)
    try:
        yield
    finally:
        gc.callbacks.remove(sleep_at_start)


def test_a_call_past_its_deadline_times_out_naming_it() -> None:
    start = time.monotonic()
    raised = pytest.raises(CallTimeoutError, match=r"allocate_slots\('r0'\) did not return")
    with raised, call_deadline(0.3, "allocate_slots('r0')"):
        _busy(5.0)
    assert time.monotonic() - start < 2.0  # stopped at the deadline, not at the end


def test_a_slow_collection_inside_the_call_is_not_charged_to_it(slow_collections) -> None:
    with call_deadline(0.3, "free('r0')"):
        # arm the deadline first: the collection's own callbacks run inside the call
        gc.collect()  # 0.6 s, twice the deadline, all of it collecting
        _busy(0.15)  # the call's own time stays under 0.3 s, with ticks landing in it


def test_the_call_s_own_time_still_counts_around_a_collection(slow_collections) -> None:
    raised = pytest.raises(CallTimeoutError, match=r"free\('r0'\) did not return within 0.3 s")
    with raised, call_deadline(0.3, "free('r0')"):
        _busy(0.15)
        gc.collect()  # not charged
        _busy(2.0)  # but 0.15 s + this passes the deadline


def test_each_call_starts_with_no_collection_time(slow_collections) -> None:
    with call_deadline(5.0, "first()"):
        gc.collect()  # 0.6 s collected in the first call
    start = time.monotonic()
    raised = pytest.raises(CallTimeoutError, match=r"second\(\) did not return")
    with raised, call_deadline(0.2, "second()"):
        _busy(3.0)
    # at 0.2 s (to a tick, 0.1 s, later), not 0.6 s later as the first call's credit would
    assert time.monotonic() - start < 0.6
