"""A gate that never hangs, never passes falsely and never loses a failure (issue 10).

Broken engines (``broken_engines.py``: every kind of malformed answer, exceptions, hangs,
failing factories), broken adapters, bad options, malformed traces, an unwritable
failure directory, an interrupted fuzz campaign and a bad pytest ``--kv-engine``. Each
case asserts the exit code (0 passed, 1 a property failed, 2 usage or configuration,
3 the engine broke the protocol, 130 interrupted), the one line that names what is
wrong, and that a failure trace exists wherever a failure was found.

Where the exit code of the process matters the real command runs in a subprocess
(``python -m properties.tools.cli``); the many malformed-answer cases call the same
``main`` in this process, with shrinking off (a protocol error is found at the first
call of its kind: shrinking would only cost time), so the module stays fast.
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
from hypothesis import Phase, settings

from properties.core import trace as trace_module
from properties.core.constants import (
    EXIT_ENGINE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_PASSED,
    EXIT_USAGE,
)
from properties.core.trace import TraceFormatError, load_trace
from properties.runner import profiles
from properties.tools import cli
from reference.errors import KVConformError
from tests.properties.tools.broken_engines import BROKEN, IMPOSSIBLE

ROOT = Path(__file__).resolve().parents[3]
BROKEN_MODULE = "tests.properties.tools.broken_engines"
QUICK = ["--profile", "dev", "--max-examples", "20", "--seed", "1", "--only", "invariants"]


def run_cli(*args: str, cwd: Path = ROOT, env: dict | None = None, timeout: float = 120):
    """The real ``kvconform`` in a subprocess: (exit code, stdout, stderr)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "properties.tools.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout, proc.stderr


def one_line(stderr: str) -> str:
    """The error line: exactly one line, no traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def saved_traces(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.json")) if directory.is_dir() else []


@pytest.fixture(autouse=True)
def keep_hypothesis_profile():
    """``cli.main`` loads its profile globally: put the session's back afterwards."""
    current = settings.get_current_profile_name()
    yield
    settings.load_profile(current)


@pytest.fixture
def no_shrink(monkeypatch):
    """``kvconform check`` in this process with shrinking off."""
    load = profiles.load_profile

    def load_without_shrink(name: str):
        return settings(load(name), phases=(Phase.explicit, Phase.generate))

    monkeypatch.setattr(profiles, "load_profile", load_without_shrink)


# ---------------------------------------------------------------------------
# Malformed answers, exceptions and hangs: exit 3, a named call, a saved trace


@pytest.mark.parametrize("name", [n for n in BROKEN if n != "hang_c" and n not in IMPOSSIBLE])
def test_broken_engine_is_a_named_engine_error(name, tmp_path, capsys, no_shrink):
    method, _rewrite, expected = BROKEN[name]
    code = cli.main(
        [
            "check",
            "--engine",
            f"{BROKEN_MODULE}:make_{name}",
            "--isolation",
            "none",
            "--call-timeout",
            "0.3",
            "--failure-dir",
            str(tmp_path),
            *QUICK,
        ]
    )
    out = capsys.readouterr().out
    assert code == EXIT_ENGINE, out
    line = next(x for x in out.splitlines() if x.startswith("ENGINE ERROR"))
    assert expected in line and f"{method}(" in line, line
    # the summary's trace, and the first failing trace when it was announced apart
    traces = saved_traces(tmp_path)
    summary = out.split("\nsummary:", 1)[1]
    final = next(x.split("trace: ", 1)[1] for x in summary.splitlines() if "trace: " in x)
    assert Path(final) in traces and 1 <= len(traces) <= 2, (traces, out)
    for path in traces:
        saved = load_trace(path)
        assert saved.failure["kind"] == "engine"
        assert saved.failure["engine"] == f"{BROKEN_MODULE}:make_{name}"
        assert saved.seed == 1 and saved.failure["versions"]["python"]


@pytest.mark.parametrize("name", sorted(IMPOSSIBLE))
def test_an_impossible_answer_is_a_failure_of_its_check(name, tmp_path, capsys, no_shrink):
    """A free count no pool can have is well formed: the engine is wrong (exit 1, the
    check that catches it named), as the same bug is everywhere else (issue 42)."""
    code = cli.main(
        ["check", "--engine", f"{BROKEN_MODULE}:make_{name}", "--isolation", "none",
         "--failure-dir", str(tmp_path), *QUICK]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == EXIT_FAILED, out
    line = next(x for x in out.splitlines() if x.startswith("FAILED in invariants"))
    assert f"PropertyViolation: [{IMPOSSIBLE[name]}] broken: num_free_blocks() returned" in line
    assert load_trace(saved_traces(tmp_path)[0]).failure["kind"] == "property"


def test_hang_in_c_code_is_killed_in_a_child_process(tmp_path):
    """C code holding the GIL without checking signals: only a child process can stop it."""
    start = time.monotonic()
    code, out, err = run_cli(
        "check",
        "--engine",
        f"{BROKEN_MODULE}:make_hang_c",
        "--isolation",
        "process",
        "--call-timeout",
        "1",
        "--failure-dir",
        str(tmp_path),
        *QUICK,
    )
    assert code == EXIT_ENGINE, out + err
    assert "new_step() got no answer within 1 s of its own time (" in out
    assert "waiting for a CPU; load average " in out and "(the engine was killed" in out
    assert time.monotonic() - start < 60
    assert len(saved_traces(tmp_path)) == 1


def test_malformed_answer_through_a_child_process(tmp_path):
    """The default for a module:factory adapter: isolated; the answer arrives unconverted."""
    code, out, err = run_cli(
        "check",
        "--engine",
        f"{BROKEN_MODULE}:make_free_count_str",
        "--failure-dir",
        str(tmp_path),
        *QUICK,
    )
    assert code == EXIT_ENGINE, out + err
    assert "num_free_blocks() returned '" in out and "not an integer" in out
    assert len(saved_traces(tmp_path)) == 1


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("factory_raises", "factory make_factory_raises(layout) raised RuntimeError"),
        ("factory_returns_none", "returned a NoneType without add_request"),
    ],
)
def test_factory_failure_is_an_engine_error(name, expected, tmp_path):
    code, out, err = run_cli(
        "check",
        "--engine",
        f"{BROKEN_MODULE}:make_{name}",
        "--isolation",
        "none",
        "--failure-dir",
        str(tmp_path),
        *QUICK,
    )
    assert code == EXIT_ENGINE, out + err
    assert expected in out
    assert len(saved_traces(tmp_path)) == 1  # the layout it failed on


def test_engine_rejecting_every_layout_is_a_configuration_error(tmp_path):
    code, out, err = run_cli(
        "check",
        "--engine",
        f"{BROKEN_MODULE}:make_rejects_every_layout",
        "--isolation",
        "none",
        "--failure-dir",
        str(tmp_path),
        *QUICK,
    )
    assert code == EXIT_USAGE, out + err
    assert "raised UnsupportedLayoutError for every layout drawn" in out


def test_unsupported_layouts_are_honoured_by_every_property(tmp_path, capsys):
    code = cli.main(
        [
            "check",
            "--engine",
            f"{BROKEN_MODULE}:make_rejects_in_determinism",
            "--isolation",
            "none",
            "--failure-dir",
            str(tmp_path),
            "--profile",
            "dev",
            "--max-examples",
            "8",
            "--seed",
            "2",
            "--no-attention",
        ]
    )
    out = capsys.readouterr().out
    assert code == EXIT_PASSED, out
    assert "determinism  PASS" in out


# ---------------------------------------------------------------------------
# Usage and configuration errors: exit 2, one line, no traceback


def _write_adapter(directory: Path, name: str, text: str) -> None:
    (directory / f"{name}.py").write_text(text)


@pytest.mark.parametrize(
    ("engine", "adapter", "expected"),
    [
        ("no_such_module:make", None, "cannot import module 'no_such_module'"),
        ("syntax_broken:make", "def make(layout)\n    pass\n", "SyntaxError"),
        (
            "raises_on_import:make",
            "raise RuntimeError('engine library missing')\n",
            "RuntimeError: engine library missing",
        ),
        ("constant_factory:make", "make = 42\n", "is a int, not a callable factory"),
        ("no_factory:make", "other = 1\n", "has no 'make'"),
        ("not-a-factory", None, "neither a built-in engine"),
    ],
)
def test_bad_adapter_is_a_usage_error(engine, adapter, expected, tmp_path):
    if adapter is not None:
        _write_adapter(tmp_path, engine.partition(":")[0], adapter)
    code, out, err = run_cli(
        "check", "--engine", engine, *QUICK, env={"PYTHONPATH": f"{ROOT}:{tmp_path}"}
    )
    assert code == EXIT_USAGE, out + err
    assert expected in one_line(err)


def test_exec_engine_that_cannot_start_is_a_configuration_error(tmp_path):
    code, out, err = run_cli(
        "check", "--engine", "exec:/no/such/binary", "--failure-dir", str(tmp_path), *QUICK
    )
    assert code == EXIT_USAGE, out + err
    assert "cannot start '/no/such/binary'" in out + err
    code, out, err = run_cli("check", "--engine", "exec:", *QUICK)
    assert code == EXIT_USAGE, out + err
    assert "needs a command after 'exec:'" in one_line(err)


def test_verbose_shows_the_traceback(tmp_path):
    _write_adapter(tmp_path, "raises_on_import", "raise RuntimeError('boom')\n")
    code, _out, err = run_cli(
        "check",
        "--engine",
        "raises_on_import:make",
        "--verbose",
        *QUICK,
        env={"PYTHONPATH": f"{ROOT}:{tmp_path}"},
    )
    assert code == EXIT_USAGE and "Traceback" in err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["check", "--preset", "no-such-model"], "--preset must be one of"),
        (["check", "--max-examples", "-5"], "--max-examples must be >= 1, got -5"),
        (["check", "--tier-examples", "0"], "--tier-examples must be >= 1, got 0"),
        (["check", "--seed", "-1"], "--seed must be >= 0"),
        (["check", "--call-timeout", "-1"], "--call-timeout must be a number of seconds >= 0"),
        (["check", "--level", "strict"], "invalid choice: 'strict'"),
        (["check", "--isolation", "thread"], "invalid choice: 'thread'"),
        (["check", "--max-examples", "many"], "invalid int value"),
        (["fuzz", "--minutes", "0"], "--minutes must be > 0"),
        (["fuzz", "--minutes", "1", "--workers", "0"], "--workers must be >= 1"),
        (["replay", "/no/such/trace.json"], "does not exist"),
    ],
)
def test_bad_option_is_a_usage_error(args, expected):
    code, out, err = run_cli(*args)
    assert code == EXIT_USAGE, out + err
    assert expected in err.strip().splitlines()[-1]
    assert "Traceback" not in err


# ---------------------------------------------------------------------------
# Property failures: exit 1, the trace saved (elsewhere when it cannot be written)

WRONG = f"{BROKEN_MODULE}:make_miscounts_free_blocks"  # well formed, wrong: I1 fails
WRONG_ARGS = ["--isolation", "none", *QUICK]


def check_in_process(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["check", *args])
    return code, capsys.readouterr().out


def test_property_failure_exits_1_with_a_replayable_trace(tmp_path, capsys, no_shrink):
    code, out = check_in_process(
        capsys, "--engine", WRONG, "--failure-dir", str(tmp_path), *WRONG_ARGS
    )
    assert code == EXIT_FAILED, out
    assert "FAILED in invariants: PropertyViolation: [pool_accounting]" in out
    (path,) = saved_traces(tmp_path)
    assert f"trace: {path}" in out and f"replay: kvconform replay {path}" in out
    saved = load_trace(path)
    assert saved.seed == 1 and saved.failure["kind"] == "property"
    assert saved.failure["property"] == "pool_accounting"
    assert saved.failure["engine"] == WRONG and saved.failure["level"] == "universal"
    assert set(saved.failure["versions"]) >= {"kvconform", "python", "hypothesis", "torch"}
    # --seed reproduces the run exactly: the same trace, not saved a second time
    again, out_again = check_in_process(
        capsys, "--engine", WRONG, "--failure-dir", str(tmp_path), *WRONG_ARGS
    )
    assert again == EXIT_FAILED and saved_traces(tmp_path) == [path]
    failed_line = next(line for line in out.splitlines() if line.startswith("FAILED"))
    assert failed_line in out_again.splitlines()
    # and its replay, by the real command, fails the same way
    code, out, err = run_cli("replay", str(path), "--engine", WRONG, "--isolation", "none")
    assert code == EXIT_FAILED, out + err
    assert "FAILED at operation" in out and "pool_accounting" in out
    # the same trace on an engine that breaks the protocol: exit 3
    broken = f"{BROKEN_MODULE}:make_table_none"
    code, out, err = run_cli("replay", str(path), "--engine", broken, "--isolation", "none")
    assert code == EXIT_ENGINE, out + err
    assert "get_block_ids('r" in out and "') returned None, not a sequence" in out


def test_a_failure_dir_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys):
    """Checked before anything runs (issue 37): a mistake costs seconds, not the run."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = cli.main(["check", "--engine", WRONG, "--failure-dir", str(blocker / "failures")])
    captured = capsys.readouterr()
    assert code == EXIT_USAGE, captured.out
    assert f"'{blocker}' is not a directory" in one_line(captured.err)
    assert "kvconform check: engine=" not in captured.out


def test_a_failure_dir_lost_during_the_run_keeps_the_failure(tmp_path):
    """A directory that stops taking files after the check began: the trace goes to a new
    temporary directory and the note says where."""
    from properties.core.trace import Arrive, Step, Trace
    from properties.runner.check import save_failure
    from reference.layout import KVCacheGroup, KVCacheLayout
    from reference.specs import FullAttentionSpec

    layout = KVCacheLayout(
        groups=(KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),), num_blocks=4,
        max_model_len=16,
    )  # fmt: skip
    trace = Trace(layout, (Arrive("r0", (1, 2)), Step(8)), failure={"property": "x"})
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    path, note = save_failure(trace, str(blocker / "failures"))
    assert path.is_file() and load_trace(path) == trace
    assert note.startswith(f"cannot write the failure directory '{blocker / 'failures'}'")
    assert note.endswith(f"trace saved to {path} instead")


def test_reference_passes_with_exit_0(tmp_path):
    code, out, err = run_cli(
        "check", "--engine", "reference", "--failure-dir", str(tmp_path), *QUICK
    )
    assert code == EXIT_PASSED, out + err
    assert saved_traces(tmp_path) == []


# ---------------------------------------------------------------------------
# Malformed and oversized traces: load errors (exit 2), never a hang or a failure


def _trace_json(**changes) -> dict:
    data = {
        "format": "kvconform-trace/1",
        "seed": None,
        "layout": {
            "name": "",
            "num_blocks": 16,
            "max_model_len": 32,
            "enable_caching": True,
            "max_in_flight_tokens": None,
            "groups": [{"layer_names": ["l0"], "spec": {"type": "full", "block_size": 4}}],
        },
        "operations": [
            {"op": "arrive", "request_id": "r0", "prompt": [1, 2, 3], "output": [4]},
            {"op": "step", "token_budget": 8, "num_lookahead_tokens": 0},
        ],
        "observed": [],
        "failure": None,
    }
    for key, value in changes.items():
        if key in data["layout"]:
            data["layout"][key] = value
        else:
            data[key] = value
    return data


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", "is not valid JSON"),
        (json.dumps(_trace_json(num_blocks=10**9)), "layout.num_blocks is 1000000000, more than"),
        (json.dumps(_trace_json(max_model_len=10**8)), "layout.max_model_len is 100000000"),
        (
            json.dumps(
                _trace_json(
                    operations=[
                        {"op": "arrive", "request_id": "r0", "prompt": [1] * 30, "output": [2] * 10}
                    ]
                )
            ),
            "prompt 30 + output 10 tokens exceed max_model_len 32",
        ),
        (
            json.dumps(
                _trace_json(operations=[{"op": "arrive", "request_id": "r0", "prompt": [2**40]}])
            ),
            "token id 1099511627776 is above the limit",
        ),
        (json.dumps(_trace_json(format="kvconform-trace/9")), "unsupported trace version"),
        (json.dumps(_trace_json(num_blocks=16.0)), "num_blocks must be an integer"),
    ],
)
def test_malformed_trace_is_a_load_error(content, expected, tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(content)
    code, out, err = run_cli("replay", str(path), "--engine", "reference")
    assert code == EXIT_USAGE, out + err
    assert expected in one_line(err)


def test_trace_size_and_operation_limits(tmp_path, monkeypatch):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace_json()))
    load_trace(path)  # within the limits
    monkeypatch.setattr(trace_module, "MAX_OPERATIONS", 1)
    with pytest.raises(TraceFormatError, match="holds 2 operations, more than the limit 1"):
        load_trace(path)
    monkeypatch.setattr(trace_module, "MAX_TRACE_BYTES", 100)
    with pytest.raises(TraceFormatError, match=r"bytes, more than the limit 100"):
        load_trace(path)


# ---------------------------------------------------------------------------
# fuzz: interrupted cleanly, plain progress lines off a terminal


@pytest.mark.parametrize(
    ("signum", "expected"), [(signal.SIGINT, EXIT_INTERRUPTED), (signal.SIGTERM, 143)]
)
def test_interrupted_fuzz_stops_workers_and_exits_130(signum, expected, tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "properties.tools.cli",
            "fuzz",
            "--engine",
            "reference",
            "--minutes",
            "5",
            "--progress-seconds",
            "0.5",
            "--failure-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("kvconform fuzz:")
    assert proc.stdout.readline().startswith("[")  # a first progress line: workers run
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == expected, out + err  # issue 22: SIGTERM is 143
    assert "interrupted: stopping workers" in out and "summary:" in out
    assert "\r" not in out  # not a terminal: plain lines
    assert "Traceback" not in err


# ---------------------------------------------------------------------------
# pytest gate


def _pytest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "properties.tools.pytest_plugin",
            "-p",
            "no:cacheprovider",
            *args,
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_pytest_failure_prints_the_trace_and_the_replay_command(tmp_path):
    engine = f"{BROKEN_MODULE}:make_free_count_str"
    proc = _pytest(
        "tests/properties/runner/test_machine.py",
        "--basetemp",
        str(tmp_path / "inner"),
        "-k",
        "invariants",
        "--kv-profile",
        "dev",
        "--kv-engine",
        engine,
    )
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout + proc.stderr
    trace_line = next(x for x in proc.stdout.splitlines() if x.startswith("trace: "))
    assert Path(trace_line.removeprefix("trace: ")).is_file()
    assert f"replay: kvconform replay {trace_line.removeprefix('trace: ')} --engine {engine}" in (
        proc.stdout
    )


def run_pytest_with_engine(engine: str) -> subprocess.CompletedProcess:
    """pytest with kvconform's plugin and ``--kv-engine engine`` over a small test file."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "properties.tools.pytest_plugin",
            "-p",
            "no:cacheprovider",
            "tests/properties/runner/test_machine.py",
            "--kv-engine",
            engine,
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_pytest_with_a_bad_engine_fails_and_never_skips():
    proc = run_pytest_with_engine("no_such_module:make")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert "cannot import module 'no_such_module'" in proc.stderr
    assert "skipped" not in proc.stdout


# ---------------------------------------------------------------------------
# The reference API names the field of every bad argument


def _layout(**changes):
    from reference.layout import KVCacheGroup, KVCacheLayout
    from reference.specs import FullAttentionSpec

    fields = {
        "groups": (KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),),
        "num_blocks": 16,
        "max_model_len": 32,
    }
    return KVCacheLayout(**{**fields, **changes})


def test_reference_rejects_a_request_id_used_twice():
    from reference.kv_cache_manager import KVCacheManager

    manager = KVCacheManager(_layout())
    first = manager.make_request("r0", [1, 2, 3, 4, 5])
    assert manager.allocate_slots(first, 5) is not None
    with pytest.raises(KVConformError, match="request id 'r0' is used twice"):
        manager.make_request("r0", [1, 2, 3])
    twin = manager.make_request("r1", [1, 2, 3])
    twin.request_id = "r0"
    with pytest.raises(KVConformError, match="request id 'r0' is used twice"):
        manager.allocate_slots(twin, 3)
    manager.free(first)
    manager.make_request("r0", [1, 2, 3])  # free again once the first is freed


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: _layout(num_blocks=16.0), "KVCacheLayout.num_blocks must be an integer, got 16.0"),
        (lambda: _layout(enable_caching="yes"), "enable_caching must be a bool"),
        (lambda: _layout(max_model_len=True), "max_model_len must be an integer, got True"),
        (lambda: _layout(max_in_flight_tokens=0), "max_in_flight_tokens must be >= 1"),
        (lambda: _layout(groups=[]), "groups must be a tuple of KVCacheGroup"),
    ],
)
def test_reference_layout_names_the_bad_field(build, expected):
    with pytest.raises(KVConformError, match=expected):
        build()


def test_reference_specs_and_calls_name_the_bad_field():
    from reference.block_pool import BlockPool
    from reference.kv_cache_manager import KVCacheManager
    from reference.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    with pytest.raises(KVConformError, match="SlidingWindowSpec.sliding_window is missing"):
        SlidingWindowSpec(block_size=4)
    with pytest.raises(KVConformError, match="attention_chunk_size is missing"):
        ChunkedLocalAttentionSpec(block_size=4)
    with pytest.raises(KVConformError, match="block_size must be an integer >= 1, got True"):
        FullAttentionSpec(block_size=True)
    with pytest.raises(KVConformError, match="BlockPool.enable_caching must be a bool"):
        BlockPool(8, 1, 4)
    manager = KVCacheManager(_layout())
    with pytest.raises(KVConformError, match="Request.request_id must be a non-empty string"):
        manager.make_request(7, [1, 2])
    with pytest.raises(KVConformError, match="prompt_token_ids must hold integers >= 0"):
        manager.make_request("r0", [1, -2])
    request = manager.make_request("r0", [1, 2, 3])
    with pytest.raises(KVConformError, match="allocate_slots.num_new_tokens must be an integer"):
        manager.allocate_slots(request, 2.0)
    with pytest.raises(KVConformError, match="new_computed_blocks must be ComputedBlocks"):
        manager.allocate_slots(request, 2, 0, [[1]])
