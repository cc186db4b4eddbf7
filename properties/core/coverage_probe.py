"""Engine coverage, the measuring side: branch coverage (coverage.py) of named modules of
the engine under test, in whichever process runs the engine.

The process that asks for engine coverage (``kvconform check --engine-coverage``, the
pytest plugin) puts a :class:`CoverageRequest` in the environment variable
:data:`ENV` (the data directory and the module names) before it starts any worker; every
process that drives the engine inherits it: the check and fuzz workers, and the exec
server of an isolated engine (:mod:`properties.engines.serve`). Such a process calls
:func:`start_measuring` before it drives the engine and :func:`save_measurement` after;
each writes its own data file ``.coverage.<host>.<pid>.<random>`` into the directory,
and the requesting process combines them (:mod:`properties.tools.engine_coverage`). A
measuring process leaves a marker ``measuring.<pid>`` there until its last save (an exec
server saves as it exits, when its client closes it), and the requesting process waits
for the live ones before it combines; a process killed at a deadline loses the data since
its last save.

Import first, trace afterwards: :func:`start_measuring` imports the named modules
*before* the tracer starts. Tracing a large import (vLLM's, with torch) is slow and
clashed with coverage.py's C tracer (``SystemError: bad call flags``); started after the
import, the tracer only ever sees function calls. The code that runs at import (module
and class bodies: ``def``, ``class``, ``import`` lines, module-level ``if``) is therefore
never measured, and the report counts the branches of function bodies only (coverage.py's
function regions; the module region is left out): a function body runs only when
something calls it, which is what the gate drives.

**Tracing engine calls only.** A tracer installed for the whole process slows every line
of it, the suite's own included (Python 3.11 has no ``sys.monitoring``: coverage.py's C
tracer sees each line of each frame, measured or not, and the interpreter leaves its
specialised fast paths while a tracer is set): a check ran twice as slow under
``--engine-coverage``. A process that drives its engine only through the engine
boundary (:mod:`properties.checks.boundary`: the factory and every call) therefore
traces only inside those calls (:func:`trace_engine_calls_only`): the boundary brackets
each with :func:`engine_call_started` and :func:`engine_call_ended`, which resume and
pause the tracer (the outermost call of nested ones). The branches recorded are the
same: the measured modules are the engine's, and its code runs only inside its calls.
An exec server (the whole process is the engine) traces throughout.

Worked example::

    os.environ[ENV] = CoverageRequest("/tmp/cov", ("vllm.v1.core.block_pool",)).to_env()
    start_measuring()     # imports vllm.v1.core.block_pool, then starts tracing its file
    ...                   # drive the engine
    save_measurement()    # /tmp/cov/.coverage.host.1234.XyZ
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from reference.errors import KVConformError

#: The environment variable carrying the request to every process that drives the engine.
ENV = "KVCONFORM_ENGINE_COVERAGE"


class EngineCoverageError(KVConformError):
    """A module to measure cannot be imported, or coverage.py is missing (usage error)."""


@dataclass(frozen=True)
class CoverageRequest:
    """Where data files go (``data_dir``) and which modules are measured (``modules``,
    dotted names)."""

    data_dir: str
    modules: tuple[str, ...]

    def to_env(self) -> str:
        return json.dumps({"data_dir": self.data_dir, "modules": list(self.modules)})

    @classmethod
    def from_env(cls) -> CoverageRequest | None:
        raw = os.environ.get(ENV)
        if not raw:
            return None
        data = json.loads(raw)
        return cls(str(data["data_dir"]), tuple(data["modules"]))


def module_files(modules: tuple[str, ...]) -> tuple[str, ...]:
    """The source file of each module, importing it (once per process).

    Example: ``module_files(("json.decoder",))`` -> ``(".../json/decoder.py",)``.
    """
    files = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import failure is a usage error
            raise EngineCoverageError(
                f"--engine-coverage: cannot import module {name!r}: {type(exc).__name__}: {exc}"
            ) from None
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py"):
            raise EngineCoverageError(
                f"--engine-coverage: module {name!r} has no Python source file ({path})"
            )
        files.append(str(Path(path).resolve()))
    return tuple(files)


def new_engine_coverage(files: tuple[str, ...], data_file: str | None = None):
    """A ``coverage.Coverage`` measuring the branches of ``files`` only."""
    try:
        import coverage
    except ImportError:  # pragma: no cover - depends on the environment
        raise EngineCoverageError(
            "--engine-coverage needs coverage.py in the engine's environment: pip install coverage"
        ) from None
    return coverage.Coverage(
        data_file=data_file,
        data_suffix=data_file is not None,
        branch=True,
        include=list(files),
        config_file=False,
    )


#: This process's measurement (started by :func:`start_measuring`), if any.
_ACTIVE = None


def start_measuring() -> bool:
    """Measure this process when :data:`ENV` asks for it: import the modules, then start
    the tracer (see the module docstring). Idempotent; the data is saved at exit too.
    Returns whether this process is measured."""
    global _ACTIVE
    if _ACTIVE is not None:
        return True
    request = CoverageRequest.from_env()
    if request is None:
        return False
    files = module_files(request.modules)
    cov = new_engine_coverage(files, os.path.join(request.data_dir, ".coverage"))
    Path(_marker(request.data_dir, os.getpid())).touch()
    cov.start()
    _ACTIVE = cov
    atexit.register(stop_measuring)
    return True


def _marker(data_dir: str, pid: int) -> str:
    """The file saying that process ``pid`` is measuring and has not saved its last data."""
    return os.path.join(data_dir, f"{MARKER_PREFIX}{pid}")


#: Marker file names: ``measuring.<pid>``.
MARKER_PREFIX = "measuring."


def measuring_processes(data_dir: str) -> list[int]:
    """The live processes other than this one still measuring into ``data_dir`` (a
    process that died without its last save, e.g. killed at a deadline, is not one)."""
    pids = []
    for marker in Path(data_dir).glob(f"{MARKER_PREFIX}*"):
        pid = int(marker.name[len(MARKER_PREFIX) :])
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        pids.append(pid)
    return pids


def save_measurement() -> None:
    """Write this process's data so far (measuring goes on); no-op when not measured."""
    if _ACTIVE is not None:
        _ACTIVE.save()


class _CallScope:
    """The tracer paused between engine calls (:func:`trace_engine_calls_only`): the
    collector to resume and pause (None: tracing throughout, or not measuring) and how
    many engine calls are open now."""

    collector = None
    depth = 0


def trace_engine_calls_only() -> bool:
    """From now on trace this process only inside engine calls (see the module
    docstring): the tracer pauses now and runs from :func:`engine_call_started` to the
    matching :func:`engine_call_ended`. Returns whether it applies: this process is
    measured and coverage.py's collector offers ``pause`` and ``resume`` (else tracing
    goes on throughout, as before). Idempotent."""
    if _ACTIVE is None:
        return False
    if _CallScope.collector is not None:
        return True
    collector = getattr(_ACTIVE, "_collector", None)
    if not (
        callable(getattr(collector, "pause", None)) and callable(getattr(collector, "resume", None))
    ):
        return False
    if _CallScope.depth == 0:
        collector.pause()
    _CallScope.collector = collector
    return True


def engine_call_started() -> None:
    """An engine call (or the engine's factory) starts: trace it (calls-only mode)."""
    scope = _CallScope
    if scope.collector is not None:
        if scope.depth == 0:
            scope.collector.resume()
        scope.depth += 1


def engine_call_ended() -> None:
    """The engine call returned or raised: stop tracing once the outermost one ends."""
    scope = _CallScope
    if scope.collector is not None and scope.depth > 0:
        scope.depth -= 1
        if scope.depth == 0:
            scope.collector.pause()


def stop_measuring() -> None:
    """Stop measuring this process and write its last data (the exec server at its end,
    the requesting process before it combines the data files, any process at exit)."""
    global _ACTIVE
    if _ACTIVE is None:
        return
    if _CallScope.collector is not None:
        if _CallScope.depth == 0:
            _CallScope.collector.resume()  # stopped as started: tracing
        _CallScope.collector, _CallScope.depth = None, 0
    cov, _ACTIVE = _ACTIVE, None
    cov.stop()
    cov.save()
    atexit.unregister(stop_measuring)
    data_dir = os.path.dirname(cov.config.data_file)
    Path(_marker(data_dir, os.getpid())).unlink(missing_ok=True)
