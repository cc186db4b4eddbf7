"""The run options of the pytest plugin, the same as ``kvconform check``'s with the same
defaults (:data:`properties.core.constants.DEFAULTS`): ``--kv-max-examples``,
``--kv-seed``, ``--kv-call-timeout``, ``--kv-isolation``, ``--kv-skip-checks``,
``--kv-xfails-file`` (:mod:`properties.tools.selection`).

:func:`run_property_selected` runs one property as the conformance tests do: a failure
on a listed check is XFAIL (``pytest.xfail``, after the property has run again without
it), and every test records the checks it ran and the listed checks that failed in its
report's ``user_properties`` (``kv_checks_ran``, ``kv_xfailed``; pytest's ``--junitxml``
writes them as ``<property>`` elements). :class:`XpassReporter` reads the reports (on
the controller under pytest-xdist too) and, at the end of the session, fails the run on
a listed check that ran in some test and failed in none (XPASS, strict).

Worked example: ``pytest --pyargs kvconform.conformance --kv-engine mymod:make
--kv-xfails-file xf.txt`` with ``hit_bounds  # known`` in ``xf.txt``: the invariants
test is XFAIL when ``hit_bounds`` fails, and the session fails with ``XPASS (strict):
hit_bounds ...`` when it never does.
"""

from __future__ import annotations

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
    try:
        selection = load_selection(
            config.getoption("--kv-skip-checks"), config.getoption("--kv-xfails-file")
        )
    except KVConformError as exc:
        raise pytest.UsageError(str(exc)) from None
    return RunOptions(
        max_examples,
        seed,
        config.getoption("--kv-call-timeout"),
        config.getoption("--kv-isolation"),
        selection,
    )


def run_property_selected(
    request: pytest.FixtureRequest,
    prop: str,
    engine: str,
    level: str,
    profile_name: str,
    failure_dir: str,
):
    """Run ``prop`` on ``engine`` with the session's options; returns the result (its
    failure still set, for the caller to report), after ``pytest.xfail`` when the
    property failed only on listed checks."""
    import random

    from hypothesis import settings

    from properties.runner.check import run_property
    from properties.runner.config import CheckConfig
    from properties.runner.run import active_checks_for
    from properties.tools.selection import checks_ran, run_selected, with_skips

    options: RunOptions = request.config.kv_options  # type: ignore[attr-defined]
    profile = settings.get_profile(profile_name)
    if options.max_examples is not None:
        profile = settings(profile, max_examples=options.max_examples)
    seed = options.seed
    if seed is None and not profile.derandomize:
        seed = random.SystemRandom().randrange(2**32)
    config = with_skips(
        CheckConfig(
            engine=engine,
            level=level,
            failure_dir=failure_dir,
            call_timeout=options.call_timeout,
            isolation=options.isolation,
        ),
        options.selection,
    )
    engine_under_test = config.resolve_engine()

    from properties.tools.engine_coverage import measure_task

    def run(cfg, names):
        return [run_property(names[0], cfg, profile, seed, engine_under_test)]

    with measure_task(config):  # --kv-engine-coverage: measured where the engine runs
        results, _ = run_selected(run, config, [prop], options.selection)
    result = results[0]
    try:
        active = active_checks_for(engine_under_test, config)[0]
    except Exception:  # noqa: BLE001 - the property reports the engine's errors
        active = []
    ran = checks_ran(prop, active, level) if result.passed else []
    request.node.user_properties.append(("kv_checks_ran", " ".join(ran)))
    request.node.user_properties.append(("kv_xfailed", " ".join(result.xfailed)))
    request.node.user_properties.append(("kv_seed", str(seed)))
    if result.passed and result.xfailed:
        reasons = options.selection.xfail_reasons
        pytest.xfail("; ".join(f"{c}: {reasons[c]}" for c in result.xfailed))
    return result, seed


class XpassReporter:
    """Collects the checks the tests ran and the listed checks that failed; at the end
    of the session a listed check that ran and never failed fails the run (XPASS)."""

    def __init__(self, selection) -> None:
        self.selection = selection
        self.ran: set[str] = set()
        self.failed: set[str] = set()
        self.message: str | None = None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
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
        self.message = xpass_failure(outcomes, self.selection.source)
        if self.message is not None and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.message is not None:
            terminalreporter.write_line(f"kvconform: {self.message}", red=True)
