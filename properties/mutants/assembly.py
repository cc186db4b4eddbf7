"""How a mutant of the reference is built: :func:`mutated_manager` replaces, in a
freshly built :class:`reference.kv_cache_manager.KVCacheManager`, the block pool, some
single-type manager classes or the hybrid coordinator before any call is made, and
:class:`MutantEngine` drives it as the reference engine does.

Example: ``mutant_engine("swa_off_by_one", layout, managers={SlidingWindowManager:
SlidingWindowOffByOne})`` is the reference engine whose sliding-window groups are
managed by ``SlidingWindowOffByOne``; its ``name`` is ``"mutant:swa_off_by_one"``.
"""

from __future__ import annotations

from collections.abc import Mapping

from properties.engines.reference import ReferenceEngine
from reference.block_pool import BlockPool
from reference.coordinator import HybridCoordinator
from reference.kv_cache_manager import KVCacheManager
from reference.layout import KVCacheLayout
from reference.managers import MambaManager, SingleTypeKVCacheManager

ManagerClass = type[SingleTypeKVCacheManager]


class MutantEngine(ReferenceEngine):
    """The reference engine driving a mutated :class:`KVCacheManager`."""

    def __init__(self, layout: KVCacheLayout, manager: KVCacheManager, name: str) -> None:
        super().__init__(layout)
        self.manager = manager
        self.name = f"mutant:{name}"


def mutated_manager(
    layout: KVCacheLayout,
    manager_cls: type[KVCacheManager] = KVCacheManager,
    pool_cls: type[BlockPool] | None = None,
    managers: Mapping[ManagerClass, ManagerClass] | None = None,
    hybrid_coordinator_cls: type[HybridCoordinator] | None = None,
) -> KVCacheManager:
    """A fresh ``manager_cls(layout)`` with its pool, some single-type manager classes
    (``{reference class: mutant class}``) or its hybrid coordinator replaced.

    The hybrid coordinator is replaced only when the layout builds one (caching on,
    several groups); other layouts keep the reference behaviour.
    """
    kv = manager_cls(layout)
    if hybrid_coordinator_cls is not None and isinstance(kv.coordinator, HybridCoordinator):
        kv.coordinator = hybrid_coordinator_cls(layout)
        kv.block_pool = kv.coordinator.block_pool
    coord = kv.coordinator
    if pool_cls is not None:
        pool = pool_cls(layout.num_blocks, layout.enable_caching, layout.hash_block_size)
        coord.block_pool = kv.block_pool = pool
        for m in coord.managers:
            m.block_pool = pool
    if managers:
        replaced = []
        for m in coord.managers:
            r = managers.get(type(m), type(m))(
                m.spec,
                m.block_pool,
                m.group_id,
                m.enable_caching,
                m.cache_hit_alignment,
                m.retention_interval,
                m.scheduler_block_size,
            )
            r.max_admission_blocks = m.max_admission_blocks
            r.use_eagle, r.eagle_replay = m.use_eagle, m.eagle_replay
            if isinstance(m, MambaManager):  # the settings the coordinator gave it
                r.drop_eagle_checkpoint = m.drop_eagle_checkpoint
                r.num_hash_lookahead_tokens = m.num_hash_lookahead_tokens
            replaced.append(r)
        coord.managers = replaced
        if isinstance(coord, HybridCoordinator):
            for sg in coord.spec_groups:
                sg.manager_cls = type(coord.managers[sg.group_ids[0]])
    return kv


def mutant_engine(name: str, layout: KVCacheLayout, **parts) -> MutantEngine:
    """A :class:`MutantEngine` named ``name`` over ``mutated_manager(layout, **parts)``."""
    return MutantEngine(layout, mutated_manager(layout, **parts), name)
