"""pytest plugin of kvconform: ``--kv-engine``, ``--kv-level``, ``--kv-profile``.

Registered through the ``pytest11`` entry point of the ``kvconform`` package, so any
project that installs kvconform gets the options. The entry point is named after the
module: an explicit ``-p properties.tools.pytest_plugin`` finds it registered already,
and ``-p no:properties.tools.pytest_plugin`` turns it off. It never changes Hypothesis'
global settings on its own: our profile is loaded only when ``--kv-profile`` is given or
the project opts in with the ini setting ``kv_hypothesis_profile`` (this repository sets
``auto``: ``ci`` under ``CI=true``, ``dev`` otherwise; a profile name loads that one).
The conformance tests (:mod:`properties.tools.conformance`) pass their settings
explicitly and need neither.

Fixtures: ``kv_engine`` (the engine name), ``kv_level``, ``kv_profile_name`` (the profile
the conformance tests use: ``--kv-profile``, else ``ci`` under ``CI=true``, else ``dev``).

A ``--kv-engine`` that cannot be loaded stops the run at once with a usage error (pytest
exit code 4), never a skip. The ``kv_check`` fixture runs a property of
:mod:`properties.runner.check` and fails the test with the failure, the saved trace and
the command that replays it (:func:`properties.runner.check.failure_report`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from properties.core.constants import DEFAULT_LEVEL, LEVELS, PROFILES
from properties.core.outcome import Outcome
from reference.errors import KVConformError


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def default_profile() -> str:
    """``ci`` under ``CI=true``, ``dev`` otherwise."""
    return "ci" if _ci() else "dev"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvconform")
    group.addoption(
        "--kv-engine",
        default="reference",
        help="engine under test: a built-in name, module:factory or exec:COMMAND",
    )
    group.addoption(
        "--kv-level",
        default=DEFAULT_LEVEL,
        choices=LEVELS,
        help=f"property level of the stateful machine (default {DEFAULT_LEVEL}, as the CLI)",
    )
    group.addoption(
        "--kv-profile",
        default=None,
        choices=PROFILES,
        help="kvconform's Hypothesis profile (default: ci when CI=true, else dev)",
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
    config.kv_profile = profile or default_profile()  # type: ignore[attr-defined]
    if profile:
        from properties.runner.profiles import load_profile

        load_profile(profile)
    engine = config.getoption("--kv-engine")
    if engine != "reference":  # a bad engine fails the run, it never skips
        from properties.runner.config import CheckConfig
        from properties.runner.machine import engine_factory

        try:
            factory = engine_factory(CheckConfig(engine=engine))
            if engine.startswith("exec:"):
                factory.hello  # noqa: B018 - starts the child: a missing program is a usage error
        except KVConformError as exc:
            if Outcome.of_error(exc) is not Outcome.USAGE:
                raise
            raise pytest.UsageError(f"--kv-engine: {exc}") from None


def pytest_report_header(config: pytest.Config) -> str:
    return (
        f"kvconform: engine={config.getoption('--kv-engine')} "
        f"level={config.getoption('--kv-level')} "
        f"hypothesis profile={getattr(config, 'kv_profile', '?')}"
    )


@pytest.fixture
def kv_engine(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--kv-engine")


@pytest.fixture
def kv_level(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--kv-level")


@pytest.fixture
def kv_profile_name(request: pytest.FixtureRequest) -> str:
    return getattr(request.config, "kv_profile", None) or default_profile()


@pytest.fixture
def kv_check(request: pytest.FixtureRequest, kv_profile_name: str, tmp_path) -> Callable:
    """``kv_check("invariants", level=...)``: run a property on the engine under test
    with kvconform's profile; a failure fails the test with the trace and replay command."""
    from hypothesis import settings

    from properties.runner.check import failure_report, run_property
    from properties.runner.config import CheckConfig

    def run(name: str, level: str | None = None, **extra):
        engine = request.config.getoption("--kv-engine")
        level = level or request.config.getoption("--kv-level")
        config = CheckConfig(engine=engine, level=level, failure_dir=str(tmp_path), **extra)
        result = run_property(name, config, settings.get_profile(kv_profile_name), seed=None)
        if not result.passed:
            pytest.fail(failure_report(result, engine, level), pytrace=False)
        return result

    return run
