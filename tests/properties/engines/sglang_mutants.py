"""Realistic bugs in SGLang's cache, placed in branches the ci profile did not reach
before the SGLang adapter drove decode allocation, the prefix's SWA lock release and
the allocator's own refusals (issue 19): each must be caught by kvconform's checks.
Test fixtures, not part of the package; they need SGLang (``.engines/sglang``).

* ``decode_mapping``: ``SWATokenToKVPoolAllocator.alloc_decode`` maps a new decode slot
  to the SWA slot after the request's last one (``swa_last_loc + 1``) instead of the one
  the SWA allocator handed out: right inside a page, wrong at a page boundary, where the
  request's new SWA page is whatever page follows its last one (another request's).
* ``swa_release_twice``: ``UnifiedRadixCache.release_swa`` forgets to mark the lock's
  SWA part released (``lock.swa_released = True``), so every later decode step releases
  it again and the SWA lock counts of the prefix go down past the request's own lock.
* ``swa_leaf_kept``: ``SWAComponent._evict_device_next_node``, the SWA eviction walk,
  stops at an unlocked leaf instead of handing it over for eviction (``return None`` for
  ``return x.id``), so an allocation that the SWA pool's free and evictable pages cover
  fails. Reached only once the SWA pool can be the smaller one (the adapter's
  ``swa_full_tokens_ratio``): with equal pools the full walk always frees enough.
* ``extend_page_slack``: ``SWATokenToKVPoolAllocator.alloc_extend`` asks both pools for
  one page more than the extend needs before it allocates, so an extend that exactly
  fits the pages left is refused (``allocation_fits_per_pool``). Its branch, the
  allocator's own refusal, was unreached while the adapter pre-checked SGLang's budget.

HiCache (issue 39; the adapter builds SGLang's host tier for five layouts in six):

* ``load_back_order``: ``FullComponent.build_hicache_transfers`` gathers the host pages
  of a load-back leaf first and forgets to turn them root first (``backed_up.reverse()``
  dropped) while the nodes it names stay root first: a path of two or more host-only
  nodes is loaded with each node's pages swapped, so the request reads another part of
  its prefix (``host_hit_content``, X3).
* ``host_pages_leaked``: ``FullComponent.free_host_values`` drops the host pages of the
  leaves the host tier evicts instead of freeing them (the host allocator never gets them
  back): the host pool loses them (``host_pool_accounting``, X4).
* ``backup_unlocked``: ``UnifiedRadixCache._execute_and_commit_kv_backup`` queues a
  write-through backup without locking the node (``lock_params = None``): until the next
  flush the node can be evicted and its device pages handed to another request, whose KV
  the queued copy then reads (``host_transfers_pinned``, X5).

* ``write_back_dropped``: ``UnifiedRadixCache._evict_components`` treats a write-back
  backup that succeeded as failed (``if written > 0:`` -> ``if written < 0:``) and drops
  the subtree instead of demoting it: the host pages the backup took are no longer any
  node's (``host_pool_accounting``, X4).

Sessions (``--enable-session-radix-cache``, one layout in two):

* ``session_leaf_kept``: ``TreeComponent.discard_deleted_session_leaf`` forgets to
  unindex a session leaf that eviction deleted: SGLang's own idle self-check
  (``sanity_check``, which the adapter deploys) finds the session indexing an
  unreachable leaf, an engine error.

The Mamba component (full + Mamba and full + SWA + Mamba layouts, two in three):

* ``mamba_cow_dropped``: ``MambaComponent.finalize_match_result_in_cache`` gives a
  request that hit a cached state a slot of its own but forgets to record the matched
  state as the slot's copy source (``req.kv.mamba_cow_src_index = None``): the model runs
  the request from a state that is not its prefix's (zeroed, or the slot's previous
  owner's). The request resumes at its hit without its state (``window_liveness``, W3).
* ``mamba_unlock_ledger``: ``MambaComponent.release_component_lock`` drops a state's
  last lock without returning it to the evictable ledger: the state pool loses a slot
  for good (``idle_pool_free_per_pool``, S2, or SGLang's own idle self-check).

Each mutation rewrites one line of the method's source at run time and is applied once
per process, when the factory first builds an engine (:mod:`tests.properties.engines.line_mutants`).

Worked example::

    kvconform check --engine tests.properties.engines.sglang_mutants:make_decode_mapping \\
        --isolation none --level universal --only invariants
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from properties.engines import sglang as adapter
from tests.properties.engines.line_mutants import mutant_factory, mutated_method

#: name -> (module, class, method, the line as SGLang has it, the mutated line)
MUTATIONS = {
    "decode_mapping": (
        "sglang.srt.mem_cache.allocator.swa",
        "SWATokenToKVPoolAllocator",
        "alloc_decode",
        "self.full_to_swa_index_mapping[alloc_full_indices] = alloc_swa_indices",
        "self.full_to_swa_index_mapping[alloc_full_indices] = swa_last_loc + 1",
    ),
    "swa_release_twice": (
        "sglang.srt.mem_cache.unified_radix_cache",
        "UnifiedRadixCache",
        "release_swa",
        "lock.swa_released = True",
        "pass",
    ),
    "swa_leaf_kept": (
        "sglang.srt.mem_cache.unified_cache.components.swa",
        "SWAComponent",
        "_evict_device_next_node",
        "return x.id",
        "return None",
    ),
    "load_back_order": (
        "sglang.srt.mem_cache.unified_cache.components.full",
        "FullComponent",
        "build_hicache_transfers",
        "backed_up.reverse()",
        "pass",
    ),
    "host_pages_leaked": (
        "sglang.srt.mem_cache.unified_cache.components.full",
        "FullComponent",
        "free_host_values",
        "self.cache.host_pool_group.free(host_value, pool=PoolName.KV)",
        "pass",
    ),
    "backup_unlocked": (
        "sglang.srt.mem_cache.unified_radix_cache",
        "UnifiedRadixCache",
        "_execute_and_commit_kv_backup",
        "lock_params = self.inc_lock_ref(node_id).to_dec_params()",
        "lock_params = None",
    ),
    "write_back_dropped": (
        "sglang.srt.mem_cache.unified_radix_cache",
        "UnifiedRadixCache",
        "_evict_components",
        "if written > 0:",
        "if written < 0:",
    ),
    "session_leaf_kept": (
        "sglang.srt.mem_cache.unified_cache.components.base",
        "TreeComponent",
        "discard_deleted_session_leaf",
        "self._unmark_session_leaf(session_id, node)",
        "pass",
    ),
    "mamba_cow_dropped": (
        "sglang.srt.mem_cache.unified_cache.components.mamba",
        "MambaComponent",
        "finalize_match_result_in_cache",
        "req.kv.mamba_cow_src_index = src_index",
        "req.kv.mamba_cow_src_index = None",
    ),
    "mamba_unlock_ledger": (
        "sglang.srt.mem_cache.unified_cache.components.mamba",
        "MambaComponent",
        "release_component_lock",
        "self.tree_core.component_evictable_size_[ct] += vlen",
        "pass",
    ),
    "extend_page_slack": (
        "sglang.srt.mem_cache.allocator.swa",
        "SWATokenToKVPoolAllocator",
        "alloc_extend",
        "if not self.new_pages_available(num_new_pages, num_new_pages):",
        "if not self.new_pages_available(num_new_pages + 1, num_new_pages + 1):",
    ),
}


def mutated(name: str) -> tuple[type, str, Callable]:
    """``(class, method, mutated function)`` for mutant ``name`` (see :data:`MUTATIONS`)."""
    module_name, class_name, method, old, new = MUTATIONS[name]
    owner = getattr(importlib.import_module(module_name), class_name)
    return owner, method, mutated_method(owner, method, old, new, name)


def _factory(name: str, kinds: tuple[str, ...] | None = None) -> Callable:
    """The mutant's factory; ``kinds``: the layout kinds it is drawn on
    (:data:`properties.engines.sglang.LAYOUT_KINDS`, default all, weighted as the
    adapter weights them): the layouts whose SGLang paths the mutated line is on."""
    attributes = ("layout_strategy", "production_settings", "spec_types")
    make = mutant_factory(name, mutated, adapter.make_engine, attributes)
    if kinds is not None:
        make.layout_strategy = lambda: adapter.sglang_layouts(kinds)  # type: ignore[attr-defined]
    return make


#: Mamba mutants are drawn on the layouts with a Mamba group; the SWA walk and SWA
#: allocator mutants on full + SWA (the draws that give them a small SWA pool most often)
MAMBA_KINDS = ("mamba", "swa+mamba")
SWA_KINDS = ("swa",)


make_decode_mapping = _factory("decode_mapping")
make_swa_release_twice = _factory("swa_release_twice")
make_swa_leaf_kept = _factory("swa_leaf_kept", SWA_KINDS)
make_extend_page_slack = _factory("extend_page_slack", SWA_KINDS)
make_load_back_order = _factory("load_back_order")
make_host_pages_leaked = _factory("host_pages_leaked")
make_backup_unlocked = _factory("backup_unlocked")
make_write_back_dropped = _factory("write_back_dropped")
make_session_leaf_kept = _factory("session_leaf_kept")
make_mamba_cow_dropped = _factory("mamba_cow_dropped", MAMBA_KINDS)
make_mamba_unlock_ledger = _factory("mamba_unlock_ledger", MAMBA_KINDS)
