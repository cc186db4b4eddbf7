"""The suite's power: the stateful machine, run with the ``ci`` profile, must catch every
mutant engine of :mod:`properties.mutants.reference_mutants` at the level its catalogue names, and
must pass on the reference.

Detection, not shrinking, is asserted: the shrink phase is off (the first failing
example ends the run), which keeps each mutant to a few seconds. The ``ci`` profile
is derandomized: every machine sees the same fixed stream of examples, so which
mutants it catches changes when the strategies change.

Every mutant is a hard requirement: a mutant that escapes is a gap in the suite.
"""

from __future__ import annotations

import pytest

from properties.core.engine import load_engine_factory
from properties.mutants.reference_mutants import MUTANT_INFO, MUTANTS, MutantInfo
from properties.runner.config import CheckConfig
from properties.tools.bench.suite import DETECTION_EXAMPLES, detection_settings, run_machine

#: Mutant -> why the detection run misses it: a gap in the suite, not in the mutant.


def run_like_check(info: MutantInfo | None, level: str, failure_dir: str):
    """The ``invariants`` property exactly as ``kvconform check --profile ci`` draws it
    (same machine name, so the same derandomized examples), shrinking off."""
    engine = "reference" if info is None else info.target
    factory = load_engine_factory(engine)
    config = CheckConfig(engine=engine, level=level, failure_dir=failure_dir)
    return run_machine(config, factory, detection_settings("ci", DETECTION_EXAMPLES), engine)


@pytest.mark.parametrize("name", list(MUTANT_INFO))
def test_mutant_is_caught(name: str, tmp_path) -> None:
    info = MUTANT_INFO[name]
    row = run_like_check(info, info.level, str(tmp_path))
    assert row.caught, f"{name} escaped the ci profile at level {info.level}: {row}"
    assert row.check in info.caught_by, (
        f"{name} failed for another reason than {sorted(info.caught_by)}: {row.check}"
    )


@pytest.mark.parametrize("level", ["universal", "exact"])
def test_reference_passes(level: str, tmp_path) -> None:
    row = run_like_check(None, level, str(tmp_path))
    assert not row.caught, row
    assert row.examples > 0 and row.steps > 0


def test_catalogue_entries_load_as_engines() -> None:
    assert len(MUTANTS) >= 12
    for name, target in MUTANTS.items():
        assert target == f"properties.mutants.reference_mutants:make_{name}"
        assert load_engine_factory(target) is MUTANT_INFO[name].factory
        assert MUTANT_INFO[name].level in ("universal", "exact")
        assert MUTANT_INFO[name].description
