"""Serving modes: the attention property's connector modes, the deployed mode
(:data:`PRODUCTION_MODE`), swarm testing of the modes (:func:`swarm_modes`) and what a
layout leaves of a mode (:func:`mode_for_layout`).

Example: a swarm draw of ``drafts``, gate, 3 drafts, connector level 3 is
``ServingMode(admission_gate=True, num_draft_tokens=3, external_hits=True,
async_loads=True, load_failures=True)``; on a layout with a Mamba group it loses its
connector and keeps at most as many drafts as the group has speculative blocks.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from properties.core.modes import ServingMode
from reference.layout import KVCacheLayout, draft_token_limit
from reference.specs import MambaSpec


def connector_modes() -> st.SearchStrategy[ServingMode]:
    """The attention property's modes: synchronous scheduling without a KV connector, or
    with one over the host tier, loading synchronously or asynchronously, asynchronous
    loads failing at times (the content that goes out to the tier and comes back, and
    blocks of a failed load that must not be read, are then checked through attention
    outputs;
    asynchronous scheduling and drafts are not drawn there: their pending tokens are not
    known when a step is planned); shrinks toward no connector."""
    return st.sampled_from(
        (
            ServingMode(),
            ServingMode(external_hits=True),
            ServingMode(external_hits=True, async_loads=True, load_failures=True),
        )
    )


#: The serving mode of a deployed vLLM 0.33 (``--preset`` runs of the production
#: property): asynchronous scheduling, admission gate on (``scheduler_reserve_full_isl``).
PRODUCTION_MODE = ServingMode(async_scheduling=True, admission_gate=True)


#: The scheduling feature of a swarm mode: synchronous, asynchronous, or synchronous with
#: draft tokens, ``k`` of them at each step (MTP, EAGLE) or a number varying by step
#: (suffix and n-gram decoding: ``varying_drafts``) (drafts with asynchronous scheduling
#: are not modelled, so these are levels of one feature rather than switches that would
#: cancel each other); listed with repeats so that asynchronous scheduling and drafts
#: come with two examples in five each (a derandomized stream draws the first entry, its
#: shrink target, more often).
SCHEDULING: tuple[str, ...] = ("sync", "async", "drafts", "async", "varying drafts")


#: The connector feature of a swarm mode, by level: 0 none, 1 external hits loaded
#: synchronously, 2 loaded asynchronously, 3 asynchronous loads that may fail (each level
#: needs the one before it); failing loads in a third of the draws.
CONNECTOR_LEVELS: tuple[int, ...] = (0, 1, 2, 3, 3, 2)


def swarm_modes() -> st.SearchStrategy[ServingMode]:
    """Swarm testing of the serving modes, at every tier (the small tier's production
    property and the large tiers): each feature is drawn independently of the others,
    scheduling (:data:`SCHEDULING`), the admission gate (half), the draft count (2, 3 or
    4, used with ``drafts``) and the connector level (:data:`CONNECTOR_LEVELS`).
    Features that need one another are levels of one draw, so no switch is wasted: load
    failures come with a third of the examples, drafts with external hits with a third.
    Shrinks toward the synchronous, ungated mode without a connector. Example:
    ``drafts``, gate, 3, level 3 -> ``ServingMode(admission_gate=True,
    num_draft_tokens=3, external_hits=True, async_loads=True, load_failures=True)``."""
    return st.builds(
        _levelled_mode,
        st.sampled_from(SCHEDULING),
        st.booleans(),
        st.sampled_from((2, 3, 4)),
        st.sampled_from(CONNECTOR_LEVELS),
    )


def _levelled_mode(scheduling: str, gate: bool, drafts: int, connector: int) -> ServingMode:
    """The mode of one swarm draw (:func:`swarm_modes`); connector levels count up:
    ``connector >= 1`` external hits, ``>= 2`` asynchronous loads, ``3`` failures."""
    return _valid_mode(
        scheduling == "async",
        gate,
        drafts if scheduling.endswith("drafts") else 0,
        connector >= 1,
        connector >= 2,
        connector >= 3,
        scheduling == "varying drafts",
    )


def _valid_mode(
    async_scheduling: bool,
    gate: bool,
    drafts: int,
    external: bool,
    loads: bool,
    fails: bool,
    varying: bool = False,
) -> ServingMode:
    loads = loads and external
    drafts = 0 if async_scheduling else drafts
    return ServingMode(
        async_scheduling=async_scheduling,
        admission_gate=gate,
        num_draft_tokens=drafts,
        external_hits=external,
        async_loads=loads,
        load_failures=fails and loads,
        varying_drafts=varying and drafts > 0,
    )


def mode_for_layout(mode: ServingMode, layout: KVCacheLayout) -> ServingMode:
    """``mode`` as a layout with a Mamba group runs it: no KV connector (loaded Mamba
    states are not modelled), drafts at most the group's speculative blocks ``k``
    (:func:`reference.layout.draft_token_limit`: vLLM sizes them by the speculative token
    count), and drafts where it has some: vLLM builds speculative blocks only for a
    speculative decoder, so a synchronous mode without drafts gets ``k`` varying drafts
    (the suffix-decoding proposer, whose draft count changes step by step: vLLM issue
    39271's scenario). Examples: 3 drafts on full + Mamba with 2 speculative blocks -> 2
    drafts; with none -> no drafts; the synchronous mode with 4 speculative blocks -> 4
    varying drafts; asynchronous scheduling keeps no drafts."""
    if not any(isinstance(s, MambaSpec) for s in layout.specs):
        return mode
    limit = draft_token_limit(layout) or 0
    drafts = min(mode.num_draft_tokens, limit)
    varying = mode.varying_drafts and drafts > 0
    if limit and not drafts and not mode.async_scheduling:
        drafts, varying = limit, True
    return dataclasses.replace(
        mode,
        num_draft_tokens=drafts,
        varying_drafts=varying,
        external_hits=False,
        async_loads=False,
        load_failures=False,
    )
