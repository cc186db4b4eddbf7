"""Drafts on Mamba layouts: what a mode becomes on a layout with speculative Mamba blocks,
the varying proposer, the pair table's needs, the checks' state writes of a draft step,
and a known divergence met at run time stopping its example. Values worked out by hand
(the hashes with hashlib, as the rules say)."""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from properties.checks.mamba_states import StateWrite, settle_copy, step_state_writes
from properties.core.engine import KnownDivergenceMet, RequestInput
from properties.core.modes import ServingMode, proposed_drafts
from properties.core.trace import Arrive, Step
from properties.engines.reference import ReferenceEngine
from properties.engines.under_test import EngineUnderTest
from properties.generate.strategies import mode_for_layout
from properties.runner.config import CheckConfig
from properties.runner.pairs import Declared, features, pair_status
from properties.runner.scheduler import Drafts, RequestState
from properties.runner.tiers import TierOutcome, _run_trace
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec


def _mamba_layout(k: int, **spec) -> KVCacheLayout:
    return KVCacheLayout(
        (
            KVCacheGroup(("full",), FullAttentionSpec(block_size=4)),
            KVCacheGroup(("m",), MambaSpec(block_size=4, num_speculative_blocks=k, **spec)),
        ),
        num_blocks=40,
        max_model_len=64,
    )


def test_mode_for_layout_sizes_drafts_by_the_speculative_blocks() -> None:
    two = _mamba_layout(2)
    assert mode_for_layout(ServingMode(num_draft_tokens=3), two) == ServingMode(num_draft_tokens=2)
    assert mode_for_layout(ServingMode(num_draft_tokens=3), _mamba_layout(0)) == ServingMode()
    # speculative blocks serve a proposer: a synchronous mode without drafts gets k varying
    assert mode_for_layout(ServingMode(admission_gate=True), two) == ServingMode(
        admission_gate=True, num_draft_tokens=2, varying_drafts=True
    )
    # drafts with asynchronous scheduling are not modelled: none
    asynchronous = ServingMode(async_scheduling=True)
    assert mode_for_layout(asynchronous, two) == asynchronous
    # no loaded Mamba states: the connector goes
    connector = ServingMode(num_draft_tokens=4, external_hits=True, async_loads=True)
    assert mode_for_layout(connector, two) == ServingMode(num_draft_tokens=2)


def test_varying_proposals_by_hand() -> None:
    digest = hashlib.sha256(b"propose:r0:9").digest()
    assert proposed_drafts("r0", 9, 4) == int.from_bytes(digest[:4], "big") % 5
    assert proposed_drafts("r0", 9, 0) == 0
    state = RequestState(RequestInput("r0", tuple(range(8))), tuple(range(100, 108)))
    state.num_generated, state.num_computed_tokens = 2, 9  # decoding position 9
    calls = []

    class Engine:
        def set_in_flight(self, *args) -> None:
            calls.append(args)

    layout = _mamba_layout(4)
    varying = Drafts(Engine(), layout, 4, varying=True).propose(state, 1, 64)
    assert varying == proposed_drafts("r0", 9, 4)  # 5 outputs left: room 5
    assert Drafts(Engine(), layout, 4).propose(state, 1, 64) == 4
    assert Drafts(Engine(), _mamba_layout(1), 4).propose(state, 1, 64) == 1  # k of Mamba


def test_drafts_count_with_mamba_only_with_speculative_blocks() -> None:
    mode = ServingMode(num_draft_tokens=3)
    assert "drafts" in features(_mamba_layout(2), mode)
    assert "drafts" not in features(_mamba_layout(0), mode)


def test_drafts_on_mamba_need_the_mamba_modes_setting() -> None:
    pair = ("drafts", "mamba")
    plain = Declared(frozenset({"retention"}), True, None)
    assert pair_status(pair, {}, plain) == "excluded: no 'mamba_modes' production setting"
    full = Declared(frozenset({"retention", "mamba_modes"}), True, None)
    assert pair_status(pair, {}, full) == "MISSED"
    assert pair_status(pair, {pair: 2}, full) == "reached 2"


def test_state_writes_of_a_draft_step_by_hand() -> None:
    # the module docstring's example: bs 4, k 2, a decode at 6 with 2 drafts: end 9,
    # running column 2 (state at 7), draft states at 8 and 9 in columns 3 and 4
    layout = _mamba_layout(2)
    spec = layout.groups[1].spec
    row = (0, 11, 12, 13, 14)
    assert step_state_writes(layout, spec, row, 6, 9, 2) == [
        StateWrite(12, 7),
        StateWrite(13, 8),
        StateWrite(14, 9),
    ]
    # one draft accepted: computed 8 >= running 7: the state at 8 is copied to column 1
    assert settle_copy(spec, row, 7, 8) == StateWrite(11, 8)
    assert settle_copy(spec, row, 7, 7) is None  # floor(7 / 4) * 4 = 4 < 7
    # a chunk without drafts writes its end state only
    assert step_state_writes(layout, spec, row, 0, 8, 0) == [StateWrite(11, 8)]


def test_a_prefill_checkpoint_is_written_into_the_reserved_column() -> None:
    # bs 4, alignment 1, one group (A = H = 4): the chunk [0, 10) writes the state at 8
    # into column cdiv(10, 4) - 2 = 1
    layout = KVCacheLayout(
        (
            KVCacheGroup(
                ("m",),
                MambaSpec(
                    block_size=4, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1
                ),
            ),
        ),
        num_blocks=8,
        max_model_len=32,
    )
    spec = layout.groups[0].spec
    writes = step_state_writes(layout, spec, (0, 5, 6), 0, 10, 0)
    assert writes == [StateWrite(6, 10), StateWrite(5, 8)]


class _MeetsAtTheSecondStep(ReferenceEngine):
    """The reference, but a known divergence is met at its second step."""

    steps = 0

    def new_step(self) -> None:
        type(self).steps += 1
        if type(self).steps == 2:
            raise KnownDivergenceMet("divergence-x", "met")
        super().new_step()


def test_an_example_meeting_a_divergence_at_run_time_is_not_one() -> None:
    layout = _mamba_layout(0)
    engine = EngineUnderTest(name="meets", factory=_MeetsAtTheSecondStep)
    ops = (Arrive("r0", tuple(range(6)), (1, 2)), Step(64), Step(64), Step(64))
    outcome = TierOutcome("medium")
    seen = []

    @settings(max_examples=1, database=None, suppress_health_check=list(HealthCheck))
    @given(st.just(0))
    def example(_: int) -> None:
        _MeetsAtTheSecondStep.steps = 0
        seen.append(1)
        _run_trace(CheckConfig(level="exact"), layout, ServingMode(), ops, engine, outcome)

    # every try rejects its example: Hypothesis reports that none was valid (not a
    # failure of the trace: outcome.trace stays None)
    try:
        example()
    except Exception as exc:  # noqa: BLE001
        assert type(exc).__name__ in ("Unsatisfiable", "FailedHealthCheck"), exc
    assert seen and outcome.trace is None and outcome.examples == 0
