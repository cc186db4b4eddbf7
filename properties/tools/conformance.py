"""kvconform's conformance suite as a pytest module, for an engine's own repository.

After ``pip install kvconform``::

    pytest --pyargs kvconform.conformance \
        --kv-engine mypkg.adapter:make_engine --kv-level universal

runs what ``kvconform check`` runs, as three kinds of tests, so a CI system reading the
JUnit XML sees exactly what the CLI's report says:

* ``test_property[PROPERTY]``: one per property of :data:`PROPERTIES` (invariants,
  attention, determinism, production): the run itself, under kvconform's Hypothesis
  profile (``--kv-profile``; the CLI's default, ``ci``) with the options of
  :mod:`properties.tools.pytest_options`. It fails with the failure, the seed, the saved
  trace (under ``.kvconform/failures/``), its HTML page and the ``kvconform replay``
  command that reproduces it; it is XFAIL when it failed only on checks the
  ``--kv-xfails-file`` lists.
* ``test_check[PROPERTY-CHECK]``: one per check that property runs for this engine (the
  CLI's ``checks:`` line: :func:`properties.tools.selection.engine_checks`), read from the
  property's run (each property runs once per session): it fails when that check failed,
  is XFAIL when it failed and is listed, passes when the run went through it.
* ``test_xfail[CHECK]``: one per listed check: XFAIL when it failed somewhere, a failure
  (XPASS, strict) when it ran and never failed, skipped when no property ran it.

``--kv-engine`` takes what ``kvconform check --engine`` takes (a built-in name,
``module:factory`` importable from the current directory, or ``exec:COMMAND``).
``--kv-report-json FILE`` writes the CLI's JSON report of the session. Under
pytest-xdist, ``--dist loadgroup`` keeps a property's tests on one worker (they are one
``xdist_group``); with another distribution a property may run on two workers, which
gives the same results (the examples are derandomized) at twice the cost.

The same tests in an engine's own test folder, with the options in its pytest
configuration (``addopts = --kv-engine mypkg.adapter:make_engine``)::

    # tests/test_kvconform.py
    from kvconform.conformance import test_check, test_property, test_xfail  # noqa: F401
"""

from __future__ import annotations

import pytest

from properties.core.constants import PROPERTIES
from properties.runner import profiles as _profiles  # noqa: F401 - registers the profiles
from properties.tools.pytest_options import (
    check_verdict,
    property_run,
    record_property,
    xfail_verdict,
)

#: Every conformance test of one session shares this xdist group (``--dist loadgroup``).
GROUP = pytest.mark.xdist_group("kvconform")


@GROUP
@pytest.mark.parametrize("prop", PROPERTIES)
def test_property(prop: str, request: pytest.FixtureRequest) -> None:
    run = property_run(request.config, prop)
    record_property(request, run)
    result = run.result
    print(
        f"kvconform {prop}: {result.examples} examples, {result.steps} steps, "
        f"{result.seconds:.1f}s (engine {run.engine}, level {run.level}, profile "
        f"{run.profile}, seed {run.seed_text})"
    )
    if result.failure is not None:
        pytest.fail(run.failure_text(), pytrace=False)
    if result.xfailed:
        pytest.xfail(run.xfail_text())
    assert result.examples > 0, f"[{prop}] ran no example (every layout unsupported?)"


@GROUP
def test_check(kv_check_case: tuple[str, str], request: pytest.FixtureRequest) -> None:
    """(Parametrized by the plugin's ``pytest_generate_tests``: one case per check.)"""
    prop, check = kv_check_case
    check_verdict(property_run(request.config, prop), check)


@GROUP
def test_xfail(kv_xfail_check: str, request: pytest.FixtureRequest) -> None:
    """(Parametrized by the plugin: one case per check of ``--kv-xfails-file``.)"""
    xfail_verdict(request.config, kv_xfail_check)
