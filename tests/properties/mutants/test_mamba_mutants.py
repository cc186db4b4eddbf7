"""Hand-written traces that catch the Mamba mutants the ci streams reach too rarely
(``CI_ESCAPES`` in ``test_mutants.py``): each trace passes on the reference and fails on
the mutant with the check its catalogue entry names."""

from __future__ import annotations

from pathlib import Path

import pytest

from properties.checks.registry import PropertyViolation
from properties.core.engine import EngineError
from properties.core.trace import Arrive, Step, load_trace
from properties.engines.under_test import EngineUnderTest, resolve_engine
from properties.mutants.mamba_modes import (
    make_mamba_eagle_look_past,
    make_mamba_negative_estimate,
)
from properties.runner.config import CheckConfig
from properties.runner.run import TraceRun, replay_trace
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec

ROOT = Path(__file__).resolve().parents[3]
FINDING = ROOT / "findings" / "vllm" / "mamba-negative-estimate-after-rollback.json"


def test_the_findings_trace_catches_the_negative_estimate() -> None:
    """The finding's trace (a 4-draft decode all rejected, then a 1-token step): the
    reference passes; the mutant (vLLM 0.33's rule) reports an estimate of -1."""
    trace = load_trace(FINDING)
    config = CheckConfig(level="exact")
    _, failure = replay_trace(trace, config, resolve_engine("reference"))
    assert failure is None
    mutant = EngineUnderTest(name="mutant", factory=make_mamba_negative_estimate)
    _, failure = replay_trace(trace, config, mutant)
    assert isinstance(failure, EngineError)
    assert "returned -1, not a block count >= 0" in str(failure)


#: full bs 4 + Mamba bs 4, EAGLE on both (tests/reference/test_mamba_modes.py's vector)
EAGLE_MAMBA = KVCacheLayout(
    (
        KVCacheGroup(("full",), FullAttentionSpec(block_size=4)),
        KVCacheGroup(("mamba",), MambaSpec(block_size=4)),
    ),
    num_blocks=16,
    max_model_len=64,
    use_eagle=True,
)


@pytest.mark.parametrize("factory", [None, make_mamba_eagle_look_past])
def test_a_resend_under_eagle_catches_a_mamba_lookup_looking_past(factory) -> None:
    """A writer computes 12 tokens in chunks of 8 and 4 (Mamba states at 8 and 12) and
    finishes; a reader of those 12 tokens and 4 more hits 8 (full attention drops its
    last block; Mamba looks no further). The mutant's Mamba lookup finds the state at
    12: its hit differs from the reference's."""
    engine = resolve_engine("reference" if factory is None else factory)
    run = TraceRun(CheckConfig(level="exact"), EAGLE_MAMBA, engine)
    prompt = tuple(range(12))
    for op in (Arrive("w", prompt), Step(8), Step(64), Arrive("r", prompt + (50, 51, 52, 53))):
        run.apply(op)
    if factory is None:
        run.apply(Step(64))
        return
    with pytest.raises(PropertyViolation, match="exact_match"):
        run.apply(Step(64))
