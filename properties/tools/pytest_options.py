"""The run options of the pytest plugin, the same as ``kvconform check``'s with the same
defaults (:data:`properties.core.constants.DEFAULTS`): ``--kv-max-examples``,
``--kv-seed``, ``--kv-call-timeout``, ``--kv-isolation``, ``--kv-skip-checks``,
``--kv-xfails-file`` (:mod:`properties.tools.selection`).

:func:`property_run` runs one property as the conformance tests do (once per session,
shared by the property's tests): a failure on a listed check is XFAIL (after the
property has run again without it); :func:`record_property` puts the run in the test's
report (``user_properties``: ``kv_checks_ran``, ``kv_xfailed``, ``kv_seed``,
``kv_property``; pytest's ``--junitxml`` writes them as ``<property>`` elements);
:func:`check_verdict` and :func:`xfail_verdict` decide the per-check tests.
:class:`XpassReporter` reads the reports (on the controller under pytest-xdist too) and,
at the end of a session that has no per-check XFAIL tests (an engine's folder importing
``test_property`` alone), fails the run on a listed check that ran in some test and
failed in none (XPASS, strict).

Worked example: ``pytest --pyargs kvconform.conformance --kv-engine mymod:make
--kv-xfails-file xf.txt`` with ``hit_bounds  # known`` in ``xf.txt``: the invariants
test is XFAIL when ``hit_bounds`` fails, and the session fails with ``XPASS (strict):
hit_bounds ...`` when it never does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from properties.core.constants import DEFAULTS, ISOLATION_MODES


def add_options(group) -> None:
    """Register the options on the plugin's option group."""
    group.addoption(
        "--kv-max-examples",
        type=int,
        default=DEFAULTS.max_examples,
        help="examples per property (default: the profile's)",
    )
    group.addoption(
        "--kv-seed",
        type=int,
        default=DEFAULTS.seed,
        help="seed of the examples (default: none, the ci profile is derandomized)",
    )
    group.addoption(
        "--kv-call-timeout",
        type=float,
        default=DEFAULTS.call_timeout,
        help=f"deadline of one engine call, seconds (default {DEFAULTS.call_timeout:g}; 0: none)",
    )
    group.addoption(
        "--kv-isolation",
        default=DEFAULTS.isolation,
        choices=ISOLATION_MODES,
        help=f"where the engine runs (default {DEFAULTS.isolation}, as the CLI)",
    )
    group.addoption(
        "--kv-tiers",
        default=None,
        help="large scale tiers to run after the small one, comma-separated (medium, "
        "offline, production; 'none'; default: the profile's, none with --kv-max-examples), "
        "as kvconform check --tiers",
    )
    group.addoption(
        "--kv-tier-examples",
        type=int,
        default=None,
        help="examples per large tier (default: the profile's), as --tier-examples",
    )
    group.addoption(
        "--kv-skip-checks",
        nargs="+",
        default=None,
        metavar="NAME",
        help="invariants not to run",
    )
    group.addoption(
        "--kv-xfails-file",
        default=None,
        metavar="FILE",
        help="checks expected to fail, one a line with its reason after '#' (strict)",
    )


@dataclass(frozen=True)
class RunOptions:
    """The options of one pytest session, checked (a bad value is a usage error)."""

    max_examples: int | None
    seed: int | None
    call_timeout: float
    isolation: str
    selection: object  # properties.tools.selection.CheckSelection
    #: the large tiers (None: the profile's) and examples per tier (None: the profile's)
    tiers: tuple[str, ...] | None = None
    tier_examples: int | None = None


def run_options(config: pytest.Config) -> RunOptions:
    """The session's :class:`RunOptions`; raises ``pytest.UsageError`` on a bad value."""
    from properties.tools.selection import load_selection
    from reference.errors import KVConformError

    max_examples = config.getoption("--kv-max-examples")
    seed = config.getoption("--kv-seed")
    if max_examples is not None and max_examples < 1:
        raise pytest.UsageError(f"--kv-max-examples must be >= 1, got {max_examples}")
    if seed is not None and seed < 0:
        raise pytest.UsageError(f"--kv-seed must be >= 0, got {seed}")
    tier_examples = config.getoption("--kv-tier-examples")
    if tier_examples is not None and tier_examples < 1:
        raise pytest.UsageError(f"--kv-tier-examples must be >= 1, got {tier_examples}")
    from properties.tools.options import selected_tiers

    profile = config.kv_profile  # type: ignore[attr-defined]
    try:
        selection = load_selection(
            config.getoption("--kv-skip-checks"), config.getoption("--kv-xfails-file")
        )
        tiers = selected_tiers(config.getoption("--kv-tiers"), profile, max_examples)
    except KVConformError as exc:
        raise pytest.UsageError(str(exc)) from None
    return RunOptions(
        max_examples,
        seed,
        config.getoption("--kv-call-timeout"),
        config.getoption("--kv-isolation"),
        selection,
        tiers,
        tier_examples,
    )


@dataclass
class PropertyRun:
    """One property's run in a pytest session, shared by its ``test_property`` and
    ``test_check`` tests: the result (its failure still set, or ``xfailed``), the seed,
    the checks it ran and the session's engine, level, profile and replay options."""

    result: object  # properties.runner.check.PropertyResult
    seed: int | None
    checks: list[str]
    engine: str
    level: str
    profile: str
    options: str
    page: str | None
    #: listed check -> the reason the xfails file gives
    reasons: dict[str, str]

    @property
    def seed_text(self) -> str:
        return str(self.seed) if self.seed is not None else "derandomized"

    def failure_text(self) -> str:
        """The failure, the seed, the trace, its page and the replay command."""
        from properties.runner.check import failure_report

        return failure_report(
            self.result, self.engine, self.level, self.seed, self.options, self.page
        )

    def xfail_text(self) -> str:
        return "; ".join(f"{c}: {self.reasons.get(c, '')}" for c in self.result.xfailed)


def session_checks(config: pytest.Config) -> dict[str, list[str]]:
    """Property -> the checks it runs for the session's engine, as the CLI's ``checks:``
    line and report state them (computed once, at collection: the per-check tests)."""
    cached = config.__dict__.get("kv_checks")
    if cached is not None:
        return cached
    from properties.runner.config import CheckConfig
    from properties.tools.selection import checks_ran, engine_checks, with_skips

    options: RunOptions = config.kv_options  # type: ignore[attr-defined]
    level = config.getoption("--kv-level")
    check_config = with_skips(
        CheckConfig(
            engine=config.getoption("--kv-engine"),
            level=level,
            call_timeout=options.call_timeout,
            isolation=options.isolation,
        ),
        options.selection,
    )
    from properties.core.constants import PROPERTIES
    from properties.core.engine import EngineError

    try:
        runnable = list(engine_checks(check_config.resolve_engine(), check_config).runnable)
    except EngineError:  # an engine that cannot be built: test_property reports it
        runnable = []
    checks = {prop: checks_ran(prop, runnable, level) for prop in PROPERTIES}
    config.__dict__["kv_checks"] = checks
    return checks


def property_run(config: pytest.Config, prop: str) -> PropertyRun:
    """``prop`` run on the session's engine with its options, once per session (every
    test of the property reads the same run)."""
    runs: dict[str, PropertyRun] = config.__dict__.setdefault("kv_runs", {})
    if prop not in runs:
        with live_output(config):
            runs[prop] = _run_property(config, prop)
    return runs[prop]


def _run_property(config: pytest.Config, prop: str) -> PropertyRun:
    import random

    from hypothesis import settings

    from properties.core.constants import DEFAULT_FAILURE_DIR
    from properties.runner.config import CheckConfig
    from properties.tools.report import report_beside
    from properties.tools.selection import checks_ran, engine_checks, run_selected, with_skips

    options: RunOptions = config.kv_options  # type: ignore[attr-defined]
    engine = config.getoption("--kv-engine")
    level = config.getoption("--kv-level")
    profile_name = config.kv_profile  # type: ignore[attr-defined]
    profile = settings.get_profile(profile_name)
    if options.max_examples is not None:
        profile = settings(profile, max_examples=options.max_examples)
    seed = options.seed
    if seed is None and not profile.derandomize:  # one seed for the session, as the CLI
        seed = config.__dict__.setdefault("kv_seed", random.SystemRandom().randrange(2**32))
    check_config = with_skips(
        CheckConfig(
            engine=engine,
            level=level,
            failure_dir=DEFAULT_FAILURE_DIR,
            call_timeout=options.call_timeout,
            isolation=options.isolation,
        ),
        options.selection,
    )
    under_test = check_config.resolve_engine()

    from properties.runner.check import DEFAULT_SHRINK_SECONDS
    from properties.tools.parallel import PropertyTask, announce_first_failure, run_task

    def run(cfg, names):  # exactly as kvconform check runs a property (same examples)
        task = PropertyTask(
            names[0],
            cfg,
            profile_name,
            options.max_examples,
            seed,
            DEFAULT_SHRINK_SECONDS,
            options.tiers,
            options.tier_examples,
        )
        return [run_task(task, engine=under_test, on_first_failure=announce_first_failure)]

    results, _ = run_selected(run, check_config, [prop], options.selection)
    result = results[0]
    try:
        runnable = list(engine_checks(under_test, check_config).runnable)
    except Exception:  # noqa: BLE001 - the property reports the engine's errors
        runnable = []
    page = None
    for path in (result.trace_path, getattr(result.first, "trace_path", None)):
        if path is not None:  # the HTML page beside every saved trace
            line = report_beside(path)[1]
            page = page or line
    return PropertyRun(
        result,
        seed,
        checks_ran(prop, runnable, level),
        engine,
        level,
        profile_name,
        check_config.replay_options(),
        page,
        dict(options.selection.xfail_reasons),
    )


@contextmanager
def live_output(config: pytest.Config) -> Iterator[None]:
    """The property's progress lines and first-failure announcements reach the terminal
    as they happen (pytest would hold them until the test ends); under pytest-xdist the
    workers have no terminal, and the controller's test lines stand."""
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is None or hasattr(config, "workerinput"):
        yield
        return
    from properties.runner.progress import configure_progress

    configure_progress(False, 2)  # plain lines, one at a time
    with capture.global_and_fixture_disabled():
        yield


def record_property(request: pytest.FixtureRequest, run: PropertyRun) -> None:
    """The property's run in its test report (``user_properties``, which pytest's
    ``--junitxml`` writes as ``<property>`` elements and pytest-xdist carries to the
    controller): the checks it ran, the listed checks that failed, the seed, and the
    CLI's JSON entry of the property (``--kv-report-json``)."""
    import json

    from properties.runner.check import replay_command
    from properties.tools.results import property_entry

    result = run.result
    replay = None
    if result.trace_path is not None:
        replay = replay_command(
            result.trace_path, run.engine, run.level, result.name == "attention", run.options
        )
    entry = property_entry(result, run.checks, replay)
    props = request.node.user_properties
    props.append(("kv_checks_ran", " ".join(run.checks)))
    props.append(("kv_xfailed", " ".join(result.xfailed)))
    props.append(("kv_seed", run.seed_text))
    props.append(("kv_property", json.dumps(entry)))


def check_verdict(run: PropertyRun, check: str) -> None:
    """``test_check``: fail when ``check`` is the check the property failed on, XFAIL
    when it failed and is listed, pass when the run went through it."""
    result = run.result
    if check in result.xfailed:
        pytest.xfail(f"{check}: {run.reasons.get(check, '')}")
    if result.failure is None:
        return
    if result.check == check:
        pytest.fail(run.failure_text(), pytrace=False)
    if result.kind != "property":  # an engine or configuration error ended the run
        pytest.skip(f"not decided: the {result.name} run ended with an error ({result.kind})")


def xfail_verdict(config: pytest.Config, check: str) -> None:
    """``test_xfail``: a listed check over every property of the session (each run once):
    XFAIL if it failed in one, XPASS (strict: a failure) if it ran and never failed,
    skipped if none ran it."""
    from properties.core.constants import PROPERTIES

    selection = config.kv_options.selection  # type: ignore[attr-defined]
    reason = selection.xfail_reasons[check]
    runs = [property_run(config, prop) for prop in PROPERTIES]
    if any(check in run.result.xfailed for run in runs):
        pytest.xfail(f"{check}: {reason}")
    if not any(check in run.checks for run in runs):
        pytest.skip(f"{check} ran in no property ({reason})")
    pytest.fail(
        f"XPASS (strict): {check} listed in {selection.source or 'the xfails file'} as "
        f"expected to fail ({reason}), but ran and never failed; remove it from the file",
        pytrace=False,
    )


class XpassReporter:
    """Collects the checks the tests ran and the listed checks that failed; at the end
    of the session a listed check that ran and never failed fails the run (XPASS)."""

    def __init__(self, selection) -> None:
        self.selection = selection
        self.ran: set[str] = set()
        self.failed: set[str] = set()
        self.message: str | None = None
        self.per_check = False

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        if "test_xfail[" in report.nodeid:
            self.per_check = True  # the listed checks have tests of their own
        props = dict(report.user_properties)
        self.ran.update(props.get("kv_checks_ran", "").split())
        self.failed.update(props.get("kv_xfailed", "").split())

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        from properties.tools.selection import XfailOutcome, xfail_outcomes, xpass_failure

        outcomes = xfail_outcomes(
            [
                XfailOutcome(c, r, "xfail" if c in self.failed else "unknown")
                for c, r in self.selection.xfail
            ],
            self.ran,
        )
        self.message = None if self.per_check else xpass_failure(outcomes, self.selection.source)
        if self.message is not None and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.message is not None:
            terminalreporter.write_line(f"kvconform: {self.message}", red=True)


class ReportCollector:
    """``--kv-report-json FILE``: the JSON report ``kvconform check --report-json``
    writes, from the conformance tests' reports (on the controller under pytest-xdist):
    each property's entry (``kv_property``) and each listed check's outcome
    (``test_xfail``), with the CLI's exit code for them."""

    def __init__(self, path: str) -> None:
        import time

        self.path = path
        self.started = time.perf_counter()
        self.entries: dict[str, dict] = {}
        self.xfails: dict[str, str] = {}
        self.seed = "derandomized"

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        import json

        props = dict(report.user_properties)
        if report.when == "call" and "kv_property" in props:
            entry = json.loads(props["kv_property"])
            self.entries[entry["name"]] = entry
            self.seed = props.get("kv_seed", self.seed)
        if "test_xfail[" in report.nodeid and report.when in ("call", "setup"):
            check = report.nodeid.rsplit("[", 1)[1].rstrip("]")
            if report.skipped and hasattr(report, "wasxfail"):
                self.xfails[check] = "xfail"
            elif report.failed:
                self.xfails[check] = "xpass"
            elif report.skipped:
                self.xfails[check] = "not run"

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        import time

        from properties.core.constants import PROPERTIES
        from properties.core.outcome import combined_exit_code
        from properties.core.output_files import OutputWriteError
        from properties.core.versions import versions
        from properties.tools.results import report_of, write_json

        config = session.config
        options: RunOptions = config.kv_options  # type: ignore[attr-defined]
        entries = [self.entries[p] for p in PROPERTIES if p in self.entries]
        xfails = [
            {"check": c, "reason": r, "status": self.xfails.get(c, "not run"), "property": None}
            for c, r in options.selection.xfail
        ]
        kinds = [(e["failure"] or {}).get("kind") for e in entries]
        kinds += ["property" for x in xfails if x["status"] == "xpass"]
        run = {
            "engine": config.getoption("--kv-engine"),
            "level": config.getoption("--kv-level"),
            "profile": getattr(config, "kv_profile", None),
            "preset": None,
            "seed": None if self.seed == "derandomized" else int(self.seed),
            "max_examples": options.max_examples,
            "skip_checks": sorted(options.selection.skip),
            "xfails_file": options.selection.source,
        }
        seconds = time.perf_counter() - self.started
        report = report_of(run, entries, xfails, versions(), seconds, combined_exit_code(kinds))
        try:
            write_json(report, self.path)
        except OutputWriteError as exc:
            self.line = f"kvconform: {exc}"
        else:
            self.line = f"kvconform: report: {self.path}"

    def pytest_terminal_summary(self, terminalreporter) -> None:
        line = getattr(self, "line", None)
        if line is not None:
            terminalreporter.write_line(line)
