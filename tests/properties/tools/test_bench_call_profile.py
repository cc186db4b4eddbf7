"""Bench engines ``--calls``: the time per protocol call, split by decode and prefill steps.

The engine runs under a fake clock that each protocol call advances by a fixed cost of its
own (a prime number of ticks per call name), and counts its calls itself: every figure
the profile reports is then known exactly from those counts, with no timing involved.
"""

from __future__ import annotations

import functools

import pytest

from properties.core.proxy import EngineProxy
from properties.engines.reference import make_engine as make_reference
from properties.tools.bench.call_profile import (
    CallShare,
    CallTime,
    call_shares,
    call_times,
    format_call_profile,
)
from properties.tools.bench.engines import (
    EngineBenchRow,
    bench_engines,
    build_trace,
    replay_timed,
    sweep_recipe,
)
from properties.tools.cli import main

#: ticks each protocol call costs under the fake clock (distinct primes: a call's total
#: divided by its cost must give exactly its own count)
COSTS = {
    "add_request": 2,
    "get_computed_blocks": 3,
    "allocate": 5,
    "append_output_tokens": 7,
    "set_num_computed_tokens": 11,
    "new_step": 13,
    "free": 17,
    "remove_request": 19,
}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> float:
        return float(self.now)


class CostlyEngine(EngineProxy):
    """The reference engine, each call advancing ``clock`` by its :data:`COSTS` entry and
    counted in ``calls`` (by the step kind the test sets in ``kind``)."""

    def __init__(self, inner, clock: FakeClock) -> None:
        super().__init__(inner)
        self.clock = clock
        self.calls: dict[str, int] = {}

    def _cost(self, name: str) -> None:
        self.clock.now += COSTS[name]
        self.calls[name] = self.calls.get(name, 0) + 1

    def add_request(self, request):
        self._cost("add_request")
        return super().add_request(request)

    def get_computed_blocks(self, request_id):
        self._cost("get_computed_blocks")
        return super().get_computed_blocks(request_id)

    def allocate(self, allocation):
        self._cost("allocate")
        return super().allocate(allocation)

    def append_output_tokens(self, request_id, token_ids):
        self._cost("append_output_tokens")
        return super().append_output_tokens(request_id, token_ids)

    def set_num_computed_tokens(self, request_id, num_computed_tokens):
        self._cost("set_num_computed_tokens")
        return super().set_num_computed_tokens(request_id, num_computed_tokens)

    def new_step(self):
        self._cost("new_step")
        return super().new_step()

    def free(self, request_id):
        self._cost("free")
        return super().free(request_id)

    def remove_request(self, request_id):
        self._cost("remove_request")
        return super().remove_request(request_id)


@pytest.fixture(scope="module")
def profiled():
    trace = build_trace(sweep_recipe(8, 64))
    clock = FakeClock()
    engine = CostlyEngine(make_reference(trace.layout), clock)
    replay = replay_timed(engine, trace, clock, calls=True)
    return trace, engine, replay


def test_each_call_costs_its_ticks_times_its_calls(profiled) -> None:
    _, _, replay = profiled
    assert replay.decode_calls and replay.prefill_calls
    for part in (replay.decode_calls, replay.prefill_calls):
        for call in part:
            assert call.seconds == COSTS[call.name] * call.count, call


def test_calls_add_up_to_the_decode_and_prefill_totals(profiled) -> None:
    _, _, replay = profiled
    assert sum(c.seconds for c in replay.decode_calls) == sum(replay.decode_seconds)
    assert sum(c.seconds for c in replay.prefill_calls) == replay.prefill_seconds


def test_arrivals_count_in_neither_kind_of_step(profiled) -> None:
    _, engine, replay = profiled
    names = {c.name for c in replay.decode_calls + replay.prefill_calls}
    assert "add_request" not in names  # made by Arrive operations, not by steps
    assert engine.calls["add_request"] == 8
    counted = {c.name: 0 for c in replay.decode_calls + replay.prefill_calls}
    for c in replay.decode_calls + replay.prefill_calls:
        counted[c.name] += c.count
    # every call a step made is in one of the two parts (no idle step in this trace)
    for name, n in counted.items():
        assert n == engine.calls[name], name


def test_decode_steps_of_the_sweep_make_the_per_item_calls(profiled) -> None:
    _, _, replay = profiled
    decode = {c.name: c for c in replay.decode_calls}
    steps = len(replay.decode_seconds)
    # 8 running requests per decode step: one output token and one count each, one new_step
    assert decode["append_output_tokens"].count == 8 * steps
    assert decode["new_step"].count == steps
    assert "get_computed_blocks" not in decode  # nothing waits after the prefill step
    prefill = {c.name: c for c in replay.prefill_calls}
    assert prefill["get_computed_blocks"].count == 8  # one admission per prompt


def test_calls_are_most_expensive_first(profiled) -> None:
    _, _, replay = profiled
    costs = [c.seconds for c in replay.decode_calls]
    assert costs == sorted(costs, reverse=True)


def test_without_calls_the_replay_keeps_no_profile() -> None:
    trace = build_trace(sweep_recipe(4, 64))
    replay = replay_timed(make_reference(trace.layout), trace)
    assert replay.decode_calls == () and replay.prefill_calls == ()


def test_call_shares_divide_by_steps_and_prefills() -> None:
    shares = call_shares(
        [CallTime("free", 0.002, 4), CallTime("new_step", 0.001, 100)],
        100,
        [CallTime("allocate", 0.001, 2)],
        2,
    )
    assert shares == (
        CallShare("free", 20.0, 0.04, 0.0, 0.0),
        CallShare("new_step", 10.0, 1.0, 0.0, 0.0),
        CallShare("allocate", 0.0, 0.0, 500.0, 1.0),
    )
    assert call_shares([CallTime("free", 1.0, 1)], 0, [], 0) == (
        CallShare("free", 0.0, 0.0, 0.0, 0.0),
    )


def test_call_times_order_and_ties() -> None:
    assert call_times({"b": 1.0, "a": 1.0, "c": 2.0}, {"a": 1, "b": 2, "c": 3}) == (
        CallTime("c", 2.0, 3),
        CallTime("a", 1.0, 1),
        CallTime("b", 1.0, 2),
    )


def test_rows_carry_the_profile_only_when_asked() -> None:
    trace = build_trace(sweep_recipe(4, 64))
    plain, profiled_row = (
        bench_engines(("reference",), {"s": trace}, calls=calls)[0] for calls in (False, True)
    )
    assert plain.calls is None
    assert profiled_row.calls
    names = [s.name for s in profiled_row.calls]
    assert "allocate" in names and "append_output_tokens" in names


def test_format_lists_each_call_of_each_row() -> None:
    rows = [
        EngineBenchRow("t", "e", "ok", calls=(CallShare("free", 20.0, 0.04, 1.5, 0.25),)),
        EngineBenchRow("t", "x", "error: boom"),
    ]
    text = format_call_profile(rows).splitlines()
    assert text[0].split() == [
        "trace",
        "engine",
        "call",
        "dec",
        "us/step",
        "calls/step",
        "prefill",
        "us/req",
        "calls/req",
    ]
    assert text[1].split() == ["t", "e", "free", "20.0", "0.04", "1.5", "0.25"]
    assert len(text) == 2
    assert format_call_profile(rows[1:]) == ""


def test_cli_prints_the_profile(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)  # (the trace is cached under the current directory)
    code = main(
        [
            "bench",
            "engines",
            "--engines",
            "reference",
            "--traces",
            "decode-heavy",
            "--scale",
            "32",
            "--calls",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "where the time goes, per protocol call:" in out
    profile = out.split("where the time goes, per protocol call:")[1]
    assert "decode-heavy  reference  allocate" in profile


def test_a_call_with_no_name_is_profiled_under_its_protocol_name() -> None:
    """An adapter whose ``free`` is a ``functools.partial`` (no ``__name__``): its time
    still counts under ``free``, the protocol call the bench made."""
    trace = build_trace(sweep_recipe(4, 64))
    engine = make_reference(trace.layout)
    engine.free = functools.partial(type(engine).free, engine)
    assert not hasattr(engine.free, "__name__")
    replay = replay_timed(engine, trace, calls=True)
    decode = {c.name: c for c in replay.decode_calls}
    assert decode["free"].count == 4  # the 4 requests finish in the last decode step
