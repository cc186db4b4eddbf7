"""Failures a person can act on (issue 20.3, 18.6): list diffs instead of dumps, the
rule and where it failed, prefixes as token ranges, the key an attention query read
wrongly; kvconform's own line when shrinking stops."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

from properties.checks.oracles import OVERWRITTEN, ShadowCache, describe_content, missing_context
from properties.checks.registry import CHECKS
from properties.core.diff import describe_mismatch, diff_lists, short
from properties.core.trace import Arrive, Step, Trace, save_trace
from properties.runner.explain import explain_failure, rule_line, spec_section
from properties.runner.progress import (
    HYPOTHESIS_SLOW_SHRINK,
    Ticker,
    honest_shrink_reporter,
    progress_text,
)
from properties.tools import cli
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

ROOT = Path(__file__).resolve().parents[3]
FREE_HEAD_FIRST = "properties.mutants.reference_mutants:make_free_head_first"
FULL = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype_bytes=2)


def test_diff_lists_shows_lengths_count_first_position_and_a_window() -> None:
    expected = list(range(100))
    observed = list(range(100))
    observed[50], observed[70] = -1, -2
    text = diff_lists(expected, observed, ("reference", "engine"), window=2)
    assert text.splitlines() == [
        "lengths 100 and 100, 2 positions differ, the first at index 50:",
        "  reference [... 48, 49, 50, 51, 52 ...] (indices 48-52)",
        "  engine    [... 48, 49, -1, 51, 52 ...]",
    ]


def test_diff_of_tables_names_the_first_differing_group_and_a_missing_tail() -> None:
    text = diff_lists([[1, 2], [3, 4, 5]], [[1, 2], [3, 4]], ("ref", "eng"), window=1)
    assert (
        text.splitlines()[0]
        == "group 1: lengths 3 and 2, 1 position differs, the first at index 2:"
    )
    assert text.splitlines()[1] == "  ref [... 4, 5] (indices 1-2)"


def test_small_values_stay_on_one_line_and_long_ones_are_cut() -> None:
    assert describe_mismatch([[5]], [[6]], ("a", "b")) == "a gives [[5]], b gives [[6]]"
    assert short(list(range(100)), 6) == "[0, 1, 2, ... 97, 98, 99] (100 entries)"


def test_slot_contents_are_token_ranges_never_hashes() -> None:
    layout = KVCacheLayout(groups=(KVCacheGroup(("l0",), FULL),), num_blocks=8, max_model_len=32)
    shadow = ShadowCache(layout, shared_pool=True)
    ids = [11, 12, 13, 14, 15, 16]  # prefix ids of a 6-token request
    for p in range(4):  # block 3 holds positions 0..3, but slot 2 holds position 0's KV
        shadow.write(0, 3, p, ids[0] if p == 2 else ids[p])
    why = missing_context(layout, shadow, 0, [3], ids, 0, 4)
    assert why == (
        "block 3 slot 2 (position 2) holds the KV of this request's tokens [0, 1), not the "
        "KV of this request's tokens [0, 3)"
    )
    assert describe_content(None, 0, ids) == "nothing (never written)"
    assert "rejected draft" in describe_content(
        shadow.read(0, 3, 0).__class__(0, OVERWRITTEN), 0, ids
    )
    assert describe_content(shadow.read(0, 3, 0).__class__(1, 99), 0, ids) == (
        "the KV of group 1 of a prefix this request does not share"
    )


def test_rule_line_names_label_rule_and_section_of_every_check() -> None:
    assert rule_line("hit_bounds") == (
        "[hit_bounds] H1: 0 <= hit <= num_tokens - 1, aligned (docs/spec.md §11, Prefix hits)"
    )
    spec = (ROOT / "docs" / "spec.md").read_text(encoding="utf-8")
    for name in CHECKS:
        section = spec_section(name)
        assert section is not None, name
        heading = "### " + section.split(", ", 1)[1]
        assert heading in spec, (name, heading)


def _big_trace(directory: Path) -> Path:
    """One request on a 1001-block pool: after it is freed the free queue holds 1000
    blocks, and free_head_first returns its blocks in the wrong order."""
    layout = KVCacheLayout(groups=(KVCacheGroup(("l0",), FULL),), num_blocks=1001, max_model_len=64)
    trace = Trace(layout, (Arrive("r0", tuple(range(1, 10))), Step(64), Step(64)))
    return save_trace(trace, directory)


def test_exact_mismatch_on_a_1000_block_trace_prints_under_30_lines(tmp_path) -> None:
    path = _big_trace(tmp_path)
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli.main(["replay", str(path), "--engine", FREE_HEAD_FIRST, "--level", "exact"])
    lines = out.getvalue().splitlines()
    assert code == 1
    assert len(lines) < 30, "\n".join(lines)
    assert max(len(line) for line in lines) < 400
    text = out.getvalue()
    # the free queue has 1000 entries; vLLM frees a request's blocks tail first (2, 1),
    # the mutant puts them at the head in order: the last two positions differ
    assert "lengths 1000 and 1000, 2 positions differ, the first at index 998:" in text
    assert "[exact_match] E1: same hits" in text and "docs/spec.md §11" in text
    assert "report: " in text and path.with_suffix(".html").is_file()


def test_explain_failure_gives_rule_where_and_message() -> None:
    layout = KVCacheLayout(groups=(KVCacheGroup(("l0",), FULL),), num_blocks=3, max_model_len=16)
    failure = {"property": "pool_accounting", "message": "[pool_accounting] 0 free + 1 in use"}
    trace = Trace(layout, (Arrive("r0", (1, 2)), Step(8)), failure=failure)
    assert explain_failure(trace).splitlines() == [
        "[pool_accounting] I1: free + in use == num_blocks - 1 (docs/spec.md §11, Pool accounting)",
        "  at operation 1 (operations 0-1): Step(token_budget=8, num_lookahead_tokens=0), "
        "scheduler step 1",
        "  0 free + 1 in use",
    ]


def test_hypothesis_slow_shrink_warning_becomes_kvconforms_line() -> None:
    from hypothesis.reporting import base_report, with_reporter

    heard: list[str] = []
    with with_reporter(heard.append), honest_shrink_reporter(30):
        base_report(HYPOTHESIS_SLOW_SHRINK + " five minutes ... PLEASE REPORT THIS")
        base_report("Falsifying example: ...")
        base_report("Steps leading up to this error:\nstate = InvariantsMachine()")
    # kvconform's own line, on a line of its own; Hypothesis' internals dropped (issue 37)
    assert heard == [
        "\nkvconform: shrinking stopped after 30 s (--shrink-seconds); the smallest failing "
        "trace found so far is kept",
    ]


def test_ticker_prints_lines_off_a_terminal_and_nothing_when_quiet(monkeypatch) -> None:
    import properties.runner.progress as progress

    monkeypatch.setattr(progress, "FIRST_SECONDS", 0.05)
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.05)
    out = io.StringIO()
    with Ticker("invariants", lambda: (3, 40, 1), stream=out, style="lines"):
        import time

        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert lines and all(line.startswith("  invariants: 3 examples, 40 steps, ") for line in lines)
    assert lines[0].endswith(", 1 failure")
    quiet = io.StringIO()
    with Ticker("invariants", lambda: (3, 40, 1), stream=quiet, style="quiet"):
        time.sleep(0.1)
    assert quiet.getvalue() == ""
    assert progress_text("attention", 3, 90, 12.4, 2) == (
        "  attention: 3 examples, 90 steps, 12s, 2 failures"
    )


def test_attention_failure_names_the_key_block_and_slot_read_wrongly() -> None:
    import pytest

    from properties.checks.attention import AttentionChecker, AttentionMismatch, ScheduledChunk
    from properties.core.engine import RequestInput

    layout = KVCacheLayout(groups=(KVCacheGroup(("l0",), FULL),), num_blocks=8, max_model_len=32)
    checker = AttentionChecker(layout)
    r0 = (1, 2, 3, 4, 5, 6)
    checker.check_step([ScheduledChunk(RequestInput("r0", r0), r0, 0, 6, ((1, 2),))])
    # r1 differs from r0 at position 1, yet its table reuses r0's first block (a bad hit
    # of 4 tokens): its query at 4 reads key 1 from block 1 slot 1, which holds r0's KV
    r1 = (1, 9, 3, 4, 5, 6, 7, 8)
    with pytest.raises(AttentionMismatch) as caught:
        checker.check_step([ScheduledChunk(RequestInput("r1", r1), r1, 4, 4, ((1, 3),))])
    message = str(caught.value)
    assert message.startswith("request 'r1', group 0 (full), position 4: attention output (")
    assert (
        "key position 1 read from block 1 slot 1 (column 0): it holds K/V of another prefix, "
        "the content model expects position 1 of this request's tokens [0, 2)"
    ) in message


def test_check_against_a_mutant_shows_progress_one_name_a_short_failure_and_the_report(
    tmp_path,
) -> None:
    import re
    import subprocess
    import sys

    command = [
        sys.executable, "-m", "properties.tools.cli", "check", "--engine", FREE_HEAD_FIRST,
        "--level", "exact", "--profile", "ci", "--only", "invariants", "--workers", "1",
        "--shrink-seconds", "5", "--failure-dir", str(tmp_path),
        "--no-reach-corpus",  # the progress of drawn examples (the corpus catches it first)
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    # progress off a terminal: plain lines, the first within 5 s of the property's start
    ticks = re.findall(r"^  invariants: \d+ examples, \d+ steps, (\d+)s, \d+ failures?$", out, re.M)
    assert ticks and int(ticks[0]) <= 5, out
    assert "PLEASE REPORT" not in out + done.stderr
    # one bug, one name; its block (rule, where, diff, notes) is short
    block = out.split("\nFAILED in invariants: ", 1)[1].split("\n\nsummary:", 1)[0]
    assert block.startswith("PropertyViolation: [exact_match]")
    assert "\nFAILED" not in block and len(block.splitlines()) < 30, block
    assert "[exact_match] E1:" in block and "at operation " in block
    summary = out.split("\n\nsummary:", 1)[1]
    report = Path(re.search(r"report: (\S+\.html)", summary).group(1))
    trace = Path(re.search(r"trace: (\S+\.json)", summary).group(1))
    assert report.is_file() and report == trace.with_suffix(".html")
    assert f"replay: kvconform replay {trace} --engine {FREE_HEAD_FIRST} --level exact" in summary
