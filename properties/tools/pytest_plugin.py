"""pytest plugin of kvconform: ``--kv-engine``, ``--kv-level``, ``--kv-profile``.

Loaded through ``addopts = "-p properties.tools.pytest_plugin"``. It registers and loads
our Hypothesis profile explicitly (``--kv-profile``, default ``ci`` under
``CI=true`` and ``dev`` otherwise), so Hypothesis' built-in ``ci`` profile never
silently applies, and exposes the engine under test to
``tests/properties/runner/test_machine.py``.

A ``--kv-engine`` that cannot be loaded stops the run at once with a usage error (pytest
exit code 4), never a skip. The ``kv_check`` fixture runs a property of
:mod:`properties.runner.check` and fails the test with the failure, the saved trace and
the command that replays it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from properties.core.constants import DEFAULT_LEVEL, LEVELS, PROFILES
from properties.core.engine import EngineLoadError
from properties.runner.profiles import load_profile


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvconform")
    group.addoption(
        "--kv-engine",
        default="reference",
        help="engine under test: a built-in name or module:factory",
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
        help="Hypothesis profile (default: ci when CI=true, else dev)",
    )


def pytest_configure(config: pytest.Config) -> None:
    profile = config.getoption("--kv-profile") or (
        "ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev"
    )
    load_profile(profile)
    config.kv_profile = profile  # type: ignore[attr-defined]
    engine = config.getoption("--kv-engine")
    if engine != "reference":  # a bad engine fails the run, it never skips
        from properties.runner.config import CheckConfig
        from properties.runner.machine import engine_factory

        try:
            engine_factory(CheckConfig(engine=engine))
        except EngineLoadError as exc:
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


def failure_report(result, engine: str, level: str) -> str:
    """What a failed property prints: the failure, the trace and its replay command."""
    from properties.runner.check import replay_command

    lines = [f"{result.name} ({result.kind}): {result.failure}"]
    if result.note:
        lines.append(f"note: {result.note}")
    if result.trace_path is not None:
        command = replay_command(result.trace_path, engine, level, result.name == "attention")
        lines += [f"trace: {result.trace_path}", f"replay: {command}"]
    return "\n".join(lines)


@pytest.fixture
def kv_check(request: pytest.FixtureRequest, tmp_path) -> Callable:
    """``kv_check("invariants", level=...)``: run a property on the engine under test
    with the loaded profile; a failure fails the test with :func:`failure_report`."""
    from hypothesis import settings

    from properties.runner.check import run_property
    from properties.runner.config import CheckConfig

    def run(name: str, level: str | None = None, **extra):
        engine = request.config.getoption("--kv-engine")
        level = level or request.config.getoption("--kv-level")
        config = CheckConfig(engine=engine, level=level, failure_dir=str(tmp_path), **extra)
        result = run_property(name, config, settings(), seed=None)
        if not result.passed:
            pytest.fail(failure_report(result, engine, level), pytrace=False)
        return result

    return run
