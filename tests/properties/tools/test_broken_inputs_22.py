"""Round two of broken engines, signals and bad values (issue 22), one test per class.

* False passes: an in-process engine that calls ``os._exit(0)`` or ``sys.exit(0)`` is an
  engine error (exit 3) naming its call; an adapter that mutates the token list it is
  given cannot corrupt kvconform's model (a correct engine passes).
* Signals: SIGINT/SIGTERM stop ``check`` within seconds with 130/143, or with the code
  of a failure found before the signal, whose trace is kept and reported.
* Failures that do not repeat (an ``exec:`` engine that exits or sends garbage once
  over its lifetime, an adapter that raises ``MemoryError`` once): the first engine
  error recorded, exit 3, a note that it did not reproduce, never Hypothesis' ``Flaky``.
* Bad values and paths: exit 2 with one line naming the option or the file.
* Exit codes: a bug of kvconform itself exits 70 with one line and the ``--verbose``
  hint (:mod:`properties.core.outcome`).

The CLI runs in a subprocess (``run_cli`` of ``test_broken_inputs``) wherever the exit
code of the process or a signal matters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from properties.core.constants import (
    EXIT_ENGINE,
    EXIT_FAILED,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_PASSED,
    EXIT_TERMINATED,
    EXIT_USAGE,
)
from properties.core.outcome import Outcome, combined_exit_code
from properties.core.trace import load_trace
from properties.tools import cli
from tests.properties.tools.test_broken_inputs import (
    BROKEN_MODULE,
    QUICK,
    ROOT,
    _trace_json,
    one_line,
    run_cli,
    run_pytest_with_engine,
    saved_traces,
)

IN_PROCESS = ["--isolation", "none"]


def served(name: str) -> str:
    """``exec:`` engine serving the fixture ``make_<name>`` in a child process."""
    return f"exec:python -m properties.engines.serve {BROKEN_MODULE}:make_{name}"


def engine_error_line(out: str) -> str:
    return next(x for x in out.splitlines() if x.startswith("ENGINE ERROR"))


# ---------------------------------------------------------------------------
# False passes


def test_in_process_engine_calling_os_exit_0_is_an_engine_error(tmp_path):
    code, out, err = run_cli(
        "check",
        "--engine",
        f"{BROKEN_MODULE}:make_exits_zero",
        *IN_PROCESS,
        "--failure-dir",
        str(tmp_path),
        *QUICK,
    )
    assert code == EXIT_ENGINE, out + err
    line = engine_error_line(out)
    assert "the engine ended the worker process of property invariants (exit code 0)" in line
    assert "during broken: new_step()" in line


def test_replay_on_an_engine_calling_os_exit_0_is_an_engine_error(tmp_path):
    path = tmp_path / "trace.json"
    steps = [{"op": "step", "token_budget": 8, "num_lookahead_tokens": 0}] * 4
    arrive = {"op": "arrive", "request_id": "r0", "prompt": [1, 2, 3], "output": [4, 5, 6]}
    path.write_text(json.dumps(_trace_json(operations=[arrive, *steps])))
    engine = f"{BROKEN_MODULE}:make_exits_zero"
    code, out, err = run_cli("replay", str(path), "--engine", engine, *IN_PROCESS)
    assert code == EXIT_ENGINE, out + err
    assert (
        "ENGINE ERROR (the engine broke the protocol): the engine ended the process "
        "(exit code 0) during broken: new_step(), before any verdict"
    ) in out.splitlines()


def test_engine_calling_sys_exit_0_is_an_engine_error(tmp_path):
    code, out, err = run_cli(
        "check",
        "--engine",
        f"{BROKEN_MODULE}:make_sys_exit_zero",
        *IN_PROCESS,
        "--failure-dir",
        str(tmp_path),
        *QUICK,
    )
    assert code == EXIT_ENGINE, out + err
    assert "broken: new_step() raised SystemExit: 0" in engine_error_line(out)
    assert saved_traces(tmp_path)  # the first failing trace and the shrunk one


def test_engine_mutating_its_token_list_does_not_corrupt_the_model(tmp_path):
    """The engine empties the output-token list it gets; on main the checker's own list
    went empty with it and this correct engine failed ``hit_soundness``."""
    code, out, err = run_cli(
        "check",
        "--engine",
        f"{BROKEN_MODULE}:make_mutates_tokens",
        *IN_PROCESS,
        "--failure-dir",
        str(tmp_path),
        "--profile",
        "dev",
        "--max-examples",
        "30",
        "--seed",
        "1",
        "--only",
        "invariants",
    )
    assert code == EXIT_PASSED, out + err
    assert "invariants   PASS" in out
    assert saved_traces(tmp_path) == []


# ---------------------------------------------------------------------------
# Failures that do not repeat on replay


@pytest.mark.parametrize(
    ("engine", "isolation", "expected"),
    [
        (served("exits_once"), [], "exited with status 7 during new_step()"),
        (served("garbage_once"), [], "new_step() answered a line that is not JSON"),
        (
            f"{BROKEN_MODULE}:make_memory_error_once",
            IN_PROCESS,
            "new_step() raised MemoryError: the engine leaked",
        ),
    ],
    ids=["exec-exits", "exec-garbage", "memory-error"],
)
def test_failure_that_does_not_repeat_is_the_first_engine_error(
    engine, isolation, expected, tmp_path
):
    code, out, err = run_cli(
        "check", "--engine", engine, *isolation, "--failure-dir", str(tmp_path), *QUICK
    )
    assert code == EXIT_ENGINE, out + err
    assert expected in engine_error_line(out)
    assert "note: the failure did not reproduce when Hypothesis replayed it" in out
    assert "Flaky" not in out + err and "INTERNAL ERROR" not in out
    (path,) = saved_traces(tmp_path)
    assert f"trace: {path}" in out
    saved = load_trace(path)
    assert saved.failure["kind"] == "engine" and expected in saved.failure["message"]


# ---------------------------------------------------------------------------
# Signals


def _start_check(*args: str, failure_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "properties.tools.cli", "check", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    return proc


def _read_until(proc: subprocess.Popen, prefix: str) -> str:
    seen = ""
    while True:
        line = proc.stdout.readline()
        seen += line
        assert line, f"the command ended before printing {prefix!r}: {seen}"
        if line.strip().startswith(prefix):
            return seen


@pytest.mark.parametrize(
    ("signum", "expected"),
    [(signal.SIGINT, EXIT_INTERRUPTED), (signal.SIGTERM, EXIT_TERMINATED)],
)
def test_signal_stops_check_within_seconds(signum, expected, tmp_path):
    """A correct outside adapter (in an isolated child): the signal goes to the whole
    process group, as a terminal's Ctrl-C does; the engine child, in its own session,
    must not be blamed (no failure trace) and the command stops at once (within a
    liveness bound)."""
    proc = _start_check(
        "--engine",
        f"{BROKEN_MODULE}:make_rejects_in_determinism",
        "--workers",
        "2",
        "--no-attention",
        "--failure-dir",
        str(tmp_path),
        failure_dir=tmp_path,
    )
    _read_until(proc, "checks:")
    time.sleep(1.0)  # the workers and their engine children are running
    start = time.monotonic()
    os.killpg(proc.pid, signum)
    out, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == expected, out + err
    # a liveness bound, not a speed: the run left alone goes on for minutes, a stop
    # takes about a second; 30 s leaves room for two loaded cores
    assert elapsed < 30, (elapsed, out, err)
    assert f"kvconform check: stopped by {signal.Signals(signum).name}" in out, out + err
    assert "Traceback" not in err, err
    assert saved_traces(tmp_path) == [], out


def test_signal_after_a_failure_keeps_and_reports_it(tmp_path):
    proc = _start_check(
        "--engine",
        f"{BROKEN_MODULE}:make_miscounts_free_blocks",
        "--only",
        "invariants",
        "--failure-dir",
        str(tmp_path),
        failure_dir=tmp_path,
    )
    seen = _read_until(proc, "first failing trace:")  # then it shrinks for up to 30 s
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_FAILED, seen + out + err
    # a liveness bound: left alone the shrink goes on for 30 s; 20 s leaves room for two
    # loaded cores
    assert time.monotonic() - start < 20
    (path,) = saved_traces(tmp_path)
    assert "found before the stop: invariants: first failure [pool_accounting]" in out
    assert f"trace: {path}" in out


# ---------------------------------------------------------------------------
# Bad values and paths: exit 2, one line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["check", "--call-timeout", "nan"], "--call-timeout must be a number of seconds >= 0"),
        (["check", "--call-timeout", "inf"], "and <= 86400 (0: no deadline), got inf"),
        (["check", "--shrink-seconds", "nan"], "--shrink-seconds must be a finite number"),
        (["check", "--max-examples", "10" * 10], "--max-examples must be <= 10000000"),
        (["check", "--workers", "100000"], "--workers must be <= 1024, got 100000"),
        (["fuzz", "--minutes", "nan"], "--minutes must be a finite number, got nan"),
        (["fuzz", "--minutes", "inf"], "--minutes must be a finite number, got inf"),
        (["fuzz", "--minutes", "1", "--progress-seconds", "0"], "--progress-seconds must be > 0"),
        (["corpus", "export", "x", "--per-mode", "0"], "--per-mode must be >= 1, got 0"),
        (["bench", "engines", "--repeat", "0"], "--repeat must be >= 1, got 0"),
    ],
)
def test_bad_number_is_a_usage_error(args, expected):
    code, out, err = run_cli(*args)
    assert code == EXIT_USAGE, out + err
    assert expected in one_line(err)


def test_bad_exec_timeout_variable_is_a_usage_error():
    code, out, err = run_cli(
        "check", "--engine", served("exits_once"), *QUICK, env={"KVCONFORM_EXEC_TIMEOUT": "abc"}
    )
    assert code == EXIT_USAGE, out + err
    assert "KVCONFORM_EXEC_TIMEOUT must be a number of seconds in (0, 86400], got 'abc'" in (
        one_line(err)
    )


def _deep_trace(depth: int) -> str:
    return '{"format": "kvconform-trace/1", "x": ' + "[" * depth + "]" * depth + "}"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (_deep_trace(200_000), "is nested deeper than the JSON parser's limit"),
        (
            json.dumps(_trace_json()).replace("[1, 2, 3]", "[" + "9" * 5000 + "]"),
            "an integer of 5000 digits, more than the limit 20",
        ),
    ],
    ids=["200000-deep", "5000-digits"],
)
def test_unbounded_trace_is_a_load_error_naming_the_file(content, expected, tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(content)
    code, out, err = run_cli("replay", str(path), "--engine", "reference")
    assert code == EXIT_USAGE, out + err
    line = one_line(err)
    assert line.startswith(f"kvconform: trace file {str(path)!r}") and expected in line


def test_replay_of_an_endless_file_is_bounded():
    code, out, err = run_cli("replay", "/dev/zero", "--engine", "reference", timeout=60)
    assert code == EXIT_USAGE, out + err
    assert "trace file '/dev/zero' gives over 67108864 bytes, more than the limit" in one_line(err)


def test_corpus_on_a_file_and_outside_paths_are_usage_errors(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for args in (["run", str(afile)], ["export", str(afile), "--per-mode", "1"]):
        code, out, err = run_cli("corpus", *args)
        assert code == EXIT_USAGE, out + err
        assert one_line(err) == f"kvconform corpus: {afile} is a file, not a corpus directory"
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    manifest = {"format": "kvconform-corpus/1", "cases": [{"file": "../../../../etc/passwd"}]}
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = run_cli("corpus", "run", str(corpus))
    assert code == EXIT_USAGE, out + err
    assert one_line(err) == (
        f"kvconform corpus: {corpus / 'manifest.json'}: cases[0] names "
        "'../../../../etc/passwd', outside the corpus directory"
    )


def test_fuzz_database_on_a_file_is_a_usage_error(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, out, err = run_cli("fuzz", "--minutes", "0.05", "--database", str(afile))
    assert code == EXIT_USAGE, out + err
    assert f"--database '{afile}': '{afile}' is not a directory" in one_line(err)


def test_replay_without_engine_uses_the_recorded_one_or_asks(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace_json()))
    code, out, err = run_cli("replay", str(path))
    assert code == EXIT_USAGE, out + err
    assert one_line(err) == f"kvconform: {path} records no engine: give --engine"
    engine = f"{BROKEN_MODULE}:make_table_none"
    failure = {"property": "x", "kind": "engine", "message": "m", "engine": engine}
    path.write_text(json.dumps(_trace_json(failure=failure)))
    # not a built-in engine: run only when told (issue 37: a trace is data)
    code, out, err = run_cli("replay", str(path), *IN_PROCESS)
    assert code == EXIT_USAGE, out + err
    assert "--trust-recorded-engine" in one_line(err)
    code, out, err = run_cli("replay", str(path), "--trust-recorded-engine", *IN_PROCESS)
    assert code == EXIT_ENGINE, out + err
    assert out.splitlines()[0] == (
        f"--engine not given: using {engine}, the engine recorded in the trace"
    )


def test_bench_with_an_unknown_engine_is_a_usage_error():
    code, out, err = run_cli("bench", "engines", "--engines", "nosuchengine")
    assert code == EXIT_USAGE, out + err
    assert "--engine 'nosuchengine' is neither a built-in engine" in one_line(err)


def test_pytest_with_an_exec_engine_that_cannot_start_is_a_usage_error():
    proc = run_pytest_with_engine("exec:./nonexistent")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert "--kv-engine: exec engine './nonexistent': cannot start './nonexistent'" in (proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr


# ---------------------------------------------------------------------------
# Exit codes: one table


def test_a_bug_of_kvconform_exits_70_with_one_line(monkeypatch, capsys):
    def broken_command(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "cmd_check", broken_command)
    assert cli.main(["check"]) == EXIT_INTERNAL == 70
    err = capsys.readouterr().err
    assert one_line(err) == (
        "kvconform: internal error: RuntimeError: a bug (--verbose shows the traceback)"
    )


def test_outcome_table():
    assert [(o.kind, o.exit_code) for o in Outcome] == [
        ("passed", 0),
        ("property", 1),
        ("usage", 2),
        ("no_layout", 2),
        ("engine", 3),
        ("coverage", 4),
        ("internal", 70),
        ("hangup", 129),
        ("interrupted", 130),
        ("terminated", 143),
    ]
    assert combined_exit_code(["property", "engine", None]) == 3
    assert combined_exit_code(["property", "internal"]) == 70
    assert combined_exit_code(["no_layout", "engine"]) == 2
    assert combined_exit_code([None, None]) == 0
    assert combined_exit_code(["coverage", "property"]) == 1  # a failure before a regression
    assert Outcome.of_failure(AssertionError()) is Outcome.PROPERTY
    assert Outcome.of_failure(KeyError()) is Outcome.INTERNAL
    assert Outcome.of_error(ValueError()) is Outcome.USAGE


def test_corpus_run_on_an_engine_calling_os_exit_0_is_an_engine_error(tmp_path):
    """``corpus run`` drives an adapter in this process: in a forked child, so an engine
    that ends the process is an engine error (exit 3), not a silent exit 0."""
    corpus = tmp_path / "corpus"
    code, out, err = run_cli("corpus", "export", str(corpus), "--per-mode", "1")
    assert code == 0, out + err
    engine = f"{BROKEN_MODULE}:make_exits_zero"
    code, out, err = run_cli("corpus", "run", str(corpus), "--engine", engine)
    assert code == EXIT_ENGINE, out + err
    assert (
        "ENGINE ERROR (the engine broke the protocol): the engine ended the process "
        "(exit code 0) during broken: new_step(), before any verdict"
    ) in out.splitlines()


def test_signal_stops_bench_with_a_summary_of_the_rows_finished():
    """``bench engines`` stopped by SIGTERM after its first row: 143, and the rows
    measured so far are summarised (a table), not lost."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "properties.tools.cli", "bench", "engines", "--engines",
         "reference", "optimized", "--scale", "16"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    _read_until(proc, "bench: ")
    os.killpg(proc.pid, signal.SIGTERM)
    # the whole bench runs for minutes; the stop ends it within the timeout (a bound a
    # loaded machine cannot fail by being slow)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_TERMINATED, out + err
    line = next(x for x in out.splitlines() if x.startswith("stopped by SIGTERM: "))
    finished = int(line.split(": ")[1].split()[0])
    assert finished >= 1 and line.endswith("rows finished before the stop")
    assert "Traceback" not in err
