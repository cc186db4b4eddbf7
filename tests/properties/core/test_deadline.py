"""The call deadlines (``properties/core/deadline.py``, ``charged_time.py``): what they
charge a call.

A call is charged its wall time less the time its thread waited for a CPU and less the
garbage collections it sat through; past its limit (or past 30 times it in wall time)
it raises ``CallTimeoutError`` naming the call, the limit, the wall time and the load.
Every figure here comes from a clock driven by hand (the tick is called directly), so no
test depends on how loaded the machine is; one test runs the real timer on a real loop,
asserting only that it is stopped.
"""

from __future__ import annotations

import pytest

from properties.core import deadline
from properties.core.charged_time import WALL_CAP, ChildClock
from properties.core.deadline import DeadlinePassed, call_deadline, deadline_available
from properties.core.engine import CallTimeoutError

pytestmark = pytest.mark.skipif(
    not deadline_available(), reason="deadlines need SIGALRM in the main thread"
)


class FakeClock:
    """Wall time and run-queue time of the main thread, set by the test."""

    def __init__(self) -> None:
        self.wall = 1000.0
        self.waited: float | None = 50.0

    def now(self) -> float:
        return self.wall

    def run_queue(self) -> float | None:
        return self.waited


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(deadline, "_now", fake.now)
    monkeypatch.setattr(deadline, "_run_queue", fake.run_queue)
    # the real timer's ticks read the same fake clock: they agree with the test's
    return fake


def tick() -> None:
    deadline._on_tick(None, None)


def test_a_call_charged_its_limit_times_out_naming_the_call_limit_and_load(clock) -> None:
    with pytest.raises(CallTimeoutError) as raised, call_deadline(5.0, "allocate_slots('r0')"):
        clock.wall += 0.05
        tick()  # the first tick reads the run-queue base
        clock.wall += 4.9
        tick()  # 4.95 s charged: still running
        clock.wall += 0.1
        tick()  # 5.05 s: stopped
        pytest.fail("the tick past the limit did not stop the call")
    message = str(raised.value)
    assert message.startswith(
        "allocate_slots('r0') did not return within 5 s of its own time (5.0 s wall, "
        "0.0 s of it waiting for a CPU; load average "
    )
    assert "--call-timeout" in message


def test_time_spent_waiting_for_a_cpu_is_not_charged(clock) -> None:
    with call_deadline(5.0, "free('r0')"):
        tick()
        clock.wall += 9.0  # 9 s wall ...
        clock.waited += 6.5  # ... 6.5 s of it runnable but not running: 2.5 s charged
        tick()  # no timeout


def test_the_call_s_own_time_still_counts_under_load(clock) -> None:
    raised = pytest.raises(CallTimeoutError, match=r"9.0 s wall, 3.9 s of it waiting")
    with raised, call_deadline(5.0, "free('r0')"):
        tick()
        clock.wall += 9.0
        clock.waited += 3.9  # 5.1 s charged
        tick()


def test_a_sleeping_hang_is_charged_all_its_wall_time(clock) -> None:
    raised = pytest.raises(CallTimeoutError)
    with raised, call_deadline(5.0, "new_step()"):
        tick()
        clock.wall += 5.01  # asleep: never runnable, the run queue does not move
        tick()


def test_wall_time_is_capped_even_for_a_starved_call(clock) -> None:
    with pytest.raises(CallTimeoutError), call_deadline(1.0, "new_step()"):
        tick()
        clock.wall += WALL_CAP - 0.01
        clock.waited += WALL_CAP - 0.01  # every second waiting: nothing charged
        tick()  # under the cap: still running
        clock.wall += 0.02
        clock.waited += 0.02
        tick()


def test_without_a_run_queue_figure_the_charge_is_the_wall_time(clock) -> None:
    clock.waited = None
    with pytest.raises(CallTimeoutError), call_deadline(2.0, "new_step()"):
        tick()
        clock.wall += 2.0
        tick()


def test_a_collection_inside_the_call_is_not_charged_and_no_tick_fires_in_it(clock) -> None:
    with call_deadline(5.0, "free('r0')"):
        tick()
        clock.wall += 1.0
        deadline._on_collection("start", {})
        clock.wall += 6.0  # a 6 s collection, over the whole limit
        tick()  # a tick inside a collection never raises
        deadline._on_collection("stop", {})
        clock.wall += 3.0
        tick()  # 4 s charged: running
    with pytest.raises(CallTimeoutError), call_deadline(5.0, "free('r0')"):
        tick()
        clock.wall += 1.0
        deadline._on_collection("start", {})
        clock.wall += 6.0
        deadline._on_collection("stop", {})
        clock.wall += 4.01  # 5.01 s charged
        tick()


def test_each_call_starts_with_no_collection_time_and_a_new_run_queue_base(clock) -> None:
    with call_deadline(5.0, "first()"):
        tick()
        deadline._on_collection("start", {})
        clock.wall += 3.0
        deadline._on_collection("stop", {})
        clock.waited += 2.0
    with pytest.raises(CallTimeoutError), call_deadline(0.2, "second()"):
        tick()  # the base is read again: the first call's wait is not credited
        clock.wall += 0.2
        tick()


def test_the_real_timer_stops_a_busy_loop() -> None:
    """End to end on the real clock: only that the loop is stopped (it would spin for
    ever otherwise), never how fast."""
    with (
        pytest.raises(CallTimeoutError, match=r"spin\(\) did not return"),
        call_deadline(0.3, "spin()"),
    ):
        while True:
            pass


def test_deadline_passed_is_no_exception_an_engine_can_swallow() -> None:
    assert not issubclass(DeadlinePassed, Exception)


class FakeChild:
    def __init__(self) -> None:
        self.wall = 0.0
        self.waited: float | None = 10.0

    def now(self) -> float:
        return self.wall

    def read(self, path: str) -> float | None:
        return self.waited


def test_a_child_s_call_is_charged_its_own_time() -> None:
    fake = FakeChild()
    clock = ChildClock(4242, now=fake.now, read=fake.read)
    clock.start(5.0)
    fake.wall += 3.0
    assert clock.remaining() == pytest.approx(2.0)  # inside its wall limit
    fake.wall += 4.0  # 7 s wall, 2.5 s of it waiting for a CPU: 4.5 s charged
    fake.waited += 2.5
    assert clock.remaining() == pytest.approx(0.5)
    fake.wall += 0.6  # the wait did not grow: 5.1 s charged
    assert clock.remaining() < 0
    assert clock.overrun().startswith("5 s of its own time (7.6 s wall, 2.5 s of it waiting")


def test_a_child_s_wall_time_is_capped() -> None:
    fake = FakeChild()
    clock = ChildClock(4242, now=fake.now, read=fake.read)
    clock.start(1.0)
    fake.wall += WALL_CAP
    fake.waited += WALL_CAP
    assert clock.remaining() == 0.0


def test_a_child_s_run_queue_is_sampled_at_most_twice_a_second() -> None:
    fake = FakeChild()
    reads: list[float] = []

    def read(path: str) -> float | None:
        reads.append(fake.wall)
        return fake.waited

    clock = ChildClock(4242, now=fake.now, read=read)
    for _ in range(100):  # a hundred quick calls within 0.1 s: one read
        clock.start(5.0)
        fake.wall += 0.001
    assert len(reads) == 1
