"""Mutant engines: the optimized engine with ONE realistic bug each.

Every mutant is a factory ``make_<name>(layout)`` usable as
``--engine properties.mutants.optimized_mutants:make_<name>``. Each replaces one class of
the optimized engine (a single-type manager, the free queue, the device tables, the data
plane or the compiled decode pass) before any call; the line carrying the bug is marked
``# BUG``.
:data:`OPTIMIZED_MUTANT_INFO` collects what each factory registers next to its class
(:class:`properties.mutants.registry.Registry`): what the bug is, which property of
``kvconform check`` (``invariants`` at ``exact``, or ``attention``) catches it and which
checks fire.

Worked example, ``vectorised_window_off_by_one``: window ``w = 4``, bs 2, a request in
decode at 6 computed tokens. The per-request rule frees the blocks before token
``6 - 4 + 1 = 3`` (block 0); the batched step's vectorised test computes ``6 - 4 = 2``
skipped tokens, finds no block to free and settles the request without calling the
per-request path, so block 0 stays allocated: the free count differs from the reference.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from optimized.control import key_index
from optimized.control.block_pool import NOT_QUEUED, FreeBlockQueue
from optimized.control.compiled_decode import THRESHOLD, LoudPass, compiled_pass, loud_pass
from optimized.control.coordinator import HybridCoordinator
from optimized.control.jit import compiled
from optimized.control.key_index import ArrayKeyIndex
from optimized.control.kv_cache_manager import KVCacheManager
from optimized.control.managers import (
    ChunkedLocalAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from optimized.device.data_plane import DataPlane
from optimized.device.device_tables import DeviceBlockTables
from properties.engines.optimized import OptimizedEngine
from properties.mutants.registry import (
    OPTIMIZED_CATALOGUE,
    MutantInfo,
    Registry,
    collect,
    per_manager,
)
from reference.layout import KVCacheLayout
from reference.specs import SlidingWindowSpec

ManagerClass = type[SingleTypeKVCacheManager]

#: every mutant here is caught at the exact level
REGISTRY = Registry(OPTIMIZED_CATALOGUE)


class OptimizedMutantEngine(OptimizedEngine):
    """The optimized engine with some of its parts replaced (see :func:`mutated`)."""

    def __init__(self, layout: KVCacheLayout, name: str) -> None:
        super().__init__(layout)
        self.name = f"mutant:{name}"


def replace_managers(manager: KVCacheManager, classes: Mapping[ManagerClass, ManagerClass]) -> None:
    """Rebuild the single-type managers whose class is a key of ``classes`` (before any
    call, so no state is lost) and point the hybrid spec groups at the new classes."""
    coord = manager.coordinator
    coord.managers = [
        classes.get(type(m), type(m))(
            m.spec,
            m.block_pool,
            m.group_id,
            m.enable_caching,
            m.cache_hit_alignment,
            manager.max_model_len,
            coord.max_num_reqs,
            m.retention_interval,
            m.scheduler_block_size,
        )
        for m in coord.managers
    ]
    if isinstance(coord, HybridCoordinator):
        for sg in coord.spec_groups:
            sg.manager_cls = type(coord.managers[sg.group_ids[0]])


# ---------------------------------------------------------------------------
# The bugs


class VectorisedWindowOffByOne(SlidingWindowManager):
    """The batched step's window test counts one token too few as out of window."""

    def _skipped_tokens(self, total: np.ndarray) -> np.ndarray:
        assert isinstance(self.spec, SlidingWindowSpec)
        return np.maximum(total - self.spec.sliding_window, 0)  # BUG: + 1 missing


@REGISTRY.mutant(
    "exact",
    ["exact_match"],
    "the batched step's vectorised window test is one token short: an "
    "out-of-window block is not freed",
)
def make_vectorised_window_off_by_one(layout: KVCacheLayout) -> OptimizedMutantEngine:
    engine = OptimizedMutantEngine(layout, "vectorised_window_off_by_one")
    replace_managers(engine.manager, {SlidingWindowManager: VectorisedWindowOffByOne})
    return engine


class _StaleRow:
    """Releasing a finished request's row keeps its leading-null count: the next request
    on that row inherits it (sliding-window and chunked-local managers)."""

    def release_row(self, row: int) -> None:
        leading = int(self.num_leading_null[row])  # type: ignore[attr-defined]
        super().release_row(row)  # type: ignore[misc]
        self.num_leading_null[row] = leading  # BUG: stale state of the old request


@REGISTRY.mutant(
    "exact",
    ["exact_match"],
    "a released block-table row keeps the finished request's leading-null count",
)
def make_stale_row_after_finish(layout: KVCacheLayout) -> OptimizedMutantEngine:
    engine = OptimizedMutantEngine(layout, "stale_row_after_finish")
    replace_managers(
        engine.manager, per_manager(_StaleRow, SlidingWindowManager, ChunkedLocalAttentionManager)
    )
    return engine


class UnlinkedRemoveQueue(FreeBlockQueue):
    """``remove`` (a cached free block touched by a hit) fixes the forward link only."""

    def remove(self, block_id: int) -> None:
        prev = int(self.prev_free[block_id])
        nxt = int(self.next_free[block_id])
        if prev == NOT_QUEUED or nxt == NOT_QUEUED:
            raise ValueError(f"block {block_id} is not in the free queue")
        self.next_free[prev] = nxt
        # BUG: self.prev_free[nxt] = prev is missing
        self.prev_free[block_id] = self.next_free[block_id] = NOT_QUEUED
        self.num_free_blocks -= 1


@REGISTRY.mutant(
    "exact",
    ["exact_match", "free queue is corrupt", "free_queue_contents"],
    "removing a block from the free queue leaves its successor's back link stale",
)
def make_free_queue_remove_unlinked(layout: KVCacheLayout) -> OptimizedMutantEngine:
    engine = OptimizedMutantEngine(layout, "free_queue_remove_unlinked")
    queue = UnlinkedRemoveQueue(layout.num_blocks)
    queue.popleft()  # the null block, as BlockPool does
    engine.manager.block_pool.free_block_queue = queue
    return engine


class SkippingDeviceTables(DeviceBlockTables):
    """The delta upload drops the last changed row when several rows changed."""

    def dirty_rows(self, gid: int) -> np.ndarray:
        rows = super().dirty_rows(gid)
        return rows[:-1] if rows.size > 1 else rows  # BUG: the last changed row is skipped


class SkippingDataPlane(DataPlane):
    tables_cls = SkippingDeviceTables


class _SkippingUploadEngine(OptimizedMutantEngine):
    data_plane_cls = SkippingDataPlane


@REGISTRY.mutant(
    "exact",
    ["attention"],
    "the device block-table delta upload skips one changed row",
    "attention",
)
def make_delta_upload_skips_row(layout: KVCacheLayout) -> OptimizedMutantEngine:
    return _SkippingUploadEngine(layout, "delta_upload_skips_row")


class OffByOneBlockSlotMapping(DataPlane):
    """The slot mapping takes the block of ``pos - 1`` (the previous block at a block's
    first position)."""

    def slot_mapping(self, table, token_rows, positions, bs):
        col = torch.clamp(positions - 1, min=0) // bs  # BUG: should be positions // bs
        return table[token_rows, col].to(torch.int64) * bs + positions % bs


class _OffByOneSlotEngine(OptimizedMutantEngine):
    data_plane_cls = OffByOneBlockSlotMapping


@REGISTRY.mutant(
    "exact",
    ["attention"],
    "the device slot mapping uses the previous block at a block's first position",
    "attention",
)
def make_slot_mapping_off_by_one_block(layout: KVCacheLayout) -> OptimizedMutantEngine:
    return _OffByOneSlotEngine(layout, "slot_mapping_off_by_one_block")


def remove_leaving_a_hole(heads, words, links, block_group, block, group) -> None:
    """:func:`optimized.control.key_index.remove_block` with a deletion that empties the
    slot of a key's last block without shifting the later entries of its probe run back:
    a key placed past the hole (its home taken when it was added) is no longer found."""
    s = key_index._find(heads, words, block_group, words, block, group)
    if s < 0:
        return
    head = heads[s]
    after = links[block, key_index.NEXT]
    if head == block:
        if after < 0:
            heads[s] = key_index.EMPTY  # BUG: no backward shift of the run after the slot
        else:
            heads[s] = after
            links[after, key_index.PREV] = links[block, key_index.PREV]
        return
    before = links[block, key_index.PREV]
    links[before, key_index.NEXT] = after
    if after < 0:
        links[head, key_index.PREV] = before
    else:
        links[after, key_index.PREV] = before


_remove_leaving_a_hole = compiled(remove_leaving_a_hole) or remove_leaving_a_hole


class HoleOnDeleteKeyIndex(ArrayKeyIndex):
    """The key index whose evictions (one block, or a prefill's popped blocks) leave holes
    in the table's probe runs (:func:`remove_leaving_a_hole`)."""

    def remove(self, block: int, group: int) -> None:
        _remove_leaving_a_hole(self.heads, self.words, self.links, self.block_group, block, group)

    def remove_many(self, blocks: np.ndarray, num_cached_tokens: np.ndarray) -> None:
        for block in blocks.tolist():
            group = int(self.block_group[block])
            _remove_leaving_a_hole(
                self.heads, self.words, self.links, self.block_group, block, group
            )
            self.block_group[block] = -1
            num_cached_tokens[block] = 0


@REGISTRY.mutant(
    "exact",
    ["exact_match"],
    "evicting a key from the prefix cache's hash table empties its slot without moving "
    "the later entries of its probe run back: a cached prefix past the hole is missed",
)
def make_key_index_hole_on_delete(layout: KVCacheLayout) -> OptimizedMutantEngine:
    engine = OptimizedMutantEngine(layout, "key_index_hole_on_delete")
    pool = engine.manager.block_pool
    pool.index = HoleOnDeleteKeyIndex(pool.num_blocks, pool.block_group)
    pool.keys_as_words = True
    return engine


class BatchedThresholdMaxManager(KVCacheManager):
    """After a step of many loud items, each row's decode threshold is refreshed to the
    *largest* of its classes' thresholds: a group whose work comes first (a window drop
    before the next block, say) is skipped as quiet at that count."""

    def _least_thresholds(self, rows: np.ndarray) -> np.ndarray:
        managers = self.coordinator.managers
        least = None
        for g in self._class_reps:
            t = managers[g].decode_work_threshold(rows)
            least = t if least is None else np.maximum(least, t)  # BUG: np.minimum
        return least


class _BatchedThresholdMaxEngine(OptimizedMutantEngine):
    manager_cls = BatchedThresholdMaxManager


@REGISTRY.mutant(
    "exact",
    ["exact_match"],
    "after a step of many loud decode items, a row's decode threshold is its classes' "
    "largest, not their least: an earlier group's work is skipped as quiet",
    tier="offline",
)
def make_batched_threshold_max(layout: KVCacheLayout) -> OptimizedMutantEngine:
    return _BatchedThresholdMaxEngine(layout, "batched_threshold_max")


def late_threshold_pass(first, items, *args):
    """The compiled decode pass (its Python form without numba), each applied row's
    decode threshold then set one token later than the pass computed."""
    run = loud_pass if compiled_pass is None else compiled_pass
    result = run(first, items, *args)
    report = args[-1]  # (the pass's last argument: a row of results per item)
    report[first : result[1], THRESHOLD] += 1  # BUG: the row's work at its threshold waits
    return result


@REGISTRY.mutant(
    "exact",
    ["exact_match"],
    "the compiled decode pass sets each loud row's decode threshold one token late: the "
    "next block, window drop or cached block at that count waits a step",
)
def make_compiled_threshold_late(layout: KVCacheLayout) -> OptimizedMutantEngine:
    engine = OptimizedMutantEngine(layout, "compiled_threshold_late")
    manager = engine.manager
    manager._compiled = LoudPass(manager, run=late_threshold_pass)
    return engine


# ---------------------------------------------------------------------------
# Catalogue

#: One mutant's entry (the reference mutants' :class:`MutantInfo`).
OptimizedMutantInfo = MutantInfo
OPTIMIZED_MUTANT_INFO: dict[str, MutantInfo] = collect(REGISTRY)
OPTIMIZED_MUTANTS: dict[str, str] = {
    name: info.target for name, info in OPTIMIZED_MUTANT_INFO.items()
}
