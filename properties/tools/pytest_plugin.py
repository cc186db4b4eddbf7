"""pytest plugin of kvconform: ``--kv-engine``, ``--kv-level``, ``--kv-profile``.

Loaded through ``addopts = "-p properties.tools.pytest_plugin"``. It registers and loads
our Hypothesis profile explicitly (``--kv-profile``, default ``ci`` under
``CI=true`` and ``dev`` otherwise), so Hypothesis' built-in ``ci`` profile never
silently applies, and exposes the engine under test to
``tests/properties/runner/test_machine.py``.
"""

from __future__ import annotations

import os

import pytest

from properties.core.constants import DEFAULT_LEVEL, LEVELS, PROFILES
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
