"""The large tiers' workloads: their layouts (:func:`workload_layouts`) and trace bodies
(:func:`tier_operations`): online (bulk arrivals, aborts, preemptions and resets between
steps) or offline (:func:`offline_operations`: one batch at once, then steps only).

Example: 3 alike requests of 200-token prompts and 4 output tokens, budget 2048 ->
``Arrive`` x 3, then 1 + 4 + 1 = 6 ``Step(2048, 0)`` (:func:`offline_batch`).
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from properties.core.constants import SPEC_KINDS
from properties.core.trace import Abort, Operation, Preempt, ResetPrefixCache, Step
from properties.generate.strategies.arrivals import prefix_pools
from properties.generate.strategies.bulk import BATCH_ONE_IN, OFFLINE_OUTPUT, bulk_arrivals
from properties.generate.strategies.generated_layouts import (
    PRESET_BLOCK_SIZES,
    preset_layouts,
    presets_of_kinds,
)
from properties.generate.strategies.swarm import swarm_layouts
from properties.generate.strategies.tiers import OFFLINE_WORKLOAD, ScaleTier
from properties.generate.strategies.trace_bodies import lookaheads
from properties.generate.strategies.vocabulary import _seeds
from reference.layout import KVCacheLayout

_TIER_OPS = ("step", "step", "step", "step", "arrive", "abort", "preempt", "reset_prefix_cache")


@st.composite
def tier_operations(draw, layout: KVCacheLayout, scale: ScaleTier) -> tuple[Operation, ...]:
    """A trace body of a large tier: a bulk arrival (:func:`bulk_arrivals`; one in
    ``BATCH_ONE_IN`` a batch of requests alike) of up to ``max_requests`` requests,
    then up to ``max_steps`` operations: steps with a budget from ``token_budgets``
    (most), more bulk arrivals while the request bound allows, aborts and preemptions of
    live requests, prefix-cache resets. A few dozen operations move thousands of blocks.
    Passes :func:`properties.core.trace.validate_references`. A tier whose workload is
    ``"offline"`` draws :func:`offline_operations` instead."""
    if scale.workload == OFFLINE_WORKLOAD:
        return draw(offline_operations(layout, scale))
    budgets = scale.token_budgets or (layout.max_model_len,)
    pool = draw(prefix_pools(layout))
    first = draw(st.integers(1, scale.max_requests))
    batch = draw(st.integers(0, BATCH_ONE_IN - 1)) == 0
    ops: list[Operation] = list(bulk_arrivals(layout, pool, 0, first, draw(_seeds), batch))
    arrived = first
    live = [op.request_id for op in ops]
    steps = lookaheads(layout)
    for _ in range(draw(st.integers(1, scale.max_steps))):
        kind = draw(st.sampled_from(_TIER_OPS))
        if kind == "arrive" and arrived < scale.max_requests:
            more = draw(st.integers(1, max(1, (scale.max_requests - arrived + 3) // 4)))
            batch = draw(st.integers(0, BATCH_ONE_IN - 1)) == 0
            new = bulk_arrivals(layout, pool, arrived, more, draw(_seeds), batch)
            ops.extend(new)
            arrived += len(new)
            live.extend(op.request_id for op in new)
        elif kind in ("abort", "preempt") and live:
            request_id = live[draw(st.integers(0, len(live) - 1))]
            if kind == "abort":
                live.remove(request_id)
                ops.append(Abort(request_id))
            else:
                ops.append(Preempt(request_id))
        elif kind == "reset_prefix_cache":
            ops.append(ResetPrefixCache())
        else:
            ops.append(Step(draw(st.sampled_from(budgets)), draw(steps)))
    return tuple(ops)


def offline_layouts(
    scale: ScaleTier, kinds: Sequence[str] = SPEC_KINDS
) -> st.SearchStrategy[KVCacheLayout]:
    """The layouts of an offline tier: a served model (a preset made of ``kinds``,
    :func:`preset_layouts` with the retention its family is served with, windows scaled
    to a few blocks) within the tier's bounds, three times in four; else, and always when
    no preset is made of ``kinds``, :func:`swarm_layouts`. Example: gpt-oss at block size
    8, its window of 128 scaled to 32, ``max_model_len`` up to 8192, 256..4096 blocks."""
    swarm = swarm_layouts(scale, kinds)
    names = presets_of_kinds(kinds)
    if not names:
        return swarm
    served = preset_layouts(
        names=names,
        max_len=scale.max_len,
        min_blocks=scale.min_blocks,
        max_blocks=scale.max_blocks,
        served=True,
        block_sizes=scale.block_sizes or PRESET_BLOCK_SIZES,
    )
    return st.one_of(served, served, served, swarm)


def workload_layouts(
    scale: ScaleTier, kinds: Sequence[str] = SPEC_KINDS
) -> st.SearchStrategy[KVCacheLayout]:
    """The layouts of a large tier, by its workload: :func:`swarm_layouts` (online) or
    :func:`offline_layouts` (offline), made of ``kinds``."""
    if scale.workload == OFFLINE_WORKLOAD:
        return offline_layouts(scale, kinds)
    return swarm_layouts(scale, kinds)


@st.composite
def offline_operations(draw, layout: KVCacheLayout, scale: ScaleTier) -> tuple[Operation, ...]:
    """A trace body of an offline batch (a list of prompts handed to the engine at once, as
    vLLM's ``LLM.generate`` does): :func:`offline_batch` of a drawn prefix pool, request
    count (up to ``max_requests``), kind of batch (alike one time in two), seed, token
    budget (from ``token_budgets``; one time in two raised to hold every prompt at once,
    an offline run's large ``max_num_batched_tokens``); no lookahead slots (the swarm
    mode's drafts speculate on their own)."""
    budgets = scale.token_budgets or (layout.max_model_len,)
    pool = draw(prefix_pools(layout))
    count = draw(st.integers(1, scale.max_requests))
    alike = draw(st.booleans())
    seed = draw(_seeds)
    budget = draw(st.sampled_from(budgets))
    whole = draw(st.booleans())
    return offline_batch(layout, scale, pool, count, alike, seed, budget, whole)


def offline_batch(
    layout: KVCacheLayout,
    scale: ScaleTier,
    prefix_pool: Sequence[tuple[int, ...]],
    count: int,
    alike: bool,
    seed: int,
    budget: int,
    whole: bool,
) -> tuple[Operation, ...]:
    """One bulk arrival of ``count`` requests made from ``seed`` (``alike``: a batch of
    requests alike, :func:`batch_arrivals`, on a layout with windows or chunks documents
    longer than the widest; else :func:`bulk_arrivals`' mix, prompts may start with a cut
    of a pool prefix), then steps only, all ``Step(budget, 0)``: as many as the
    batch needs to finish when nothing is preempted (its prompt tokens over the budget,
    plus the longest output, plus one), at most ``scale.max_steps``. ``whole`` raises the
    budget to hold every prompt, so the whole batch is prefilled in one step and then
    decodes in lock step: every request crosses its block boundaries and drops its window
    blocks in the same steps (the engine's uniform and many-item decode paths).
    Example: 3 alike requests of 200-token prompts and 4 output tokens, budget 2048 ->
    ``Arrive`` x 3, then 1 + 4 + 1 = 6 ``Step(2048, 0)``."""
    ops: list[Operation] = list(
        bulk_arrivals(layout, prefix_pool, 0, count, seed, alike, True, OFFLINE_OUTPUT)
    )
    prompt_tokens = sum(len(op.prompt) for op in ops)
    if whole:
        budget = max(budget, prompt_tokens)
    longest_output = max(len(op.output) for op in ops)
    steps = min(scale.max_steps, -(-prompt_tokens // budget) + longest_output + 1)
    ops.extend(Step(budget, 0) for _ in range(steps))
    return tuple(ops)
