"""``kvconform bench suite``'s speed table (:func:`suite_speed`): checked steps per CPU
second per engine and property, on the profile's first examples."""

from __future__ import annotations

from properties.tools.bench.suite import SpeedRow, format_speed, format_suite, suite_speed


def test_the_reference_runs_each_property_asked_for_and_counts_its_steps() -> None:
    rows = suite_speed(("reference",), "ci", examples=3, properties=("invariants", "determinism"))
    assert [(r.engine, r.prop, r.level, r.status) for r in rows] == [
        ("reference", "invariants", "exact", "ok"),
        ("reference", "determinism", "exact", "ok"),
    ]
    for r in rows:
        assert r.examples >= 3 and r.steps > 0 and r.cpu_seconds > 0
        assert r.steps_per_cpu_second == r.steps / r.cpu_seconds
    # the derandomized profile draws the same examples again: the same steps
    again = suite_speed(("reference",), "ci", examples=3, properties=("invariants",))
    assert again[0].steps == rows[0].steps


def test_an_engine_that_cannot_be_built_gets_one_row_saying_why() -> None:
    rows = suite_speed(("no_such_module_xyz:make_engine",), "ci", examples=1)
    assert len(rows) == 1 and rows[0].prop == "-" and rows[0].examples == 0
    assert rows[0].status.startswith(("not installed", "error"))


def test_the_table_totals_each_engine_and_leaves_figures_of_a_failed_run() -> None:
    rows = [
        SpeedRow("reference", "invariants", "exact", "ok", 25, 1000, 2.0, 3.0),
        SpeedRow("reference", "production", "exact", "ok", 25, 500, 0.5, 1.0),
        SpeedRow("vllm", "-", "exact", "not installed (No module named 'vllm')"),
    ]
    table = format_speed(rows).splitlines()
    assert table[0].startswith("suite speed: checked steps per CPU second")
    assert table[2].split() == [
        "reference",
        "invariants",
        "exact",
        "ok",
        "25",
        "1000",
        "2.00",
        "500",
    ]
    assert table[4].split() == ["reference", "all", "exact", "50", "1500", "2.50", "600"]
    assert table[5].split()[:3] == ["vllm", "-", "exact"] and table[5].split()[-3:] == [
        "0",
        "0.00",
        "0",
    ]
    assert format_suite(rows) == format_speed(rows)  # (no mutant rows: the speed alone)
