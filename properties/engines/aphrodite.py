"""Aphrodite 0.24.1 adapter: Aphrodite's own copy of vLLM's v1 ``KVCacheManager``.

Aphrodite is a serving engine forked from vLLM; it ships the v1 cache manager under
``aphrodite/v1/core/`` (block pool, coordinator, single-type managers, request-level
manager, scheduler), diverged since the fork. The adapter is the vLLM adapter
(:class:`properties.engines.vllm.VLLMEngine`) over Aphrodite's package: every name it
imports lives at the same path under ``aphrodite`` (:data:`APHRODITE_API`), and the
calls, the KV event audit, the stats and usage checks, the serving modes and the
optional capabilities are the vLLM adapter's, unchanged. Run it with the interpreter of
``.engines/aphrodite`` (``bash ci/engines/aphrodite`` builds it); Aphrodite is imported
lazily inside :func:`make_engine`.

Where Aphrodite's API differs from vLLM 0.33's (``docs/aphrodite-behaviour.md``)
-------------------------------------------------------------------------------
* No lookahead hashes: ``KVCacheManager`` and ``get_request_block_hasher`` take no
  ``num_hash_lookahead_tokens`` (vLLM added them after the fork). A layout with
  lookahead hashes raises :class:`UnsupportedLayoutError`, and the factory's divergence
  ``aphrodite-no-lookahead-hashes`` keeps such layouts from being drawn.
* ``get_computed_blocks(request)`` takes no hit bound (vLLM's optional
  ``max_cache_hit_length``); the adapter's "full" report-mode requests look up with
  Aphrodite's fixed bound ``num_tokens - 1``, the value vLLM's adapter passes.

Every other difference is behaviour, declared below as a known divergence with its
finding (``findings/aphrodite/``) when it breaks a property of vLLM 0.33's policy.
"""

from __future__ import annotations

import os

from properties.core.engine import KnownDivergence
from properties.core.modes import PRODUCTION_SETTINGS, ServingMode
from properties.engines.vllm import (
    V1CoreAPI,
    VLLMEngine,
    _chunk_not_multiple_of_block,
    _import_vllm,
)
from reference.layout import KVCacheLayout
from reference.specs import MambaSpec, SlidingWindowSpec

#: Aphrodite 0.24.1's v1 core, as the vLLM adapter imports it.
APHRODITE_API = V1CoreAPI(
    root="aphrodite",
    label="aphrodite",
    release="Aphrodite 0.24.1",
    lookahead_hashes=False,
    lookup_bound=False,
)
# Aphrodite logs at INFO while it imports (Triton missing on CPU); anything may import it
# first (``--engine-coverage`` finds its modules before the adapter builds an engine).
os.environ.setdefault("APHRODITE_LOGGING_LEVEL", "ERROR")


class AphroditeEngine(VLLMEngine):
    """Aphrodite's ``KVCacheManager`` driven through the engine protocol (the vLLM
    adapter's calls, Aphrodite's classes)."""

    name = "aphrodite"


def make_engine(layout: KVCacheLayout) -> AphroditeEngine:
    """Build an :class:`AphroditeEngine` for ``layout`` (Aphrodite is imported here)."""
    return AphroditeEngine(layout, _import_vllm(APHRODITE_API))


def _lookahead_hashes(layout: KVCacheLayout) -> bool:
    return layout.num_hash_lookahead_tokens > 0


def _has_mamba(layout: KVCacheLayout) -> bool:
    return any(isinstance(g.spec, MambaSpec) for g in layout.groups)


def _asynchronous(mode: ServingMode) -> bool:
    return mode.async_scheduling


def _eagle_hybrid(layout: KVCacheLayout) -> bool:
    """EAGLE in a hybrid coordinator (two or more groups, caching on): Aphrodite bounds
    the EAGLE group's extra block by the lookup bound, vLLM 0.33 by the hashed length."""
    return layout.enable_caching and layout.use_eagle and len(layout.groups) > 1


def _eagle_sparse_window(layout: KVCacheLayout) -> bool:
    """EAGLE with sparse or interval retention and a sliding-window or Mamba group (the
    groups retention thins out)."""
    return (
        layout.enable_caching
        and layout.use_eagle
        and layout.prefix_cache_retention_interval is not None
        and any(isinstance(g.spec, (SlidingWindowSpec, MambaSpec)) for g in layout.groups)
    )


#: Aphrodite 0.24.1 behaviours that break a property of vLLM 0.33's policy, and the one
#: vLLM feature it lacks; see findings/aphrodite/ and docs/aphrodite-behaviour.md.
KNOWN_DIVERGENCES = (
    KnownDivergence(
        name="aphrodite-no-lookahead-hashes",
        summary="Aphrodite 0.24.1 has no lookahead hashes (vLLM 0.33's "
        "num_hash_lookahead_tokens, added after the fork): such layouts cannot be built",
        finding="docs/aphrodite-behaviour.md",
        applies=_lookahead_hashes,
        features=("lookahead-hashes",),
    ),
    KnownDivergence(
        name="aphrodite-eagle-sparse-retention-no-hit",
        summary="EAGLE with sparse retention (Aphrodite's default interval 0) keeps the "
        "sliding-window tail ending on prompt - 1, not the positions an EAGLE hit drops "
        "back to: a resend of the same prompt never hits",
        finding="findings/aphrodite/eagle-sparse-retention-no-hit.md",
        applies=_eagle_sparse_window,
    ),
    KnownDivergence(
        name="aphrodite-eagle-hybrid-bounded-margin",
        summary="hybrid models with EAGLE: the extra block an EAGLE group matches and "
        "drops is bounded by num_tokens - 1 (vLLM 0.33: by the hashed tokens), so a "
        "block-aligned prompt's resend hits one block less",
        finding="docs/aphrodite-behaviour.md",
        applies=_eagle_hybrid,
    ),
    KnownDivergence(
        name="aphrodite-mamba-async-state-leak",
        summary="Mamba 'align' groups under asynchronous scheduling (Aphrodite's default): "
        "the state block of every prefill chunk but the last two stays held until the "
        "request ends (the skip walk stops at the first null gap)",
        finding="findings/aphrodite/mamba-async-state-leak.md",
        applies=_has_mamba,
        modes=_asynchronous,
        features=("async", "mamba"),
    ),
    KnownDivergence(
        name="aphrodite-chunked-hit-in-previous-chunk",
        summary="chunked-local hit lands in the previous chunk with its tokens nulled "
        "when attention_chunk_size % block_size != 0 (vLLM 0.33's bug, in the fork too)",
        finding="findings/aphrodite/chunked-hit-in-previous-chunk.md",
        applies=_chunk_not_multiple_of_block,
    ),
)
make_engine.known_divergences = KNOWN_DIVERGENCES  # type: ignore[attr-defined]
#: The adapter bridges the production layout settings of retention, EAGLE, caps and
#: external hits; lookahead hashes are left out by a divergence. Not ``mamba_modes``:
#: the fork's allocate_slots asserts on a Mamba group with a prefill checkpoint block
#: (reach case grown-7-5: align mode, one checkpoint block, beside full and chunked
#: groups), not yet written up as a finding, so those settings are not drawn for it.
make_engine.production_settings = PRODUCTION_SETTINGS - {"mamba_modes"}  # type: ignore[attr-defined]
#: Aphrodite's cache-manager modules the adapter drives (``--engine-coverage``).
make_engine.coverage_modules = (  # type: ignore[attr-defined]
    "aphrodite.v1.core.kv_cache_manager",
    "aphrodite.v1.core.kv_cache_coordinator",
    "aphrodite.v1.core.single_type_kv_cache_manager",
    "aphrodite.v1.core.block_pool",
    "aphrodite.v1.core.kv_cache_utils",
)
