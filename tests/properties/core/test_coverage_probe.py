"""Engine coverage traced inside engine calls only (``coverage_probe``: the tracer paused
between the boundary's calls): code of a measured module that runs inside a call is
recorded, the same code run between calls is not, nested calls keep tracing until the
outermost ends, and stopping writes what the calls traced. Each case runs in its own
process (a tracer inside pytest's would clash with any coverage run of the tests)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TOY = "tests.properties.tools.toy_cov_module"

SCRIPT = """
import json, os, tempfile
from properties.core import coverage_probe as probe
from properties.tools.engine_coverage import analyse
from tests.properties.tools import toy_cov_module as toy

request = probe.CoverageRequest(tempfile.mkdtemp(), ({toy!r},))
os.environ[probe.ENV] = request.to_env()
assert probe.start_measuring()
calls_only = {calls_only!r}
if calls_only:
    assert probe.trace_engine_calls_only() and probe.trace_engine_calls_only()
toy.never_called(True)           # between calls: traced only without calls-only mode
probe.engine_call_started()
toy.parity(1)                    # inside a call
probe.engine_call_started()      # a nested call
toy.parity(2)
probe.engine_call_ended()
toy.checked_size(3)              # still inside the outer call
probe.engine_call_ended()
toy.never_called(False)          # between calls again
probe.engine_call_ended()        # an unmatched end changes nothing
toy.checked_size(4)
probe.stop_measuring()
result = analyse(request)
print(json.dumps(sorted(b.where for b in result.unreached)))
"""


def unreached(calls_only: bool) -> list[str]:
    script = textwrap.dedent(SCRIPT.format(toy=TOY, calls_only=calls_only))
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_calls_only_records_what_runs_inside_engine_calls() -> None:
    path = "tests/properties/tools/toy_cov_module.py"
    # parity both ways, checked_size's fall-through: inside calls; never_called: between
    assert unreached(calls_only=True) == [f"{path}:22->23", f"{path}:34->35", f"{path}:34->36"]
    # tracing throughout (an exec server): never_called is reached both ways too
    assert unreached(calls_only=False) == [f"{path}:22->23"]
