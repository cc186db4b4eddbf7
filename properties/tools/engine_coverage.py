"""Engine coverage: which branches of the engine's own cache manager a run exercised.

``kvconform check --engine-coverage [MODULE,...]`` (also ``fuzz``, and the pytest option
``--kv-engine-coverage``) measures branch coverage (coverage.py) of the named modules of
the engine under test. Without a value the modules are the adapter's declaration: a
factory attribute ``coverage_modules`` (a tuple of dotted module names; vLLM's adapter
names ``vllm.v1.core.kv_cache_manager`` and four more, SGLang's the radix cache and the
allocators it drives). The engine is measured wherever it runs: in this process, in the
check or fuzz workers, or in the exec server of an isolated engine; each writes a data
file into a directory this process hands them through the environment
(:mod:`properties.core.coverage_probe`, which also says why only function bodies count),
and this module combines them into an :class:`EngineCoverage` and prints it: a row per
module, the functions not fully covered, a table of the unreached branches
(``file:line->target``, the function, the source line and the target line; written to a
file when long) and the final line ``engine branch coverage: NN.N% of N branches``.

**Baseline.** ``--engine-coverage-write-baseline FILE`` writes the unreached branches to
``FILE``; ``--engine-coverage-baseline FILE`` fails the run (exit code 4,
:data:`properties.core.constants.EXIT_COVERAGE`) when a branch that ``FILE`` does not list
is unreached, so an engine repository keeps its reach from regressing as its code grows.
A baseline line is ``where<TAB>function<TAB>source<TAB>target`` (``#`` starts a comment);
a branch is matched by module, function and the text of its two lines, never by line
numbers (``where`` is for the reader), so moving code does not break a baseline. Branches
the baseline lists that the run reached are "first reached": ``fuzz`` lists them in its
summary (the campaign reached what the baseline's run did not), and the baseline can drop
them.

Worked example (a toy module, ``tests/properties/tools/toy_cov_module.py``)::

    kvconform check --engine tests.properties.tools.toy_cov_adapter:make_engine \\
        --engine-coverage --workers 1 --only determinism --max-examples 2
    ...
    unreached branches (3):
      tests/properties/tools/toy_cov_module.py:22->23  checked_size  if size < 0:  -> raise ...
    engine branch coverage: 50.0% of 6 branches
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from properties.core.coverage_probe import (
    ENV,
    CoverageRequest,
    EngineCoverageError,
    measuring_processes,
    new_engine_coverage,
    save_measurement,
    start_measuring,
    stop_measuring,
    trace_engine_calls_only,
)

#: Above this many unreached branches the table goes to a file (the output names it).
MAX_PRINTED = 40
#: The file the long table goes to.
TABLE_FILE = ".kvconform/engine-coverage.txt"
#: Seconds to wait for the processes still measuring (an exec server saving at its end).
SAVE_WAIT_S = 30.0


def resolve_modules(value: str | None, factory: object, engine: str) -> tuple[str, ...]:
    """The modules of ``--engine-coverage VALUE``: the comma-separated names, or (empty
    value) the factory's ``coverage_modules``. Each must exist (found without importing
    the module itself).

    Example: ``resolve_modules("a.b, a.c", f, "x")`` -> ``("a.b", "a.c")``.
    """
    if value:
        modules = tuple(m.strip() for m in value.split(",") if m.strip())
    else:
        # an EngineUnderTest carries the adapter's factory (its attributes) as .factory
        declared = getattr(factory, "coverage_modules", None) or getattr(
            getattr(factory, "factory", None), "coverage_modules", None
        )
        modules = tuple(declared or ())
        if not modules:
            raise EngineCoverageError(
                f"--engine-coverage: engine {engine!r} declares no coverage_modules; "
                "name them: --engine-coverage MODULE[,MODULE...]"
            )
    for name in modules:
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError) as exc:
            raise EngineCoverageError(
                f"--engine-coverage: cannot find module {name!r}: {exc}"
            ) from None
        if found is None:
            raise EngineCoverageError(f"--engine-coverage: no module named {name!r}")
    return modules


@contextmanager
def requested(modules: tuple[str, ...]) -> Iterator[CoverageRequest]:
    """Ask every process started inside the block (and this one, through
    :func:`measure_task`) to measure ``modules``; the data directory is removed after."""
    request = CoverageRequest(tempfile.mkdtemp(prefix="kvconform-engcov-"), modules)
    previous = os.environ.get(ENV)
    os.environ[ENV] = request.to_env()
    try:
        yield request
    finally:
        stop_measuring()
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous
        shutil.rmtree(request.data_dir, ignore_errors=True)


def engine_runs_here(config) -> bool:
    """Whether the engine of ``config`` (a CheckConfig) runs in this process (not in an
    isolated child, not an ``exec:`` engine)."""
    from properties.engines.isolation import wants_isolation

    if config.engine.startswith("exec:"):
        return False
    return not wants_isolation(config.engine, config.isolation, config.call_timeout)


def measure_here(config) -> bool:
    """Measure this process when engine coverage is requested and the engine of
    ``config`` runs here; whether it is measured. The engine is driven through the
    engine boundary only (a check's or a fuzz campaign's runs), so only its calls are
    traced (:func:`properties.core.coverage_probe.trace_engine_calls_only`)."""
    measured = (
        CoverageRequest.from_env() is not None and engine_runs_here(config) and start_measuring()
    )
    if measured:
        trace_engine_calls_only()
    return measured


@contextmanager
def measure_task(config) -> Iterator[None]:
    """Around a task that drives the engine of ``config``: :func:`measure_here`, and the
    data saved after."""
    measured = measure_here(config)
    try:
        yield
    finally:
        if measured:
            save_measurement()


@dataclass(frozen=True)
class Branch:
    """One branch of a function body: ``line`` jumps to ``target`` (``-1``: leaves the
    function)."""

    path: str
    line: int
    target: int
    function: str
    source: str
    target_source: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}->{'exit' if self.target < 0 else self.target}"

    @property
    def key(self) -> tuple[str, str, str, str]:
        """What a baseline matches (no line numbers)."""
        return (self.path, self.function, self.source, self.target_source)


@dataclass(frozen=True)
class FunctionRow:
    path: str
    function: str
    branches: int
    missed: int


@dataclass(frozen=True)
class EngineCoverage:
    """Per function (bodies only) branch counts, and the unreached branches."""

    functions: tuple[FunctionRow, ...]
    unreached: tuple[Branch, ...]

    @property
    def branches(self) -> int:
        return sum(f.branches for f in self.functions)

    @property
    def reached(self) -> int:
        return self.branches - sum(f.missed for f in self.functions)

    @property
    def percent(self) -> float:
        return 100.0 * self.reached / self.branches if self.branches else 100.0

    def modules(self) -> list[tuple[str, int, int]]:
        """``(path, branches, missed)`` per module, in path order."""
        rows: dict[str, list[int]] = {}
        for f in self.functions:
            row = rows.setdefault(f.path, [0, 0])
            row[0] += f.branches
            row[1] += f.missed
        return [(p, b, m) for p, (b, m) in sorted(rows.items())]


def _display_path(module: str, file: str) -> str:
    """``vllm.v1.core.block_pool`` -> ``vllm/v1/core/block_pool.py`` (a package's
    ``__init__.py`` keeps its name)."""
    base = module.replace(".", "/")
    return f"{base}/__init__.py" if file.endswith("__init__.py") else f"{base}.py"


def analyse(request: CoverageRequest) -> EngineCoverage:
    """Combine the data files of ``request``'s directory into an :class:`EngineCoverage`
    (a module no process ran counts with every branch unreached)."""
    from properties.core.coverage_probe import module_files

    files = module_files(request.modules)
    names = dict(zip(files, request.modules))
    cov = new_engine_coverage(files)
    data_files = [str(p) for p in Path(request.data_dir).glob(".coverage.*")]
    if data_files:
        cov.combine(data_files, keep=True)
    data = cov.get_data()
    if not data.measured_files():
        data.add_arcs({})  # no process measured anything: arcs mode, no arcs
    data.touch_files(list(files))
    with tempfile.TemporaryDirectory(prefix="kvconform-engcov-") as tmp:
        out = os.path.join(tmp, "report.json")
        cov.json_report(outfile=out)
        report = json.loads(Path(out).read_text())
    functions: list[FunctionRow] = []
    unreached: list[Branch] = []
    for file_name, info in report["files"].items():
        resolved = str(Path(file_name).resolve())
        if resolved not in names:
            continue
        path = _display_path(names[resolved], resolved)
        source = Path(resolved).read_text().splitlines()
        for function, region in info.get("functions", {}).items():
            if not function:
                continue  # module and class bodies run at import (coverage_probe)
            summary = region["summary"]
            if not summary.get("num_branches"):
                continue
            functions.append(
                FunctionRow(path, function, summary["num_branches"], summary["missing_branches"])
            )
            for a, b in region.get("missing_branches", []):
                target = "(leaves the function)" if b < 0 else source[b - 1].strip()
                unreached.append(Branch(path, a, b, function, source[a - 1].strip(), target))
    functions.sort(key=lambda f: (f.path, f.function))
    unreached.sort(key=lambda u: (u.path, u.line, u.target))
    return EngineCoverage(tuple(functions), tuple(unreached))


def wait_for_savers(data_dir: str, timeout: float = SAVE_WAIT_S) -> None:
    """Wait until no live process is still measuring into ``data_dir`` (an exec server
    whose client has gone saves its last data as it exits), at most ``timeout`` s."""
    import time

    end = time.monotonic() + timeout
    while measuring_processes(data_dir) and time.monotonic() < end:
        time.sleep(0.05)


def summary_line(result: EngineCoverage) -> str:
    """The final line: ``engine branch coverage: 50.0% of 6 branches``."""
    return f"engine branch coverage: {result.percent:.1f}% of {result.branches} branches"


def table_lines(branches: tuple[Branch, ...] | list[Branch]) -> list[str]:
    """One line per branch: where, function, source line, target line."""
    return [f"  {u.where:<52} {u.function:<40} {u.source}  -> {u.target_source}" for u in branches]


def format_engine_coverage(result: EngineCoverage, table_file: str = TABLE_FILE) -> str:
    """The report (see the module docstring); a table longer than :data:`MAX_PRINTED`
    rows goes to ``table_file`` and the output names it."""
    lines = ["engine coverage (branches of function bodies, coverage.py):"]
    rows = [("module", "branches", "missed", "cover")] + [
        (p, str(b), str(m), f"{100.0 * (b - m) / b if b else 100.0:.1f}%")
        for p, b, m in result.modules()
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    partial = [f for f in result.functions if f.missed]
    if partial:
        lines.append("functions not fully covered (missed/branches):")
        lines += [f"  {f.missed:>3}/{f.branches:<3} {f.path}  {f.function}" for f in partial]
    table = table_lines(result.unreached)
    lines.append(f"unreached branches ({len(table)}):")
    if len(table) > MAX_PRINTED:
        Path(table_file).parent.mkdir(parents=True, exist_ok=True)
        Path(table_file).write_text("\n".join(table) + "\n")
        lines += table[:MAX_PRINTED]
        lines.append(f"  ... {len(table) - MAX_PRINTED} more; the whole table: {table_file}")
    else:
        lines += table
    lines.append(summary_line(result))
    return "\n".join(lines)


BASELINE_HEADER = (
    "# kvconform engine coverage baseline: branches allowed to stay unreached.\n"
    "# where<TAB>function<TAB>source<TAB>target[<TAB>reason]; matched without line numbers.\n"
    "# reason: why the branch is out of the adapter's reach ('kind — detail'; the report counts\n"
    "# kinds); 'open gap' (or none, or 'open gap — why'): reachable, not reached.\n"
)
#: The reason of a listed branch the adapter's calls can reach but the run did not.
OPEN_GAP = "open gap"
#: Splits a reason into its kind (counted in the report) and the branch's own detail.
DETAIL = " — "


def write_baseline(
    result: EngineCoverage, path: str, reasons: dict[tuple[str, ...], list[str]] | None = None
) -> None:
    """Write ``result``'s unreached branches as a baseline file; a branch ``reasons``
    classifies keeps its reason (a re-written baseline keeps the classification)."""
    lines = []
    for u, reason in zip(result.unreached, assign_reasons(result, reasons or {})):
        fields = [u.where, u.function, u.source, u.target_source]
        if reason:
            fields.append(reason)
        lines.append("\t".join(fields))
    Path(path).write_text(BASELINE_HEADER + "".join(line + "\n" for line in lines))


def _baseline_rows(path: str) -> Iterator[tuple[tuple[str, str, str, str], str]]:
    """``(key, reason)`` per line of a baseline (reason ``""`` when the line has none);
    one-line error when the file is bad."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise EngineCoverageError(
            f"--engine-coverage-baseline: cannot read {path}: {exc}"
        ) from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) not in (4, 5):
            raise EngineCoverageError(
                f"--engine-coverage-baseline: {path}:{number}: expected 4 or 5 tab-separated "
                f"fields (where, function, source, target[, reason]), got {len(fields)}"
            )
        where, function, source, target = fields[:4]
        reason = fields[4].strip() if len(fields) == 5 else ""
        yield (where.split(":")[0], function, source, target), reason


def read_baseline(path: str) -> Counter:
    """The branch keys a baseline lists (with multiplicity); one-line error when bad."""
    return Counter(key for key, _ in _baseline_rows(path))


def read_reasons(path: str) -> dict[tuple[str, ...], list[str]]:
    """Per branch key, the reasons of the baseline's lines with that key, in file order
    (``""`` for a line with none). A key names one branch unless two branches of a
    function have the same two lines (two equal loops): their reasons then go to the
    unreached branches in line order (:func:`assign_reasons`)."""
    reasons: dict[tuple[str, ...], list[str]] = {}
    for key, reason in _baseline_rows(path):
        reasons.setdefault(key, []).append(reason)
    return reasons


def assign_reasons(result: EngineCoverage, reasons: dict[tuple[str, ...], list[str]]) -> list[str]:
    """The reason of each of ``result.unreached`` (``""``: none), the i-th unreached
    branch of a key taking the key's i-th reason."""
    used: Counter = Counter()
    out = []
    for u in result.unreached:
        listed = reasons.get(u.key, [])
        out.append(listed[used[u.key]] if used[u.key] < len(listed) else "")
        used[u.key] += 1
    return out


def is_open_gap(reason: str) -> bool:
    """Whether a baseline reason leaves its branch an open gap: none, :data:`OPEN_GAP`,
    or an open gap with its detail (``open gap — why the adapter does not reach it``).
    Example: ``is_open_gap("open gap — one rank")`` is True, ``is_open_gap("error path —
    a raise")`` False."""
    return reason.split(DETAIL)[0].strip() in ("", OPEN_GAP)


def out_of_reach(
    result: EngineCoverage, reasons: dict[tuple[str, ...], list[str]]
) -> list[tuple[Branch, str]]:
    """The unreached branches ``reasons`` classifies as out of the adapter's reach (a
    reason that is not an open gap, :func:`is_open_gap`), with their reasons."""
    return [
        (u, r)
        for u, r in zip(result.unreached, assign_reasons(result, reasons))
        if not is_open_gap(r)
    ]


def reach_lines(result: EngineCoverage, reasons: dict[tuple[str, ...], list[str]]) -> list[str]:
    """The coverage of the branches the adapter's calls can reach: every branch but the
    unreached ones the baseline gives a reason for, then a count per kind of reason (the
    text before :data:`DETAIL`).

    Worked example: 840 branches, 322 unreached, 293 of them classified (HiSparse,
    error paths, ...) and 29 open gaps (no reason, or ``open gap``): reachable
    840 - 293 = 547, reached 547 - 29 = 518, ``94.7% of 547``. Open gaps whose reason
    says why (``open gap — kind: detail``) are counted by that kind after the others.
    """
    outside = out_of_reach(result, reasons)
    reachable = result.branches - len(outside)
    gaps = len(result.unreached) - len(outside)
    percent = 100.0 * (reachable - gaps) / reachable if reachable else 100.0
    lines = [
        f"adapter-reachable branch coverage: {percent:.1f}% of {reachable} branches "
        f"({gaps} open gaps; {len(outside)} unreached branches out of the adapter's reach)"
    ]
    for reason, n in Counter(r.split(DETAIL)[0] for _, r in outside).most_common():
        lines.append(f"  {n:>4}  {reason}")
    why = Counter(
        r.split(DETAIL, 1)[1].split(":")[0]
        for r in assign_reasons(result, reasons)
        if DETAIL in r and is_open_gap(r)
    )
    if why:
        lines.append("open gaps by reason (reachable on CPU, not driven):")
        for reason, n in why.most_common():
            lines.append(f"  {n:>4}  {reason}")
    return lines


def regressions(result: EngineCoverage, baseline: Counter) -> list[Branch]:
    """The unreached branches the baseline does not list (each listed one covers one)."""
    left = Counter(baseline)
    new = []
    for u in result.unreached:
        if left[u.key] > 0:
            left[u.key] -= 1
        else:
            new.append(u)
    return new


def first_reached(result: EngineCoverage, baseline: Counter) -> list[tuple[str, ...]]:
    """The branches the baseline lists that ``result`` reached (keys, sorted)."""
    left = Counter(baseline)
    left.subtract(Counter(u.key for u in result.unreached))
    return sorted(key for key, n in left.items() for _ in range(max(n, 0)))


def report(
    request: CoverageRequest,
    baseline: str | None = None,
    write: str | None = None,
    show_first_reached: bool = False,
) -> str | None:
    """Analyse, print the report, write the baseline (``write``) and compare with one
    (``baseline``); the failure message when a branch the baseline does not list is
    unreached, else None."""
    import gc

    stop_measuring()
    gc.collect()  # engines of isolated factories nobody holds: their children exit and save
    wait_for_savers(request.data_dir)
    result = analyse(request)
    print(format_engine_coverage(result), flush=True)
    reasons = read_reasons(baseline) if baseline else {}
    if any(r for listed in reasons.values() for r in listed):
        print("\n".join(reach_lines(result, reasons)), flush=True)
    if write:
        write_baseline(result, write, reasons)
        print(f"engine coverage baseline written: {write} ({len(result.unreached)} branches)")
    if baseline is None:
        return None
    listed = read_baseline(baseline)
    if show_first_reached:
        reached = first_reached(result, listed)
        print(f"branches first reached (listed unreached in {baseline}): {len(reached)}")
        for path, function, source, target in reached:
            print(f"  {path}  {function}  {source}  -> {target}")
    new = regressions(result, listed)
    if not new:
        return None
    print(f"unreached branches not in the baseline {baseline} ({len(new)}):")
    print("\n".join(table_lines(new)), flush=True)
    return (
        f"{len(new)} branches unreached that the baseline {baseline} does not list: "
        + ", ".join(u.where for u in new[:10])
        + (" ..." if len(new) > 10 else "")
    )


def add_arguments(parser) -> None:
    """The engine coverage options of ``kvconform check`` and ``fuzz``."""
    parser.add_argument(
        "--engine-coverage",
        nargs="?",
        const="",
        default=None,
        metavar="MODULE[,MODULE...]",
        help="branch coverage of these modules of the engine under test (no value: the "
        "adapter's coverage_modules)",
    )
    parser.add_argument(
        "--engine-coverage-baseline",
        default=None,
        metavar="FILE",
        help="with --engine-coverage: exit 4 if a branch FILE does not list is unreached",
    )
    parser.add_argument(
        "--engine-coverage-write-baseline",
        default=None,
        metavar="FILE",
        help="with --engine-coverage: write the unreached branches to FILE (a baseline)",
    )


@contextmanager
def cli_session(args, factory, config=None, fuzz: bool = False) -> Iterator:
    """Around a ``check`` or ``fuzz`` run: request engine coverage when ``args`` asks for
    it and yield ``finish()``, which prints the report and returns the failure message of
    the baseline comparison (or None). Without ``--engine-coverage`` ``finish`` does
    nothing. With ``config`` (the run's CheckConfig) this process is measured from the
    start when the engine runs here, so code that runs once per process (vLLM's
    ``init_none_hash`` at the first engine built, e.g. the capability probe) is counted
    as it is in an isolated child."""
    wanted = args.engine_coverage is not None
    baseline, write = args.engine_coverage_baseline, args.engine_coverage_write_baseline
    if not wanted:
        if baseline or write:
            raise EngineCoverageError(
                "--engine-coverage-baseline and --engine-coverage-write-baseline need "
                "--engine-coverage"
            )
        yield lambda: None
        return
    if getattr(args, "coverage", False):
        raise EngineCoverageError(
            "--engine-coverage and --coverage cannot run together (one tracer per process)"
        )
    modules = resolve_modules(args.engine_coverage, factory, args.engine)
    new_engine_coverage(())  # coverage.py missing: a usage error now, not in a worker
    if baseline:
        read_baseline(baseline)  # a bad file fails now, not after the run
    close = getattr(factory, "close", None)
    close = close if callable(close) else (lambda: None)
    close()  # an isolated engine's child started before the request is not measured
    with requested(modules) as request:
        if config is not None:
            measure_here(config)

        def finish() -> str | None:
            close()  # the child saves its data as it exits
            return report(request, baseline, write, show_first_reached=fuzz)

        yield finish


def open_session(args, factory, fuzz: bool = False) -> Callable[[], str | None]:
    """:func:`cli_session` entered now (``args`` None: no engine coverage); the returned
    ``finish()`` prints the report, ends the request and returns the baseline failure."""
    if args is None:
        return lambda: None
    session = cli_session(args, factory, fuzz=fuzz)
    finish = session.__enter__()

    def finish_and_close() -> str | None:
        try:
            return finish()
        finally:
            session.__exit__(None, None, None)

    return finish_and_close
