"""The engine under test as one value (issue 17 item 2) and its declarations checked on
load (issue 22 item 4): each wrong declaration is a usage error (exit 2) with one line
naming the field and the type expected, never a failure inside a worker.

The fixtures are in ``tests/properties/tools/broken_engines.py`` (factories whose
function attributes are wrong, and ``FULL_ONLY``, an exported ``EngineUnderTest``) and
``tests/properties/engines/misbehaving_engine.py`` (an ``exec:`` engine whose ``hello``
declares ``spec_types`` as a string). Three cases run the real CLI in a subprocess; the
others call :func:`resolve_engine` and the CLI's own classification of the error.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from properties.core.constants import EXIT_USAGE, SPEC_KINDS
from properties.core.declarations import DeclarationError
from properties.core.engine import KnownDivergence
from properties.engines.isolation import IsolatedFactory
from properties.engines.reference import PRODUCTION_SETTINGS, ReferenceEngine
from properties.engines.under_test import EngineUnderTest, resolve_engine
from properties.runner.config import CheckConfig
from properties.tools.cli import classify_error
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec
from tests.properties.tools import broken_engines

ROOT = Path(__file__).resolve().parents[3]
BROKEN = "tests.properties.tools.broken_engines"
MISBEHAVING = ROOT / "tests" / "properties" / "engines" / "misbehaving_engine.py"
QUICK = ["--profile", "dev", "--max-examples", "5", "--seed", "1", "--only", "invariants"]


def run_cli(*args: str) -> tuple[int, str, str]:
    """The real ``kvconform`` in a subprocess: (exit code, stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "properties.tools.cli", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout, proc.stderr


def the_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def load_error(name: str) -> tuple[int, str]:
    """The exit code and line the CLI gives for resolving adapter ``name`` of the
    broken-engine fixtures (in process)."""
    with pytest.raises(DeclarationError) as caught:
        resolve_engine(f"{BROKEN}:{name}", isolation="none")
    return classify_error(caught.value)


# -- the CLI, in a subprocess ---------------------------------------------------------------


def test_cli_spec_types_as_a_string_exits_2_naming_the_field() -> None:
    code, out, err = run_cli("check", "--engine", f"{BROKEN}:make_spec_types_string", *QUICK)
    assert code == EXIT_USAGE, out + err
    line = the_line(err)
    assert "factory attribute spec_types must be a list of spec type names" in line
    assert "got the string 'full'" in line


def test_cli_layout_strategy_drawing_an_int_exits_2_naming_the_field() -> None:
    code, out, err = run_cli("check", "--engine", f"{BROKEN}:make_strategy_draws_int", *QUICK)
    assert code == EXIT_USAGE, out + err
    line = the_line(err)
    assert "layout_strategy() must draw KVCacheLayout values, drew int" in line


def test_cli_exec_hello_spec_types_as_a_string_exits_2_naming_the_field() -> None:
    engine = f"exec:python {MISBEHAVING} spec-types hello"
    code, out, err = run_cli("check", "--engine", engine, *QUICK)
    assert code == EXIT_USAGE, out + err
    line = the_line(err)
    assert "hello's spec_types must be a list of spec type names" in line
    assert "got the string 'full'" in line


# -- each declaration, through resolve_engine --------------------------------------------


def test_layout_strategy_not_callable() -> None:
    code, line = load_error("make_strategy_not_callable")
    assert code == EXIT_USAGE
    assert "factory attribute layout_strategy must be a callable" in line
    assert "got int 42" in line


def test_layout_strategy_returning_a_list() -> None:
    code, line = load_error("make_strategy_returns_list")
    assert code == EXIT_USAGE
    assert "layout_strategy() must return a Hypothesis strategy of KVCacheLayout" in line
    assert "got list" in line


def test_layout_strategy_drawing_an_int() -> None:
    code, line = load_error("make_strategy_draws_int")
    assert code == EXIT_USAGE
    assert "layout_strategy() must draw KVCacheLayout values, drew int" in line


def test_known_divergences_of_the_wrong_type() -> None:
    code, line = load_error("make_bad_divergences")
    assert code == EXIT_USAGE
    assert "known_divergences must be a list of properties.core.engine.KnownDivergence" in line
    assert "got 'vllm-bug' at index 0" in line


def test_unknown_spec_types() -> None:
    code, line = load_error("make_unknown_spec_types")
    assert code == EXIT_USAGE
    assert "spec_types must be a non-empty list of distinct spec type names" in line
    assert "unknown ['linear']" in line


def test_spec_types_given_as_a_string() -> None:
    code, line = load_error("make_spec_types_string")
    assert code == EXIT_USAGE
    assert "spec_types must be a list of spec type names" in line
    assert "got the string 'full'" in line


def test_production_settings_given_as_a_string() -> None:
    code, line = load_error("make_settings_string")
    assert code == EXIT_USAGE
    assert "production_settings must be a list of names among" in line
    assert "got 'retention'" in line


def test_engine_under_test_fields_are_checked_when_built() -> None:
    with pytest.raises(DeclarationError, match=r"EngineUnderTest\.spec_types .*string 'full'"):
        EngineUnderTest(name="x", factory=ReferenceEngine, spec_types="full")
    with pytest.raises(DeclarationError, match=r"EngineUnderTest\.factory must be a callable"):
        EngineUnderTest(name="x", factory=42)
    with pytest.raises(DeclarationError, match=r"EngineUnderTest\.known_divergences"):
        EngineUnderTest(name="x", factory=ReferenceEngine, known_divergences=("x",))
    with pytest.raises(DeclarationError, match=r"EngineUnderTest\.enforces_call_timeout"):
        EngineUnderTest(name="x", factory=ReferenceEngine, enforces_call_timeout="yes")


# -- what a resolved engine holds ------------------------------------------------------------


def test_function_attributes_become_fields() -> None:
    engine = resolve_engine("reference")
    assert engine.name == "reference"
    assert engine.spec_types == SPEC_KINDS  # declares none: all four
    assert engine.production_settings == PRODUCTION_SETTINGS
    assert engine.known_divergences == ()
    assert engine.layout_strategy is None and not engine.enforces_call_timeout
    assert engine.call_timeout(5.0) == 5.0


def test_an_exported_engine_under_test_is_used_as_declared() -> None:
    engine = resolve_engine(f"{BROKEN}:FULL_ONLY", isolation="none")
    assert engine.name == f"{BROKEN}:FULL_ONLY"  # the name it was loaded by
    assert engine.spec_types == ("full",)
    assert engine.factory is ReferenceEngine
    assert engine is not broken_engines.FULL_ONLY  # renamed copy, the original kept
    assert broken_engines.FULL_ONLY.name == "full-only reference"


def test_an_outside_adapter_is_isolated_once_on_load() -> None:
    engine = CheckConfig(engine=f"{BROKEN}:FULL_ONLY", call_timeout=5.0).resolve_engine()
    try:
        assert isinstance(engine.factory, IsolatedFactory)
        assert engine.enforces_call_timeout and engine.call_timeout(5.0) == 0.0
        assert engine.spec_types == ("full",)  # read in this process, as declared
    finally:
        engine.close()


def test_serving_mode_keeps_external_hits_only_when_declared() -> None:
    from properties.core.modes import SYNC, ServingMode

    drawn = ServingMode(async_scheduling=True, external_hits=True, async_loads=True)
    bare = EngineUnderTest(name="bare", factory=ReferenceEngine)
    assert bare.serving_mode(drawn, True) == ServingMode(async_scheduling=True)
    assert bare.serving_mode(drawn, False) == SYNC
    full = EngineUnderTest(
        name="full", factory=ReferenceEngine, production_settings=frozenset({"external"})
    )
    assert full.serving_mode(drawn, True) == drawn


def test_known_divergences_are_kept_as_a_tuple() -> None:
    divergence = KnownDivergence("d", "summary", "findings/d.md", lambda layout: False)
    engine = EngineUnderTest(name="x", factory=ReferenceEngine, known_divergences=[divergence])
    assert engine.known_divergences == (divergence,)


def _has_mamba(layout) -> bool:
    return any(isinstance(g.spec, MambaSpec) for g in layout.groups)


def test_a_divergence_of_a_serving_mode_gives_the_default_mode() -> None:
    """``KnownDivergence.modes``: the layouts stay drawn (``applies_to(layout)`` is false
    without a mode); a run whose layout and mode it applies to gets ``SYNC``."""
    from properties.core.modes import SYNC, ServingMode

    leak = KnownDivergence(
        "leak", "s", "f.md", _has_mamba, ("async", "mamba"), lambda mode: mode.async_scheduling
    )
    engine = EngineUnderTest(name="x", factory=ReferenceEngine, known_divergences=(leak,))
    mamba = KVCacheLayout(
        groups=(KVCacheGroup(("m",), MambaSpec(block_size=4, shapes=((4, 8),))),),
        num_blocks=8,
        max_model_len=16,
    )
    full = KVCacheLayout(
        groups=(KVCacheGroup(("f",), FullAttentionSpec(block_size=4)),),
        num_blocks=8,
        max_model_len=16,
    )
    asynchronous = ServingMode(async_scheduling=True, admission_gate=True)
    gated = ServingMode(admission_gate=True)
    assert not leak.applies_to(mamba) and leak.applies_to(mamba, asynchronous)
    assert engine.serving_mode(asynchronous, True, mamba) == SYNC
    assert engine.serving_mode(gated, True, mamba) == gated
    assert engine.serving_mode(asynchronous, True, full) == asynchronous
    assert engine.serving_mode(asynchronous, True) == asynchronous


@pytest.mark.parametrize(
    ("divergence", "message"),
    [
        (
            KnownDivergence("d", "s", "f.md", _has_mamba, modes=lambda mode: True),
            "false for the default synchronous mode",
        ),
        (
            KnownDivergence("d", "s", "f.md", _has_mamba, ("async", "mamba", "full")),
            "at most two pair-table feature names",
        ),
        (KnownDivergence("d", "s", "f.md", _has_mamba, ["async"]), "tuple of at most two"),
    ],
)
def test_a_bad_divergence_declaration_is_refused(divergence, message) -> None:
    with pytest.raises(DeclarationError, match=message):
        EngineUnderTest(name="x", factory=ReferenceEngine, known_divergences=(divergence,))
