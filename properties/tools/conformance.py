"""kvconform's conformance suite as a pytest module, for an engine's own repository.

After ``pip install kvconform``::

    pytest --pyargs properties.tools.conformance \
        --kv-engine mypkg.adapter:make_engine --kv-level universal

runs the properties of ``kvconform check`` (:data:`PROPERTIES`: invariants, attention,
determinism, production), one test each, under kvconform's Hypothesis profile
(``--kv-profile``; the CLI's default, ``ci``) with the options of
:mod:`properties.tools.pytest_options` (``--kv-max-examples``, ``--kv-seed``,
``--kv-skip-checks``, ``--kv-xfails-file`` ...). ``--kv-engine`` takes
what ``kvconform check --engine`` takes (a built-in name, ``module:factory`` importable
from the current directory, or ``exec:COMMAND``). A failure is reported with its
message, the saved trace (under ``.kvconform/failures/``) and the ``kvconform replay``
command that reproduces it.

The same tests in an engine's own test folder, with the options in its pytest
configuration (``addopts = --kv-engine mypkg.adapter:make_engine``)::

    # tests/test_kvconform.py
    from properties.tools.conformance import test_property  # noqa: F401
"""

from __future__ import annotations

import pytest

from properties.core.constants import DEFAULT_FAILURE_DIR, PROPERTIES
from properties.runner import profiles as _profiles  # noqa: F401 - registers the profiles
from properties.runner.check import failure_report
from properties.tools.pytest_options import run_property_selected


@pytest.mark.parametrize("prop", PROPERTIES)
def test_property(prop: str, kv_engine: str, kv_level: str, kv_profile_name: str, request) -> None:
    result, seed = run_property_selected(
        request, prop, kv_engine, kv_level, kv_profile_name, DEFAULT_FAILURE_DIR
    )
    print(
        f"kvconform {prop}: {result.examples} examples, {result.steps} steps, "
        f"{result.seconds:.1f}s (engine {kv_engine}, level {kv_level}, profile "
        f"{kv_profile_name}, seed {seed if seed is not None else 'derandomized'})"
    )
    if result.failure is not None:
        pytest.fail(failure_report(result, kv_engine, kv_level), pytrace=False)
    assert result.examples > 0, f"[{prop}] ran no example (every layout unsupported?)"
