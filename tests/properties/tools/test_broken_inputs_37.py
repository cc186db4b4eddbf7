"""Round three of broken inputs, signals and shared files (issue 37), one test per case.

* A trace is data: ``report`` never loads or starts the engine a trace names (it draws
  the engine's side from the view recorded when the trace was saved); ``replay`` runs an
  engine a file names only when it is built in, or when the user names it.
* A pass means something ran: a selection that leaves no property is a usage error.
* Every way a run is stopped is clean: SIGHUP like SIGTERM (exit 129); engines and what
  they fork end with the run (normally, on a signal, on ``kill -9``); a signal landing in
  a garbage-collection callback still stops the run.
* Deadlines measure the engine: a correct engine made to wait for a CPU is not failed.
* A failure of any tier announces itself; the HTML page is written for every saved trace;
  no Hypothesis internals reach the output.
* Output paths are checked before the run, written whole or not at all; every file read
  is bounded; bad adapters and values get one line and exit 2.

Where a time matters it is a bound a loaded machine cannot break (processes polled for
up to a minute), never a speed.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest

from properties.core.constants import (
    EXIT_ENGINE,
    EXIT_FAILED,
    EXIT_HANGUP,
    EXIT_PASSED,
    EXIT_USAGE,
)
from properties.core.output_files import OutputWriteError, write_text_atomic
from properties.core.trace import load_trace
from properties.tools import cli
from properties.tools.report import render_html
from properties.tools.stopping import Stopped, stop_on_signals
from reference.errors import InvalidRequestError
from tests.properties.tools.broken_engines_37 import BURN_ENV, PIDS_ENV
from tests.properties.tools.test_broken_inputs import (
    BROKEN_MODULE,
    QUICK,
    ROOT,
    _trace_json,
    one_line,
    run_cli,
    saved_traces,
)

FIXTURES = "tests.properties.tools.broken_engines_37"


def _write_trace(path: Path, engine: str, **changes) -> Path:
    data = _trace_json(**changes)
    data["failure"] = {"property": "pool_accounting", "engine": engine, "level": "universal"}
    path.write_text(json.dumps(data))
    return path


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be collected."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _wait_gone(pids: list[int], bound: float = 60.0) -> list[int]:
    """The pids still alive after polling for at most ``bound`` seconds (a liveness
    bound, never a speed: a loaded machine only makes it pass later)."""
    end = time.monotonic() + bound
    while time.monotonic() < end:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


# ---------------------------------------------------------------------------
# A trace is data


@pytest.mark.parametrize("engine", ["exec:sh -c 'touch {marker}'", "os:system"])
def test_report_never_starts_the_engine_a_trace_names(engine, tmp_path):
    marker = tmp_path / "PWNED"
    trace = _write_trace(tmp_path / "t.json", engine.format(marker=marker))
    code, out, err = run_cli("report", str(trace), "--html", str(tmp_path / "p.html"))
    assert code == EXIT_PASSED, out + err
    assert not marker.exists()
    page = (tmp_path / "p.html").read_text()
    assert "carries no record of the engine" in page  # the engine side is said missing


def test_report_never_imports_a_module_a_trace_names(tmp_path):
    marker = tmp_path / "IMPORTED"
    module = tmp_path / "evil_adapter.py"
    module.write_text(f"open({str(marker)!r}, 'w').close()\ndef make(layout): pass\n")
    trace = _write_trace(tmp_path / "t.json", "evil_adapter:make")
    code, out, err = run_cli(
        "report", str(trace), env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    )
    assert code == EXIT_PASSED, out + err
    assert not marker.exists()
    assert (tmp_path / "t.html").is_file()


def test_replay_refuses_an_engine_a_file_names_unless_told(tmp_path):
    marker = tmp_path / "PWNED"
    engine = f"exec:sh -c 'touch {marker}'"
    trace = _write_trace(tmp_path / "t.json", engine)
    code, out, err = run_cli("replay", str(trace))
    assert code == EXIT_USAGE, out + err
    line = one_line(err)
    assert "names the engine" in line and "--trust-recorded-engine" in line
    assert f"kvconform replay {trace} --engine " in line
    assert not marker.exists()
    # told: it runs (the command is no engine, so it fails; the point is that it ran)
    run_cli("replay", str(trace), "--trust-recorded-engine")
    assert marker.exists()


def test_replay_runs_a_built_in_engine_the_file_names(tmp_path):
    trace = _write_trace(tmp_path / "t.json", "reference")
    code, out, err = run_cli("replay", str(trace))
    assert code == EXIT_PASSED, out + err
    assert "--engine not given: using reference, the engine recorded in the trace" in out


def test_a_saved_trace_carries_the_engine_view_and_its_page_shows_it(tmp_path):
    code, out, err = run_cli(
        "check", "--engine", f"{BROKEN_MODULE}:make_miscounts_free_blocks",
        "--failure-dir", str(tmp_path), *QUICK,
    )  # fmt: skip
    assert code == EXIT_FAILED, out + err
    trace_path = max(saved_traces(tmp_path), key=lambda p: p.stat().st_mtime)
    trace = load_trace(trace_path)
    view = trace.engine_view
    assert view["engine"].endswith("make_miscounts_free_blocks")
    assert len(view["steps"]) == len(trace.operations)
    last = view["steps"][-1]
    assert {"tables", "free", "queue", "cached", "ref_counts", "pools"} <= set(last)
    assert last["ref_counts"]  # a block is held at the failing operation
    # rendered again from the file alone: the engine's free count is in the page
    page = tmp_path / "again.html"
    code, out, err = run_cli("report", str(trace_path), "--html", str(page))
    assert code == EXIT_PASSED, out + err
    data = page.read_text()
    assert '"engine_missing": null' in data and '"ref_counts"' in data


def test_the_page_escapes_every_angle_bracket_of_its_data():
    data = {
        "engine": "e",
        "level": "exact",
        "check": "x",
        "operations": [{"op": "arrive", "request_id": "<!--<script>"}],
    }
    page = render_html(data)
    payload = page.split('<script id="data" type="application/json">', 1)[1]
    payload = payload.split("</script>", 1)[0]
    assert "<" not in payload
    assert json.loads(payload)["operations"][0]["request_id"] == "<!--<script>"


# ---------------------------------------------------------------------------
# A pass means something ran


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--no-attention", "--only", "attention"], "no property left to run"),
        (["--only"], "--only names no property"),
    ],
)
def test_a_selection_that_leaves_nothing_is_a_usage_error(options, expected):
    code, out, err = run_cli("check", "--engine", "reference", *options)
    assert code == EXIT_USAGE, out + err
    assert expected in one_line(err)
    assert "summary:" not in out


def test_the_summary_names_what_ran_and_its_wall_time(tmp_path):
    code, out, err = run_cli(
        "check", "--engine", "reference", "--failure-dir", str(tmp_path), *QUICK
    )
    assert code == EXIT_PASSED, out + err
    summary = next(x for x in out.splitlines() if x.startswith("summary: "))
    assert summary.startswith("summary: 1 properties (invariants), ")
    assert "s wall: PASSED" in summary


# ---------------------------------------------------------------------------
# Stopping: SIGHUP, process groups, kill -9, garbage-collection callbacks


def _start_check(tmp_path: Path, workers: int, extra_env: dict | None = None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), PIDS_ENV: str(tmp_path / "pids")}
    return subprocess.Popen(
        [sys.executable, "-m", "properties.tools.cli", "check", "--engine",
         f"{FIXTURES}:make_forks", "--profile", "dev", "--max-examples", "500", "--seed",
         "1", "--workers", str(workers), "--only", "invariants", "production",
         "--failure-dir", str(tmp_path / "f")],
        cwd=ROOT, env={**env, **(extra_env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def _helpers(tmp_path: Path) -> list[int]:
    path = tmp_path / "pids"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _wait_for_helpers(tmp_path: Path, proc: subprocess.Popen) -> None:
    end = time.monotonic() + 120
    while len(_helpers(tmp_path)) < 3:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "the engine never started"
        time.sleep(0.2)


def _descendants(pid: int) -> list[int]:
    from properties.core.processes import descendants

    return descendants(pid)


def test_an_engine_s_forks_end_with_a_run_that_ends_normally(tmp_path):
    code, out, err = run_cli(
        "check", "--engine", f"{FIXTURES}:make_forks", "--workers", "2", "--failure-dir",
        str(tmp_path / "f"), "--profile", "dev", "--max-examples", "5", "--seed", "1",
        "--only", "invariants", "production", env={PIDS_ENV: str(tmp_path / "pids")},
    )  # fmt: skip
    assert code == EXIT_PASSED, out + err
    helpers = _helpers(tmp_path)
    assert helpers  # the engine was built, and forked each time
    assert _wait_gone(helpers) == []


@pytest.mark.parametrize(
    ("signum", "expected"),
    [(signal.SIGHUP, EXIT_HANGUP), (signal.SIGTERM, 143), (signal.SIGINT, 130)],
)
def test_a_signal_ends_the_run_and_everything_it_started(signum, expected, tmp_path):
    """The signal goes to the whole process group, as a closed terminal's SIGHUP or a CI
    runner's cancel does: the run says so and exits with the signal's code; the workers,
    the engine children and the processes the engine forked are gone."""
    proc = _start_check(tmp_path, workers=2)
    _wait_for_helpers(tmp_path, proc)
    started = _descendants(proc.pid) + _helpers(tmp_path)
    os.killpg(proc.pid, signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == expected, out + err
    name = signal.Signals(signum).name
    assert f"kvconform check: stopped by {name}; workers and engines ended" in out
    assert "Traceback" not in err and "resource_tracker" not in err
    assert _wait_gone(started + _helpers(tmp_path)) == []


@pytest.mark.parametrize("workers", [1, 2])
def test_kill_9_of_kvconform_orphans_nothing(workers, tmp_path):
    """Only the main process is killed (no handler can run): its workers get the
    parent-death signal and end their engines; the watchdog ends the main process's."""
    proc = _start_check(tmp_path, workers=workers)
    _wait_for_helpers(tmp_path, proc)
    started = [p for p in _descendants(proc.pid) if not _is_resource_tracker(p)]
    started += _helpers(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert _wait_gone(started + _helpers(tmp_path)) == []


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_a_stop_signal_inside_a_gc_callback_still_stops_the_run():
    """Python drops an exception raised in a ``gc.callbacks`` entry ("Exception ignored
    in ..."): the handler delivers the signal again outside it."""
    inside = threading.Event()

    def slow_callback(phase: str, info: dict) -> None:
        if phase == "start":
            inside.set()
            time.sleep(1.0)  # the signal arrives here

    def send() -> None:
        inside.wait(30)
        os.kill(os.getpid(), signal.SIGTERM)

    gc.callbacks.append(slow_callback)
    try:
        with pytest.raises(Stopped) as stopped, stop_on_signals():
            threading.Thread(target=send, daemon=True).start()
            gc.collect()
            time.sleep(30)  # the stop must interrupt this, not be lost in the callback
    finally:
        gc.callbacks.remove(slow_callback)
    assert stopped.value.signum == signal.SIGTERM


def test_a_stop_signal_inside_a_weakref_callback_still_stops_the_run():
    """A weakref callback the frames do not show as a finalizer (any name, any module):
    Python drops the Stopped raised there and hands it to ``sys.unraisablehook``, which
    delivers the signal again outside it (found as a rare CI failure of the gc test
    above: a collection ran such a callback when the signal came)."""
    inside = threading.Event()

    class Thing:
        pass

    def on_collected(_ref) -> None:
        inside.set()
        time.sleep(1.0)  # the signal arrives here

    def send() -> None:
        inside.wait(30)
        os.kill(os.getpid(), signal.SIGTERM)

    thing = Thing()
    ref = weakref.ref(thing, on_collected)
    with pytest.raises(Stopped) as stopped, stop_on_signals():
        threading.Thread(target=send, daemon=True).start()
        del thing  # the callback runs now, in this thread
        time.sleep(30)  # the stop must interrupt this, not be lost in the callback
    assert stopped.value.signum == signal.SIGTERM and ref() is None


# ---------------------------------------------------------------------------
# Hung and slow engines


def test_after_a_hung_engine_nothing_waits_on_it_again(tmp_path):
    """The engine misses its deadline once: it is not started again for the report (a
    missed deadline is recorded, not replayed), and the page is written."""
    code, out, err = run_cli(
        "check", "--engine", f"{BROKEN_MODULE}:make_hang_sleep", "--call-timeout", "1",
        "--failure-dir", str(tmp_path), *QUICK,
    )  # fmt: skip
    assert code == EXIT_ENGINE, out + err
    trace_path = saved_traces(tmp_path)[0]
    view = load_trace(trace_path).engine_view
    assert view["omitted"] == "the engine missed a deadline; it is not replayed"
    assert trace_path.with_suffix(".html").is_file()
    assert "report: not written" not in out


def test_an_endless_answer_line_is_a_protocol_error_naming_the_limit(monkeypatch):
    from properties.engines import exec_engine

    monkeypatch.setattr(exec_engine, "MAX_ANSWER_BYTES", 1 << 20)
    script = (
        "import sys, json\n"
        "line = sys.stdin.readline()\n"
        "print(json.dumps({'id': json.loads(line)['id'], 'result': "
        "{'protocol': 1, 'name': 'x'}}), flush=True)\n"
        "sys.stdin.readline()\n"
        "sys.stdout.write('x' * (8 << 20)); sys.stdout.flush()\n"
        "import time; time.sleep(60)\n"
    )
    proc = exec_engine.ExecProcess([sys.executable, "-c", script], timeout=30)
    proc.start()
    with pytest.raises(exec_engine.ExecProtocolError, match=r"more than 1048576 bytes"):
        proc.call("create", {})
    proc.close()


def test_a_correct_engine_waiting_for_a_cpu_is_not_failed(tmp_path):
    """The check and three CPU-bound processes share one CPU: the engine's first
    ``new_step`` burns 0.6 s of its own CPU time, well within its 1.5 s limit, but waits
    for the CPU far longer in wall time. Charged its own time, it passes (on 7ec927c the
    wall-time deadline failed it)."""
    cpu = min(os.sched_getaffinity(0))
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"],
                         preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        for _ in range(3)
    ]  # fmt: skip
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT), BURN_ENV: "0.6"}
        proc = subprocess.run(
            [sys.executable, "-m", "properties.tools.cli", "check", "--engine",
             f"{FIXTURES}:make_burns_cpu_once", "--isolation", "none", "--call-timeout",
             "1.5", "--failure-dir", str(tmp_path), *QUICK],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
        )  # fmt: skip
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert proc.returncode == EXIT_PASSED, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------
# Tiers, pages and output


def test_a_medium_tier_failure_announces_itself_as_found(tmp_path):
    code, out, err = run_cli(
        "check", "--engine", f"{FIXTURES}:make_miscounts_at_scale", "--profile", "dev",
        "--max-examples", "3", "--seed", "1", "--only", "invariants", "--tiers", "medium",
        "--tier-examples", "3", "--failure-dir", str(tmp_path), timeout=600,
    )  # fmt: skip
    assert code == EXIT_FAILED, out + err
    first = next(x for x in out.splitlines() if "first failure [" in x)
    assert first.strip().startswith(
        "invariants: first failure [pool_accounting] at the medium tier"
    )
    trace_line = next(x for x in out.splitlines() if "first failing trace: " in x)
    assert Path(trace_line.split("first failing trace: ", 1)[1]).is_file()


def test_the_page_is_written_in_process_and_no_hypothesis_text_leaks(tmp_path):
    """One worker runs the property in the main process, where the first failure is
    announced from inside the Hypothesis test; the engine has a layout strategy (drawn
    from when it is loaded): on 7ec927c the page failed with Hypothesis' nested-@given
    health check."""
    code, out, err = run_cli(
        "check", "--engine", f"{FIXTURES}:ENGINE_WITH_STRATEGY", "--workers", "1",
        "--isolation", "none", "--failure-dir", str(tmp_path), *QUICK,
    )  # fmt: skip
    assert code == EXIT_FAILED, out + err
    assert "report: not written" not in out
    assert "Steps leading up to this error" not in out + err
    assert "state = " not in out + err
    for trace in saved_traces(tmp_path):
        assert trace.with_suffix(".html").is_file()


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--report-json", "/tmp"], "--report-json '/tmp': is a directory, not a file"),
        (["--junit-xml", "/dev/full"], "is not a regular file"),
        (["--report-json", "/proc/kvconform/x.json"], "cannot write in '/proc'"),
        (["--failure-dir", "/proc/kvconform"], "--failure-dir '/proc/kvconform': cannot"),
        (["--xfails-file", "/dev/zero"], "--xfails-file '/dev/zero' gives over"),
    ],
)
def test_bad_output_and_input_paths_fail_before_the_run(options, expected, tmp_path):
    code, out, err = run_cli("check", "--engine", "reference", *QUICK, *options)
    assert code == EXIT_USAGE, out + err
    assert expected in one_line(err)
    assert "kvconform check: engine=" not in out  # nothing ran


def test_two_reports_naming_one_file_are_refused(tmp_path):
    same = str(tmp_path / "out")
    code, out, err = run_cli(
        "check", "--engine", "reference", *QUICK, "--report-json", same, "--junit-xml", same
    )
    assert code == EXIT_USAGE, out + err
    assert "--report-json and --junit-xml name the same file" in one_line(err)


def test_a_binary_xfails_file_is_named_with_its_option(tmp_path):
    binary = tmp_path / "xf.bin"
    binary.write_bytes(b"\x00\xff\xfe\x80" * 10)
    code, out, err = run_cli("check", "--engine", "reference", *QUICK, "--xfails-file", str(binary))
    assert code == EXIT_USAGE, out + err
    line = one_line(err)
    assert f"--xfails-file {str(binary)!r} is not UTF-8 text" in line


def test_a_failed_report_write_keeps_the_run_s_code_and_leaves_no_file(
    tmp_path, capsys, monkeypatch
):
    """A full disk after the run: the JSON report is not written (no empty file, no
    temporary left), the engine error's exit code 3 stands, and the line says so."""
    from properties.tools import results

    def full_disk(path, text, what):
        raise OutputWriteError(f"{what} {str(path)!r} was not written: No space left on device")

    monkeypatch.setattr(results, "write_text_atomic", full_disk)
    out_json = tmp_path / "r.json"
    code = cli.main(
        ["check", "--engine", f"{BROKEN_MODULE}:make_table_none", "--isolation", "none",
         "--failure-dir", str(tmp_path / "f"), "--report-json", str(out_json), *QUICK]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == EXIT_ENGINE, captured.out + captured.err
    assert "report: not written: the JSON report" in captured.err
    assert not out_json.exists()


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "report.json"
    target.write_text("old")

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OutputWriteError, match="No space left on device"):
        write_text_atomic(target, "new", "the JSON report")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_report_html_to_an_unwritable_place_is_a_usage_error(tmp_path):
    trace = _write_trace(tmp_path / "t.json", "reference")
    code, out, err = run_cli("report", str(trace), "--html", "/proc/kvconform.html")
    assert code == EXIT_USAGE, out + err
    assert "--html '/proc/kvconform.html': cannot write in '/proc'" in one_line(err)


def test_corpus_paths_with_symlink_loops_are_usage_errors(tmp_path):
    loop_a, loop_b = tmp_path / "a", tmp_path / "b"
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    code, out, err = run_cli("corpus", "export", str(loop_a / "corpus"))
    assert code == EXIT_USAGE, out + err
    assert "leads nowhere" in one_line(err)
    corpus = tmp_path / "corpus"
    code, out, err = run_cli("corpus", "export", str(corpus), "--per-mode", "1")
    assert code == EXIT_PASSED, out + err
    case = sorted((corpus / "cases").glob("*.json"))[0]
    case.unlink()
    case.symlink_to(case)  # a loop where a case should be
    code, out, err = run_cli("corpus", "run", str(corpus), "--engine", "reference")
    assert code == EXIT_USAGE, out + err
    assert "Symlink loop" in one_line(err) or "symbolic links" in one_line(err)


# ---------------------------------------------------------------------------
# Bad adapters, databases and values


def test_an_adapter_module_whose_getattr_raises_is_a_usage_error(tmp_path):
    (tmp_path / "raising_mod.py").write_text(
        "def __getattr__(name):\n    raise RuntimeError('boom')\n"
    )
    code, out, err = run_cli(
        "check", "--engine", "raising_mod:make", *QUICK,
        env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"},
    )  # fmt: skip
    assert code == EXIT_USAGE, out + err
    assert "reading 'make' from module 'raising_mod' raised RuntimeError: boom" in one_line(err)


def test_a_factory_whose_attributes_raise_is_a_usage_error(tmp_path):
    (tmp_path / "raising_factory.py").write_text(
        "from properties.engines.reference import make_engine\n"
        "class F:\n"
        "    def __call__(self, layout):\n        return make_engine(layout)\n"
        "    def __getattr__(self, name):\n        raise RuntimeError('no ' + name)\n"
        "make = F()\n"
    )
    code, out, err = run_cli(
        "check", "--engine", "raising_factory:make", *QUICK,
        env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"},
    )  # fmt: skip
    assert code == EXIT_USAGE, out + err
    assert "factory attribute spec_types: reading it raised RuntimeError" in one_line(err)


def test_an_engine_under_test_without_a_factory_is_a_usage_error(tmp_path):
    (tmp_path / "nofactory.py").write_text(
        "from kvconform import EngineUnderTest\nENGINE = EngineUnderTest(name='x', factory=None)\n"
    )
    code, out, err = run_cli(
        "check", "--engine", "nofactory:ENGINE", *QUICK,
        env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"},
    )  # fmt: skip
    assert code == EXIT_USAGE, out + err
    assert "factory must be a callable" in one_line(err)


@pytest.mark.parametrize(
    ("database", "expected"),
    [
        ("postgres://db/x", "only redis://HOST:PORT[/DB] or a directory is supported"),
        ("/proc/kvconform-db", "cannot write in '/proc'"),
    ],
)
def test_fuzz_databases_are_checked_before_any_worker(database, expected):
    code, out, err = run_cli(
        "fuzz", "--engine", "reference", "--minutes", "0.1", "--database", database
    )
    assert code == EXIT_USAGE, out + err
    assert expected in one_line(err)
    assert "failures" not in out


def test_a_factory_returning_none_is_named(tmp_path):
    code, out, err = run_cli(
        "check", "--engine", f"{BROKEN_MODULE}:make_factory_returns_none",
        "--failure-dir", str(tmp_path), *QUICK,
    )  # fmt: skip
    assert code == EXIT_ENGINE, out + err
    assert "returned None instead of an engine" in out
    assert 'no engine yet: send "create" first' not in out


def test_replaying_a_window_trace_on_a_full_attention_engine_is_unsupported(tmp_path):
    trace = tmp_path / "t.json"
    data = _trace_json(
        groups=[
            {"layer_names": ["l0"], "spec": {"type": "full", "block_size": 4}},
            {"layer_names": ["l1"], "spec": {"type": "sliding_window", "block_size": 4,
                                             "sliding_window": 4}},
        ]
    )  # fmt: skip
    trace.write_text(json.dumps(data))
    code, out, err = run_cli("replay", str(trace), "--engine", f"{FIXTURES}:make_full_only")
    assert code == EXIT_USAGE, out + err
    assert "does not support this trace's layout" in one_line(err)


def test_reference_make_request_with_no_prompt_is_a_clear_error():
    from properties.core.trace import layout_from_json
    from reference.kv_cache_manager import KVCacheManager

    manager = KVCacheManager(layout_from_json(_trace_json()["layout"]))
    with pytest.raises(InvalidRequestError, match="must be a sequence of token ids, got None"):
        manager.make_request("r", None)
