"""The suite's power: the stateful machine, run with the ``ci`` profile, must catch every
mutant engine of :mod:`tests.mutants.engines` at the level its catalogue names, and
must pass on the reference.

Detection, not shrinking, is asserted: the shrink phase is off (the first failing
example ends the run), which keeps each mutant to a few seconds. Each mutant's
first failure must be one of the checks its catalogue entry lists, so a mutant that
merely crashes (a bug in the mutant itself) does not count as caught.

Mutants in :data:`KNOWN_GAPS` escape the ``ci`` budget today; their tests are
``xfail(strict=True)``, so closing a gap turns them into a failure that asks for the
entry to be removed.
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from properties.engine import load_engine_factory
from properties.machine import CheckConfig, machine_for
from properties.profiles import load_profile
from tests.mutants.engines import MUTANT_INFO, MUTANTS, MutantInfo

#: Mutant -> why the ``ci`` run misses it (see the report in the module docstring).
KNOWN_GAPS: dict[str, str] = {}


def detection_settings() -> settings:
    """The ``ci`` profile without the shrink phase."""
    return settings(load_profile("ci"), phases=(Phase.explicit, Phase.generate))


def failure_names(exc: BaseException) -> set[str]:
    """The property names (``PropertyViolation.name``) a failure carries."""
    if isinstance(exc, BaseExceptionGroup):
        return {n for sub in exc.exceptions for n in failure_names(sub)}
    return {getattr(exc, "name", None) or type(exc).__name__}


def run_machine(info: MutantInfo | None, level: str, failure_dir: str) -> None:
    engine = "reference" if info is None else info.target
    factory = None if info is None else info.factory
    config = CheckConfig(engine=engine, level=level, failure_dir=failure_dir)
    run_state_machine_as_test(machine_for(config, factory), settings=detection_settings())


def _params() -> list:
    out = []
    for name in MUTANT_INFO:
        marks = []
        if name in KNOWN_GAPS:
            marks.append(pytest.mark.xfail(reason=KNOWN_GAPS[name], strict=True))
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.mark.parametrize("name", _params())
def test_mutant_is_caught(name: str, tmp_path) -> None:
    info = MUTANT_INFO[name]
    with pytest.raises(Exception) as caught:  # noqa: B017 - any failure, checked below
        run_machine(info, info.level, str(tmp_path))
    fired = failure_names(caught.value)
    assert fired & info.caught_by, (
        f"{name} failed for another reason than {sorted(info.caught_by)}: {caught.value!r}"
    )


@pytest.mark.parametrize("level", ["universal", "exact"])
def test_reference_passes(level: str, tmp_path) -> None:
    run_machine(None, level, str(tmp_path))


def test_catalogue_entries_load_as_engines() -> None:
    assert len(MUTANTS) >= 12
    for name, target in MUTANTS.items():
        assert target == f"tests.mutants.engines:make_{name}"
        assert load_engine_factory(target) is MUTANT_INFO[name].factory
        assert MUTANT_INFO[name].level in ("universal", "exact")
        assert MUTANT_INFO[name].description
