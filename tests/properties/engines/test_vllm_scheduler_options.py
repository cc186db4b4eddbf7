"""The scheduler level with vLLM's scheduler options (``SchedulerOptions``): priority
scheduling, a LoRA limit, pause states, the long-prefill threshold, the prefill cadence.

Run with ``.engines/vllm/bin/python -m pytest tests/properties/engines/
test_vllm_scheduler_options.py`` (``conftest.py`` skips the module without vLLM). Tables
are derived by hand in each docstring; priorities come from
:func:`properties.core.scheduler_options.request_priority`: ``r0`` has 2 (served last),
``r1`` 0 (served first).

The layout of every trace: one full-attention group, block size 2, ``max_model_len``
16; ``NB`` blocks (block 0 is the null block, so ``NB - 1`` usable).
"""

from __future__ import annotations

import pytest

from properties.core.scheduler_options import SchedulerOptions, request_priority
from properties.core.trace import Arrive, Step, Trace
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec

pytestmark = pytest.mark.engine

PRIORITY = SchedulerOptions(policy="priority")


def _layout(num_blocks: int) -> KVCacheLayout:
    spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=8)
    return KVCacheLayout(
        groups=(KVCacheGroup(("l0",), spec),), num_blocks=num_blocks, max_model_len=16
    )


def _run(
    layout: KVCacheLayout, ops: tuple, options: SchedulerOptions, mutant: str | None = None
) -> list[tuple]:
    """vLLM's harness and the reference on its decisions, side by side: per step the
    decisions (``describe()``), block tables, computed tokens and free blocks, checked
    equal on both sides after every operation."""
    from properties.core.modes import ServingMode
    from properties.engines.reference import make_engine
    from properties.engines.vllm_scheduler import make_harness
    from properties.runner.decided import compare_views, decided_scheduler, reference_view

    if mutant is None:
        h = make_harness(layout, options=options)
    else:
        from properties.mutants.vllm_scheduler_mutants import mutant_class

        h = make_harness(layout, options=options, scheduler_class=mutant_class(mutant))
    ref = decided_scheduler(make_engine(layout), layout, ServingMode())
    steps = []
    for op in ops:
        if isinstance(op, Arrive):
            h.arrive(op)
            ref.arrive(op)
            continue
        d = h.step(op.token_budget)
        ref.step_as(d, op.token_budget)
        view = h.view()
        compare_views(view, reference_view(ref), d.describe())
        steps.append((d.describe(), view.block_ids, view.num_computed_tokens, view.num_free_blocks))
    return steps


def test_the_priorities_the_hand_tables_assume() -> None:
    assert (request_priority("r0"), request_priority("r1")) == (2, 0)


def _prompt_ops(r0_prompt: int) -> tuple:
    return (
        Arrive("r0", tuple(range(1, r0_prompt + 1)), (5, 6, 7, 8, 9, 10)),
        Step(16),
        Arrive("r1", (4, 3, 2, 1), (1, 1, 1, 1, 1, 1)),
        Step(16),
        Step(16),
        Step(16),
    )


def test_priority_preempts_a_request_it_scheduled_earlier_in_the_step() -> None:
    """NB 6 (5 usable). Step 1: ``r0`` (prompt 4) alone: blocks (1, 2), 3 free. Step 2:
    ``r0`` decodes position 4 (block 3); ``r1`` (priority 0) is admitted, 4 tokens in
    (4, 5); 0 free. Step 3: the running list is [r0, r1]. ``r0`` at position 5 fits
    block 3 and is scheduled first; ``r1`` at position 4 needs a block and none is free.
    The victim is the running request of the largest (priority, arrival): ``r0`` (2),
    scheduled already in this step: it leaves the step (its token goes back to the
    budget) and its blocks go back tail first (3: not full, to the front; 2, 1: cached);
    ``r1`` takes block 3: (4, 5, 3), 2 free; ``r0`` waits with 0 computed tokens.
    Step 4: ``r1`` decodes position 5 in block 3; ``r0`` (6 tokens: hit 4 in blocks 1,
    2) needs one more block: the free ones are 2 and 1 themselves, so it waits."""
    steps = _run(_layout(6), _prompt_ops(4), PRIORITY)
    assert steps[:4] == [
        ("r0+4@0", {"r0": ((1, 2),)}, {"r0": 4}, 3),
        ("r0+1@4 r1+4@0", {"r0": ((1, 2, 3),), "r1": ((4, 5),)}, {"r0": 5, "r1": 4}, 0),
        ("r1+1@4; preempted r0", {"r0": ((),), "r1": ((4, 5, 3),)}, {"r0": 0, "r1": 5}, 2),
        ("r1+1@5", {"r0": ((),), "r1": ((4, 5, 3),)}, {"r0": 0, "r1": 6}, 2),
    ]


def test_the_priority_victim_frees_late_mutant_is_caught() -> None:
    """The mutant keeps r0's blocks (scheduled in step 3, then the victim) until the end
    of the step: r1's allocation still fails and r1 preempts itself too."""
    from properties.runner.decided import DecisionMismatch

    with pytest.raises(DecisionMismatch, match="preempted r0, r1"):
        _run(_layout(6), _prompt_ops(4), PRIORITY, "priority-victim-frees-late")


def test_priority_self_preemption_goes_on_to_the_next_running_request() -> None:
    """NB 6. Step 1: ``r0`` (prompt 5): blocks (1, 2, 3), 2 free. Step 2: ``r0`` at
    position 5 (block 3); ``r1`` admitted in (4, 5); 0 free. Step 3: ``r0`` at position 6
    needs a block; the victim is ``r0`` itself (priority 2): its blocks go back (3, 2, 1,
    all full and cached), and vLLM goes on with ``r1`` (FCFS would stop): position 4
    takes block 3 (the front of the free queue): (4, 5, 3), 2 free."""
    steps = _run(_layout(6), _prompt_ops(5), PRIORITY)
    assert steps[2] == (
        "r1+1@4; preempted r0",
        {"r0": ((),), "r1": ((4, 5, 3),)},
        {"r0": 0, "r1": 5},
        2,
    )


def test_fcfs_preempts_the_newest_instead() -> None:
    """The same trace as the first priority test under FCFS: at step 3 ``r1`` (the
    newest) needs a block and is itself the victim (its blocks 5, 4 go back), so
    ``r0`` alone runs; 2 free."""
    steps = _run(_layout(6), _prompt_ops(4), SchedulerOptions())
    blocks = {"r0": ((1, 2, 3),), "r1": ((),)}
    assert steps[2] == ("r0+1@5; preempted r1", blocks, {"r0": 6, "r1": 0}, 2)


def test_a_lora_limit_passes_over_a_waiting_request() -> None:
    """``max_loras=1``, NB 17 (room for all), FCFS. ``r1`` (lora-a), ``r2`` (lora-b),
    ``r3`` (lora-a) arrive, 2 outputs each. Step 1 admits ``r1`` (4 tokens), passes over
    ``r2`` (a second adapter would exceed the limit) and admits ``r3`` (lora-a again):
    ``r1`` (1, 2), ``r3`` (3, 4); ``r2`` waits with no blocks."""
    ops = (
        Arrive("r1", (1, 2, 3, 4), (5, 6), lora_name="lora-a"),
        Arrive("r2", (1, 2, 3, 4), (5, 6), lora_name="lora-b"),
        Arrive("r3", (4, 3, 2, 1), (5, 6), lora_name="lora-a"),
        Step(16),
    )
    steps = _run(_layout(17), ops, SchedulerOptions(max_loras=1))
    assert steps[0][0] == "r1+4@0 r3+4@0"
    assert steps[0][1] == {"r1": ((1, 2),), "r2": ((),), "r3": ((3, 4),)}


def test_pause_states_hold_admission_then_everything() -> None:
    """``pauses``: steps 3, 4 are PAUSED_NEW and step 6 PAUSED_ALL (:func:`pause_state`).
    NB 17. ``r0`` (prompt 4, 5 outputs) runs from step 1; ``r1`` (prompt 4) arrives
    before step 3: not admitted in steps 3 and 4 (``r0`` decodes), admitted in step 5,
    where ``r0`` samples its last output and finishes; in step 6 nothing runs; step 7
    goes on with ``r1``."""
    ops = (
        Arrive("r0", (1, 2, 3, 4), (5, 6, 7, 8, 9)),
        Step(16),
        Step(16),
        Arrive("r1", (4, 3, 2, 1), (1, 1)),
        Step(16),
        Step(16),
        Step(16),
        Step(16),
        Step(16),
    )
    steps = _run(_layout(17), ops, SchedulerOptions(pauses=True))
    assert [s[0] for s in steps] == [
        "r0+4@0",
        "r0+1@4",
        "r0+1@5",
        "r0+1@6",
        "r0+1@7 r1+4@0",
        "nothing scheduled",
        "r1+1@4",
    ]


def test_a_long_prefill_threshold_caps_each_chunk_while_others_wait() -> None:
    """``long_prefill_token_threshold=4``, NB 17: ``r0`` (prompt 10) and ``r1`` (prompt
    6) waiting together: each prefill chunk is at most 4 tokens while both are
    unfinished: step 1 ``r0`` 0+4, ``r1`` 0+4; step 2 ``r0`` 4+4, ``r1`` 4+2; step 3
    ``r0`` 8+2 (its prompt's end), ``r1`` decodes at 6."""
    ops = (
        Arrive("r0", tuple(range(1, 11)), (1, 2)),
        Arrive("r1", (6, 5, 4, 3, 2, 1), (1, 2)),
        Step(16),
        Step(16),
        Step(16),
    )
    steps = _run(_layout(17), ops, SchedulerOptions(long_prefill_token_threshold=4))
    assert [s[0] for s in steps] == ["r0+4@0 r1+4@0", "r0+4@4 r1+2@4", "r0+2@8 r1+1@6"]


def test_option_traces_agree_and_their_options_replay() -> None:
    """A failing search saves the options in the trace's failure; ``run_one`` reads them
    back (``trace_options``)."""
    from properties.tools.scheduler_level import run_one, trace_options

    trace = Trace(
        layout=_layout(6),
        operations=_prompt_ops(4),
        failure={"options": PRIORITY.to_json()},
    )
    assert trace_options(trace) == PRIORITY
    assert run_one(trace) == 4


def test_the_encoder_budget_cuts_a_chunk_before_an_image() -> None:
    """``encoder_budget=8`` (encoder compute budget and cache: 8 tokens), NB 33,
    ``max_model_len`` 32. ``r0``: 2 text tokens, image 3 (8 placeholders), 2 text
    tokens; ``r1``: 2 text tokens, image 2 (5), 2 text tokens. Step 1 (budget 32):
    ``r0``'s 12 tokens with its image use the whole encoder budget, so ``r1``'s chunk
    stops before its image: 2 tokens. ``r0`` blocks 1-6, ``r1`` block 7. After step 1
    ``r0``'s image is computed and freed from the encoder cache; step 2: ``r0`` decodes
    position 12 (block 8), ``r1`` computes its image and the rest, positions 2-8
    (blocks 9-12)."""
    steps = _run(*_image_trace(), SchedulerOptions(encoder_budget=8))
    assert steps[0][:2] == (
        "r0+12@0 r1+2@0",
        {"r0": ((1, 2, 3, 4, 5, 6),), "r1": ((7,),)},
    )
    assert steps[1][:2] == (
        "r0+1@12 r1+7@2",
        {"r0": ((1, 2, 3, 4, 5, 6, 8),), "r1": ((7, 9, 10, 11, 12),)},
    )


def test_the_encoder_cut_after_allocation_mutant_is_caught() -> None:
    """The mutant allocates r1's 9 remaining prompt tokens in step 1 (blocks 7-11)
    although it runs 2: the tables differ."""
    from properties.runner.decided import DecisionMismatch

    with pytest.raises(
        DecisionMismatch,
        match=r"r1's block ids differ: engine \(\(7, 8, 9, 10, 11\),\), reference \(\(7,\),\)",
    ):
        _run(*_image_trace(), SchedulerOptions(encoder_budget=8), "encoder-cut-after-allocation")


def _image_trace() -> tuple:
    from properties.core.images import image_token

    r0 = (1, 2) + tuple(image_token(3, j) for j in range(8)) + (3, 4)
    r1 = (5, 6) + tuple(image_token(2, j) for j in range(5)) + (1, 1)
    layout = KVCacheLayout(groups=_layout(33).groups, num_blocks=33, max_model_len=32)
    ops = (Arrive("r0", r0, (1, 2, 3)), Arrive("r1", r1, (1, 2)), Step(32), Step(32))
    return layout, ops


# -- structured output: grammars compile, fail and reject --------------------------------
GRAMMARS = SchedulerOptions(structured_output=True)


def test_the_grammars_the_tables_assume() -> None:
    from properties.core.scheduler_options import GrammarPlan, grammar_plan

    assert grammar_plan("r0") == GrammarPlan(0, False, 7)
    assert grammar_plan("r1") is None
    assert grammar_plan("r2") == GrammarPlan(2, True, None)


def test_a_rejected_token_ends_the_request_and_frees_its_blocks() -> None:
    """NB 8. ``r0`` (prompt 1-4, outputs 5, 7, 6) has a grammar ready at once that
    rejects token 7. Step 1 prefills it (blocks 1, 2) and samples 5; step 2 decodes
    position 4 (block 3) and samples 7: rejected, ``r0`` ends with an error, its blocks
    go back tail first: 3 (not full) to the front, 2 and 1 to the back: 7 free."""
    ops = (Arrive("r0", (1, 2, 3, 4), (5, 7, 6)), Step(16), Step(16))
    steps = _run(_layout(8), ops, GRAMMARS)
    assert steps[1] == ("r0+1@4", {}, {}, 7)


def test_a_request_waits_for_its_grammar_and_ends_if_it_does_not_compile() -> None:
    """NB 8. ``r2`` (a grammar compiling for 2 steps, which fails) arrives before ``r1``
    (no grammar): steps 1 and 2 pass over ``r2`` and run ``r1``; in step 3 the
    compilation has failed: ``r2`` ends (it never held a block)."""
    ops = (
        Arrive("r2", (1, 2), (3,)),
        Arrive("r1", (3, 4), (5, 6, 7, 8)),
        Step(16),
        Step(16),
        Step(16),
    )
    steps = _run(_layout(8), ops, GRAMMARS)
    assert [s[0] for s in steps] == ["r1+2@0", "r1+1@2", "r1+1@3"]
    assert set(steps[1][1]) == {"r1", "r2"}
    assert set(steps[2][1]) == {"r1"}


def test_the_grammar_error_keeps_blocks_mutant_is_caught() -> None:
    from properties.runner.decided import DecisionMismatch

    ops = (Arrive("r0", (1, 2, 3, 4), (5, 7, 6)), Step(16), Step(16))
    with pytest.raises(DecisionMismatch, match="free blocks differ: engine 4, reference 7"):
        _run(_layout(8), ops, GRAMMARS, "grammar-error-keeps-blocks")


def test_a_remote_image_waits_one_step_for_its_transfer() -> None:
    """``remote_images`` (an encoder-cache connector holds images 0 and 2),
    ``encoder_budget=8``, NB 17. ``r0`` (text, image 0, text) waits in step 1 while its
    image is transferred; step 2 runs its 4 tokens, loading the image (no encoder
    budget). ``r1`` (image 1, computed locally) runs in step 1."""
    from properties.core.images import image_token

    r0 = (1, image_token(0, 0), image_token(0, 1), 3)
    r1 = (image_token(1, 0), image_token(1, 1), image_token(1, 2), 4)
    ops = (Arrive("r0", r0, (5, 6)), Arrive("r1", r1, (5, 6)), Step(16), Step(16))
    steps = _run(_layout(17), ops, SchedulerOptions(encoder_budget=8, remote_images=True))
    assert [s[0] for s in steps] == ["r1+4@0", "r1+1@4 r0+4@0"]
