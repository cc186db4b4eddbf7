"""The optimized engine: :class:`optimized.control.kv_cache_manager.KVCacheManager` behind the
engine protocol, with every optional capability of the reference adapter (ref counts, free
queue, cached blocks) plus ``PlansSteps`` (its batched ``schedule_step``),
``CommitsSteps`` (its batched ``commit_step``), ``FreesInBatch`` (its batched
``free_requests``) and
``ExposesDataPlane`` (its device block tables, slot mapping, paged caches and attention,
:class:`optimized.device.data_plane.DataPlane`). ``kvconform check --engine optimized --level
exact`` holds it to the reference call by call.

The data plane runs on CUDA when ``KVCONFORM_DEVICE=cuda`` (or ``cuda:N``) is set and a
GPU is present, on the CPU otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from itertools import takewhile
from operator import attrgetter

from optimized.control import jit
from optimized.control.kv_cache_manager import ComputedBlocks, KVCacheManager
from optimized.control.request import Request, commit_updates, hash_completed_blocks
from optimized.device.data_plane import DataPlane
from properties.core.allocation import Allocation
from properties.core.engine import (
    BlockIds,
    CachedBlock,
    CacheHit,
    EngineError,
    SlotRequest,
    StepUpdate,
    UnsupportedLayoutError,
)
from properties.engines.manager_engine import ManagerEngine
from reference.errors import KVConformError
from reference.layout import KVCacheLayout
from reference.specs import MambaSpec

#: the columns of a batched step's items (read with ``map``: no per-item Python frame)
_REQUEST_ID = attrgetter("request_id")
_NEW_TOKENS = attrgetter("num_new_tokens")
_LOOKAHEAD = attrgetter("num_lookahead_tokens")

#: Environment variable naming the data plane's device (``cpu`` when unset).
DEVICE_ENV = "KVCONFORM_DEVICE"


class OptimizedEngine(ManagerEngine):
    """Drives the optimized manager; keeps the ComputedBlocks of each lookup."""

    name = "optimized"
    manager_cls = KVCacheManager
    data_plane_cls = DataPlane

    def __init__(self, layout: KVCacheLayout) -> None:
        self.layout = layout
        self.manager = self.manager_cls(layout)
        self.requests: dict[str, Request] = {}
        self._hits: dict[str, tuple[CacheHit, ComputedBlocks]] = {}
        self.data_plane: DataPlane | None = None
        #: requests whose last commit completed a block not hashed yet (:meth:`_hash_pending`)
        self._unhashed: list[Request] = []

    def commit_step(self, updates: Sequence[StepUpdate]) -> None:
        """The batched end of a step (``CommitsSteps``): per update, what
        :meth:`set_num_computed_tokens` and :meth:`append_output_tokens` do, except that
        the blocks it completes are hashed by the next call reading hashes
        (:meth:`_hash_pending`)."""
        unknown = commit_updates(self.requests, updates, self._unhashed)
        if unknown is not None:
            raise EngineError(f"optimized: unknown request {unknown!r}")

    def _hash_pending(self) -> None:
        """Hash the blocks the commits since the last call completed, for the requests
        this engine still holds, before a call that reads block hashes (a lookup, an
        allocation, a step). A request removed in between (finished) is not hashed: no
        call reads its hashes again. Example: 4096 requests finishing in the step that
        completes their last block are freed and removed with no hashing at all."""
        pending = self._unhashed
        if pending:
            requests = self.requests
            hash_completed_blocks([r for r in pending if requests.get(r.request_id) is r])
            pending.clear()

    def free_requests(self, request_ids: Sequence[str]) -> None:
        """``free`` of each id in order in one call (``FreesInBatch``,
        :meth:`optimized.control.kv_cache_manager.KVCacheManager.free_requests`); an
        unknown id raises after the ids before it are freed."""
        requests = self.requests
        try:
            known = list(map(requests.__getitem__, request_ids))
        except KeyError:  # free the ids before the unknown one, then its error
            known = list(map(requests.__getitem__, takewhile(requests.__contains__, request_ids)))
            self.manager.free_requests(known)
            self._forget_hits(request_ids[: len(known)])
            self._request(request_ids[len(known)])
            raise  # pragma: no cover - _request raised
        self.manager.free_requests(known)
        self._forget_hits(request_ids)

    def remove_requests(self, request_ids: Sequence[str]) -> None:
        """``remove_request`` of each id in one call (``FreesInBatch``: the scheduler
        forgets the requests it freed together)."""
        pop = self.requests.pop
        for request_id in request_ids:
            pop(request_id, None)
        self._forget_hits(request_ids)

    def _forget_hits(self, request_ids: Sequence[str]) -> None:
        """Drop the kept lookups of ``request_ids`` (none kept: nothing to do)."""
        if self._hits:
            for request_id in request_ids:
                self._hits.pop(request_id, None)

    def get_computed_blocks(self, request_id: str) -> CacheHit:
        self._hash_pending()
        computed, num_tokens = self.manager.get_computed_blocks(self._request(request_id))
        hit = CacheHit(computed.block_ids(), num_tokens)
        self._hits[request_id] = (hit, computed)
        return hit

    def allocate(self, allocation: Allocation) -> BlockIds | None:
        request_id = allocation.request_id
        if allocation.keywords():
            raise EngineError(
                f"optimized: {allocation.describe()}: the optimized engine is driven in the "
                "default serving mode only (no serving-mode keywords)"
            )
        computed = self._computed_blocks(request_id, allocation.hit)
        self._hash_pending()
        try:
            new = self.manager.allocate_slots(
                self._request(request_id),
                allocation.num_new_tokens,
                allocation.num_new_computed_tokens,
                computed,
                allocation.num_lookahead_tokens,
            )
        except KVConformError as exc:
            raise EngineError(f"optimized: allocate_slots({request_id!r}): {exc}") from exc
        if new is None:
            return None
        return tuple(map(tuple, new))

    def schedule_step(self, items: Sequence[SlotRequest]) -> list[BlockIds | None]:
        """The batched step
        (:meth:`optimized.control.kv_cache_manager.KVCacheManager.schedule_step`)."""
        self._hash_pending()
        requests = self.requests
        try:
            step = list(map(requests.__getitem__, map(_REQUEST_ID, items)))
        except KeyError:  # the unknown id's error, from the per-request lookup
            step = [self._request(i.request_id) for i in items]
        try:
            results = self.manager.schedule_columns(
                step, list(map(_NEW_TOKENS, items)), list(map(_LOOKAHEAD, items))
            )
        except KVConformError as exc:
            raise EngineError(f"optimized: schedule_step: {exc}") from exc
        empty = self.manager.no_new_blocks
        if results.count(empty) == len(results):  # a quiet step: the shared empty answer
            return results
        return [r if r is None or r is empty else tuple(map(tuple, r)) for r in results]

    # optional capabilities -------------------------------------------------------------
    def cached_blocks(self) -> list[CachedBlock]:
        return [CachedBlock(b, g, n) for b, g, n in self.manager.block_pool.cached_block_entries()]

    # the data plane ------------------------------------------------------------------
    def attach_data_plane(
        self, *, num_kv_heads: int, head_size: int, state_size: int, dtype, device: str
    ) -> None:
        self.data_plane = self.data_plane_cls(
            self.manager,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            state_size=state_size,
            dtype=dtype,
            device=os.environ.get(DEVICE_ENV, device),
        )

    def _plane(self) -> DataPlane:
        if self.data_plane is None:
            raise EngineError("optimized: attach_data_plane() was not called")
        self.data_plane.begin_step()
        return self.data_plane

    def data_plane_attention(self, gid, request_ids, starts, counts, keys, values, queries):
        return self._plane().attention(gid, request_ids, starts, counts, keys, values, queries)

    def data_plane_read_state(self, gid: int, request_id: str, num_tokens: int):
        return self._plane().read_state(gid, request_id, num_tokens)

    def data_plane_write_state(self, gid: int, request_id: str, num_tokens: int, state) -> int:
        return self._plane().write_state(gid, request_id, num_tokens, state)


def make_engine(layout: KVCacheLayout) -> OptimizedEngine:
    """The optimized engine of ``layout``; a Mamba group in another mode than plain
    ``"align"`` (mode ``"none"``, speculative or prefill checkpoint blocks: the
    ``mamba_modes`` setting it does not declare) is refused with
    :class:`UnsupportedLayoutError`."""
    for spec in layout.specs:
        if isinstance(spec, MambaSpec) and (
            not spec.is_align or spec.num_speculative_blocks or spec.num_prefill_checkpoint_blocks
        ):
            raise UnsupportedLayoutError(
                "optimized: Mamba groups run in plain 'align' mode only (no mode 'none', "
                f"speculative or prefill checkpoint blocks), got layout {layout.describe()}"
            )
    return OptimizedEngine(layout)


#: The production settings the optimized engine serves: the retention interval (dense,
#: sparse, every ``k``; :mod:`reference.retention`). No EAGLE groups, admission caps,
#: external loads or Mamba modes (``mamba_modes``).
make_engine.production_settings = frozenset({"retention"})  # type: ignore[attr-defined]


#: The modules of the optimized control plane the adapter drives (``--engine-coverage``):
#: CI's optimized gate measures them against docs/engine-coverage/optimized-unreached.txt.
def compiled_loops_note() -> str:
    """How the optimized engine runs its hot loops in this environment (printed by the
    bench next to its figures): compiled by numba, or its numpy paths."""
    if jit.ENABLED:
        return f"optimized: compiled loops on (numba {jit.numba.__version__})"
    return (
        "optimized: numpy paths (numba missing or KVCONFORM_JIT=0; the jit extra gives the "
        "compiled loops, as CI and the bench figures of docs/optimized.md run it)"
    )


make_engine.coverage_modules = (  # type: ignore[attr-defined]
    "optimized.control.kv_cache_manager",
    "optimized.control.coordinator",
    "optimized.control.batched_decode",
    "optimized.control.uniform_decode",
    "optimized.control.compiled_decode",
    "optimized.control.compiled_pool",
    "optimized.control.row_freeing",
    "optimized.control.block_pool",
    "optimized.control.hashing",
    "optimized.control.request",
    "optimized.control.managers.base",
    "optimized.control.managers.full",
    "optimized.control.managers.sliding_window",
    "optimized.control.managers.chunked_local",
    "optimized.control.managers.mamba",
)
