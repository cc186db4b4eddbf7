"""Hypothesis strategies: layouts, prompts and whole traces (docs/spec.md §11), one module
per concern; every name is importable from this package as before the split.

Building blocks, smallest first (each is a ``SearchStrategy``), by module:

==========================  ================================================================
``vocabulary``              ``token_ids()``, ``cache_salts()``, ``lora_names()``: a small
                            vocabulary (``0..VOCAB_SIZE-1``) so that equal content behind
                            different prefixes happens; salts from ``{None, "s1"}``; LoRA
                            names from ``{None, "lora-a"}`` (rare); ``random_tokens``.
``group_specs``             ``windows(bs)`` / ``chunk_sizes(bs)``: sizes in every category of
                            :func:`window_category` (1, smaller than a block, one block, not
                            a multiple, many blocks); ``specs(bs)``: one full /
                            sliding-window / chunked-local / Mamba spec.
``generated_layouts``       ``layouts(...)``: 1 to 6 groups in any order, block sizes 1..32
                            with ``lcm <= 64``, pools from tiny to roomy; always a valid
                            ``KVCacheLayout``, shrinking toward one full-attention group
                            with block size 1. ``preset_layouts(...)``: a model preset
                            (:mod:`properties.generate.presets`) with windows scaled down so
                            that they slide within a short trace.
``targeted``                layouts built to reach particular rules (fine windows, tight
                            pools, unaligned chunks, prefix caching off).
``scenario_mix``            ``any_layouts()``: generated, preset and targeted layouts.
``edges``                   ``edge_layouts()``: layouts at the edges of the hit rules.
``production``              the production property's layouts and the settings drawn on
                            top (EAGLE, retention interval, admission cap).
``mamba_modes``             ``mamba_settings(layout)``: a Mamba layout's caching mode
                            (``CACHE_MODES``), speculative blocks (``SPECULATIVE_BLOCKS``)
                            and prefill checkpoint blocks, drawn on top of a layout.
``modes``                   serving modes: connector modes, ``PRODUCTION_MODE``, swarm
                            modes, ``mode_for_layout``.
``arrivals``                ``prefix_pools(layout)``, ``prompts(layout, pool)``,
                            ``request_inputs(...)``: prompts made of a shared prefix
                            (possibly cut short) plus a random suffix; resends, bursts and
                            reloads of an earlier prompt.
``trace_bodies``            ``token_budgets(layout)``, ``lookaheads(layout)``,
                            ``step_ops(layout)``, ``abort_ops(ids)``, ``preempt_ops(ids)``,
                            ``reset_ops()``: single operations, for the stateful machine's
                            rules; ``operations(layout)``: a whole trace body;
                            ``traces()``: a whole ``Trace``.
``tiers``                   the scale tiers: ``ScaleTier``, ``TIERS``, the tier names,
                            ``tier()``.
``swarm``                   ``swarm_layouts()``: group types and pool pressure switched on
                            independently, at any tier.
``bulk``                    the large tiers' bulk arrivals and batches of requests alike.
``workloads``               the large tiers' layouts and trace bodies, online or offline.
``reuse``                   ``_reused(factory)``: one strategy object per distinct arguments
                            (validated once, drawn thousands of times; same draws).
==========================  ================================================================

Worked example of the block-size rule: sizes ``(16, 4)`` give ``lcm = 16`` and
``gcd = 4``; a Mamba group in that layout gets block size 4 (= hash block size),
so partial prefix hits stay disabled as the layout requires.

``PRESETS``, ``SPEC_KINDS`` and ``FullAttentionSpec`` (defined in
:mod:`properties.generate.presets`, :mod:`properties.core.constants` and
:mod:`reference.specs`) stay readable here for the callers that read them here.
"""

from __future__ import annotations

from properties.core.constants import SPEC_KINDS
from properties.generate.presets import PRESETS
from properties.generate.strategies.arrivals import (
    boundaries,
    burst_ops,
    outputs,
    prefix_pools,
    prompt_lengths,
    prompts,
    reload_ops,
    request_inputs,
    resend_ops,
)
from properties.generate.strategies.bulk import (
    BATCH_ONE_IN,
    BULK_LONG_ONE_IN,
    BULK_OUTPUT,
    BULK_SHORT,
    OFFLINE_OUTPUT,
    _past_the_window,
    _widest_reach,
    batch_arrivals,
    bulk_arrivals,
)
from properties.generate.strategies.edges import edge_case_kinds, edge_layouts
from properties.generate.strategies.generated_layouts import (
    MAX_BLOCK_SIZE,
    MAX_LCM,
    PRESET_BLOCK_SIZES,
    PRESET_ORDER,
    block_size_lists,
    layouts,
    pool_sizes,
    preset_layouts,
    presets_of_kinds,
)
from properties.generate.strategies.group_specs import (
    WINDOW_CATEGORIES,
    _kind_specs,
    chunk_sizes,
    chunked_local_specs,
    full_specs,
    mamba_specs,
    sliding_window_specs,
    specs,
    window_category,
    windows,
)
from properties.generate.strategies.mamba_modes import (
    CACHE_MODES,
    SPECULATIVE_BLOCKS,
    mamba_settings,
)
from properties.generate.strategies.modes import (
    CONNECTOR_LEVELS,
    PRODUCTION_MODE,
    SCHEDULING,
    _levelled_mode,
    _valid_mode,
    connector_modes,
    mode_for_layout,
    swarm_modes,
)
from properties.generate.strategies.production import (
    production_base_layouts,
    production_layouts,
    retention_intervals,
)
from properties.generate.strategies.scenario_mix import any_layouts
from properties.generate.strategies.swarm import _chunks_aligned, swarm_layouts
from properties.generate.strategies.targeted import (
    chunked_layouts,
    small_block_hybrids,
    targeted_layouts,
    tight_pool_layouts,
    uncached_layouts,
)
from properties.generate.strategies.tiers import (
    LARGE_TIERS,
    MEDIUM,
    OFFLINE,
    OFFLINE_WORKLOAD,
    ONLINE,
    PRESET_WINDOWS,
    PRODUCTION,
    SMALL,
    TIER_NAMES,
    TIERS,
    WORKLOADS,
    ScaleTier,
    tier,
)
from properties.generate.strategies.trace_bodies import (
    abort_ops,
    lookaheads,
    operations,
    preempt_ops,
    reset_ops,
    step_ops,
    token_budgets,
    traces,
)
from properties.generate.strategies.vocabulary import (
    VOCAB_SIZE,
    cache_salts,
    lora_names,
    random_tokens,
    token_ids,
)
from properties.generate.strategies.workloads import (
    offline_batch,
    offline_layouts,
    offline_operations,
    tier_operations,
    workload_layouts,
)
from reference.specs import FullAttentionSpec

__all__ = [
    "BATCH_ONE_IN",
    "BULK_LONG_ONE_IN",
    "BULK_OUTPUT",
    "BULK_SHORT",
    "CACHE_MODES",
    "CONNECTOR_LEVELS",
    "LARGE_TIERS",
    "MAX_BLOCK_SIZE",
    "MAX_LCM",
    "MEDIUM",
    "OFFLINE",
    "OFFLINE_OUTPUT",
    "OFFLINE_WORKLOAD",
    "ONLINE",
    "PRESETS",
    "PRESET_BLOCK_SIZES",
    "PRESET_ORDER",
    "PRESET_WINDOWS",
    "PRODUCTION",
    "PRODUCTION_MODE",
    "SCHEDULING",
    "SMALL",
    "SPECULATIVE_BLOCKS",
    "SPEC_KINDS",
    "TIERS",
    "TIER_NAMES",
    "VOCAB_SIZE",
    "WINDOW_CATEGORIES",
    "WORKLOADS",
    "FullAttentionSpec",
    "ScaleTier",
    "_chunks_aligned",
    "_kind_specs",
    "_levelled_mode",
    "_past_the_window",
    "_valid_mode",
    "_widest_reach",
    "abort_ops",
    "any_layouts",
    "batch_arrivals",
    "block_size_lists",
    "boundaries",
    "bulk_arrivals",
    "burst_ops",
    "cache_salts",
    "chunk_sizes",
    "chunked_layouts",
    "chunked_local_specs",
    "connector_modes",
    "edge_case_kinds",
    "edge_layouts",
    "full_specs",
    "layouts",
    "lookaheads",
    "lora_names",
    "mamba_settings",
    "mamba_specs",
    "mode_for_layout",
    "offline_batch",
    "offline_layouts",
    "offline_operations",
    "operations",
    "outputs",
    "pool_sizes",
    "preempt_ops",
    "prefix_pools",
    "preset_layouts",
    "presets_of_kinds",
    "production_base_layouts",
    "production_layouts",
    "prompt_lengths",
    "prompts",
    "random_tokens",
    "reload_ops",
    "request_inputs",
    "resend_ops",
    "reset_ops",
    "retention_intervals",
    "sliding_window_specs",
    "small_block_hybrids",
    "specs",
    "step_ops",
    "swarm_layouts",
    "swarm_modes",
    "targeted_layouts",
    "tier",
    "tier_operations",
    "tight_pool_layouts",
    "token_budgets",
    "token_ids",
    "traces",
    "uncached_layouts",
    "window_category",
    "windows",
    "workload_layouts",
]
