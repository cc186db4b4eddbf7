"""pytest plugin of kvconform: ``--kv-engine``, ``--kv-level``, ``--kv-profile`` and the
run options of :mod:`properties.tools.pytest_options` (``--kv-max-examples``,
``--kv-seed``, ``--kv-call-timeout``, ``--kv-isolation``, ``--kv-skip-checks``,
``--kv-xfails-file``), with the defaults of ``kvconform check``
(:data:`properties.core.constants.DEFAULTS`).

Registered through the ``pytest11`` entry point of the ``kvconform`` package, so any
project that installs kvconform gets the options. The entry point is named after the
module: an explicit ``-p properties.tools.pytest_plugin`` finds it registered already,
and ``-p no:properties.tools.pytest_plugin`` turns it off. It never changes Hypothesis'
global settings on its own: our profile is loaded only when ``--kv-profile`` is given or
the project opts in with the ini setting ``kv_hypothesis_profile`` (this repository sets
``auto``: ``ci`` under ``CI=true``, ``dev`` otherwise; a profile name loads that one).
The conformance tests (:mod:`properties.tools.conformance`) pass their settings
explicitly and need neither.

``--kv-engine-coverage [MODULE,...]`` measures the branch coverage of the engine's own
modules while the tests drive it (``kv_check``) and prints the report at the end
(:mod:`properties.tools.engine_coverage`).

Fixtures: ``kv_engine`` (the engine name), ``kv_engine_under_test`` (it resolved once,
:func:`properties.engines.under_test.resolve_engine`), ``kv_level``, ``kv_profile_name``
(the profile the conformance tests use: ``--kv-profile``, else the ini setting's, else
the CLI's default ``DEFAULTS.profile``).

A ``--kv-engine`` that cannot be loaded stops the run at once with a usage error (pytest
exit code 4), never a skip. The ``kv_check`` fixture runs a property of
:mod:`properties.runner.check` and fails the test with the failure, the saved trace and
the command that replays it (:func:`properties.runner.check.failure_report`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from properties.core.constants import DEFAULTS, LEVELS, PROFILES
from properties.core.outcome import Outcome
from properties.tools import pytest_options
from reference.errors import KVConformError


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def default_profile() -> str:
    """The ini setting ``auto``: ``ci`` under ``CI=true``, ``dev`` otherwise."""
    return "ci" if _ci() else "dev"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvconform")
    group.addoption(
        "--kv-engine",
        default=DEFAULTS.engine,
        help="engine under test: a built-in name, module:factory or exec:COMMAND",
    )
    group.addoption(
        "--kv-level",
        default=DEFAULTS.level,
        choices=LEVELS,
        help=f"property level of the stateful machine (default {DEFAULTS.level}, as the CLI)",
    )
    group.addoption(
        "--kv-profile",
        default=None,
        choices=PROFILES,
        help=f"kvconform's Hypothesis profile (default {DEFAULTS.profile}, as the CLI)",
    )
    pytest_options.add_options(group)
    group.addoption(
        "--kv-engine-coverage",
        nargs="?",
        const="",
        default=None,
        metavar="MODULE[,MODULE...]",
        help="branch coverage of these modules of the engine under test, printed at the end "
        "(no value: the adapter's coverage_modules; properties.tools.engine_coverage)",
    )
    group.addoption(
        "--kv-report-json",
        default=None,
        metavar="FILE",
        help="write kvconform check's JSON report of the conformance tests that ran "
        "(properties.tools.results)",
    )
    parser.addini(
        "kv_hypothesis_profile",
        default="",
        help="load a kvconform Hypothesis profile globally: 'auto' (ci when CI=true, else "
        "dev) or a profile name; empty (default): only when --kv-profile is given",
    )


def pytest_configure(config: pytest.Config) -> None:
    explicit = config.getoption("--kv-profile")
    wanted = config.getini("kv_hypothesis_profile").strip()
    if wanted and wanted != "auto" and wanted not in PROFILES:
        raise pytest.UsageError(
            f"ini kv_hypothesis_profile must be 'auto' or one of {', '.join(PROFILES)}, "
            f"got {wanted!r}"
        )
    profile = explicit or (default_profile() if wanted == "auto" else wanted)
    config.kv_profile = profile or DEFAULTS.profile  # type: ignore[attr-defined]
    config.kv_options = pytest_options.run_options(config)  # type: ignore[attr-defined]
    if config.kv_options.selection.xfail and not hasattr(config, "workerinput"):
        # on the controller only (pytest-xdist): it hears every worker's reports
        config.pluginmanager.register(pytest_options.XpassReporter(config.kv_options.selection))
    report_json = config.getoption("--kv-report-json")
    if report_json is not None and not hasattr(config, "workerinput"):
        from properties.core.output_files import OutputPathError, check_output_file

        try:
            check_output_file(report_json, "--kv-report-json")
        except OutputPathError as exc:
            raise pytest.UsageError(str(exc)) from None
        config.pluginmanager.register(pytest_options.ReportCollector(report_json))
    if profile:
        from properties.runner.profiles import load_profile

        load_profile(profile)
    engine = config.getoption("--kv-engine")
    if engine != "reference":  # a bad engine fails the run, it never skips
        from properties.runner.config import CheckConfig

        try:
            CheckConfig(engine=engine).resolve_engine()  # an exec: engine's child starts
        except KVConformError as exc:
            if Outcome.of_error(exc) is not Outcome.USAGE:
                raise
            raise pytest.UsageError(f"--kv-engine: {exc}") from None
    if config.getoption("--kv-engine-coverage") is not None:
        _start_engine_coverage(config, engine)


def _start_engine_coverage(config: pytest.Config, engine: str) -> None:
    """``--kv-engine-coverage``: request it now; the report comes in the summary."""
    from types import SimpleNamespace

    from properties.runner.config import CheckConfig
    from properties.tools.engine_coverage import open_session

    args = SimpleNamespace(
        engine=engine,
        engine_coverage=config.getoption("--kv-engine-coverage"),
        engine_coverage_baseline=None,
        engine_coverage_write_baseline=None,
    )
    try:
        finish = open_session(args, CheckConfig(engine=engine).resolve_engine())
    except Exception as exc:  # noqa: BLE001 - a bad module is a usage error
        raise pytest.UsageError(str(exc)) from None
    config.kv_engine_coverage = finish  # type: ignore[attr-defined]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The per-check conformance tests (:mod:`properties.tools.conformance`): one
    ``kv_check_case`` per check each property runs for the engine, one ``kv_xfail_check``
    per check of ``--kv-xfails-file``."""
    config = metafunc.config
    if "kv_check_case" in metafunc.fixturenames:
        checks = pytest_options.session_checks(config)
        cases = [(prop, check) for prop, names in checks.items() for check in names]
        metafunc.parametrize(
            "kv_check_case", cases, ids=[f"{prop}-{check}" for prop, check in cases]
        )
    if "kv_xfail_check" in metafunc.fixturenames:
        listed = [check for check, _reason in config.kv_options.selection.xfail]  # type: ignore[attr-defined]
        metafunc.parametrize("kv_xfail_check", listed, ids=listed)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without an xfails file there is no ``test_xfail`` case: its empty parametrization
    is deselected, not reported as a skipped test."""
    empty = [
        item
        for item in items
        if item.name.startswith("test_xfail[")
        and any(
            "empty parameter set" in str(m.kwargs.get("reason", ""))
            for m in item.iter_markers("skip")
        )
    ]
    if empty:
        config.hook.pytest_deselected(items=empty)
        items[:] = [item for item in items if item not in empty]


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    finish = getattr(config, "kv_engine_coverage", None)
    if finish is not None:
        config.kv_engine_coverage = None  # type: ignore[attr-defined]
        terminalreporter.section("kvconform engine coverage")
        finish()


def pytest_report_header(config: pytest.Config) -> str:
    return (
        f"kvconform: engine={config.getoption('--kv-engine')} "
        f"level={config.getoption('--kv-level')} "
        f"hypothesis profile={getattr(config, 'kv_profile', '?')}"
    )


@pytest.fixture
def kv_engine(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--kv-engine")


@pytest.fixture(scope="session")
def kv_engine_under_test(request: pytest.FixtureRequest):
    """The engine under test of ``--kv-engine``, resolved once for the session (an
    :class:`properties.engines.under_test.EngineUnderTest`)."""
    from properties.runner.config import CheckConfig

    return CheckConfig(engine=request.config.getoption("--kv-engine")).resolve_engine()


@pytest.fixture
def kv_level(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--kv-level")


@pytest.fixture
def kv_profile_name(request: pytest.FixtureRequest) -> str:
    return getattr(request.config, "kv_profile", None) or DEFAULTS.profile


@pytest.fixture
def kv_check(
    request: pytest.FixtureRequest, kv_profile_name: str, kv_engine_under_test, tmp_path
) -> Callable:
    """``kv_check("invariants", level=...)``: run a property on the engine under test
    with kvconform's profile; a failure fails the test with the trace and replay command."""
    from hypothesis import settings

    from properties.runner.check import failure_report, run_property
    from properties.runner.config import CheckConfig
    from properties.tools.engine_coverage import measure_task

    def run(name: str, level: str | None = None, **extra):
        engine = request.config.getoption("--kv-engine")
        level = level or request.config.getoption("--kv-level")
        config = CheckConfig(engine=engine, level=level, failure_dir=str(tmp_path), **extra)
        profile = settings.get_profile(kv_profile_name)
        with measure_task(config):  # --kv-engine-coverage: measured where the engine runs
            result = run_property(name, config, profile, None, kv_engine_under_test)
        if not result.passed:
            pytest.fail(failure_report(result, engine, level), pytrace=False)
        return result

    return run
