"""SGLang's HiCache behind the engine protocol: the host tier of the SGLang adapter.

:class:`HostTier` attaches SGLang 0.5.23's host tier to a built ``UnifiedRadixCache``
exactly as ``--enable-hierarchical-cache`` does (``init_hicache``: a host pool beside
each device pool, ``HybridCacheController`` with the deployment's write policy) and
bridges it to the protocol's host-tier capability
(:class:`properties.core.engine.OwnsHostTier`):

1. **Copies.** Every copy SGLang's controller submits (``L2TransferEngine``'s
   ``submit_device_to_host`` for backups, ``submit_host_to_device`` for load-backs) is
   observed and recorded page by page as :class:`HostTransfer`: the device page's block
   id as the adapter's tables give it (full pool: ``slot // bs``; SWA pool: ``swa_slot //
   bs``) and the host block ``host_slot // bs + 1`` (SGLang hands out host slot 0, the
   protocol keeps block 0 null). A copy is *in flight* from the moment SGLang queues it
   (an inserted node's backup waits in the controller's ``write_queue`` for the next
   flush, the node already pointing at its host pages) until the scheduler's next
   ``check_hicache_events`` acknowledges it (SGLang's ack queues).
2. **Host pools.** One :class:`HostPoolUsage` per SGLang host pool (``kv`` backs the full
   group, ``swa`` the sliding-window group): capacity ``page_num``, free pages from
   SGLang's host allocator, and the pages *held*, read from the radix tree (every node's
   ``host_value`` per component), not from the allocator, so that a page the allocator
   lost or the tree still points at after freeing shows as a broken balance. The pages
   a storage prefetch took and the tree does not hold yet are *staging*
   (:meth:`HostTier._prefetch_pages`).
3. **Host hits** (the ``external_hits`` serving mode): after a lookup, :meth:`host_hit`
   is what SGLang's admission would load back (``init_load_back``): the tokens from the
   device hit to the deepest node every component accepted (``best_match_node``), or 0
   where SGLang's ``load_back`` declines (fewer Full-KV tokens on the host than its
   ``load_back_threshold`` and no component state to load). :meth:`load_back` runs
   SGLang's own ``init_load_back`` and starts the copy (``ready_to_load_host_cache``,
   which SGLang's scheduler calls before the batch runs).

Worked example (bs 2, write-through, host ratio 2): a request of 24 tokens is inserted
at its free: the controller backs its 12 pages up at once (12 ``write`` transfers of the
full group, and those of the SWA group); the tree later evicts the device copy; a new
request with the same 24 tokens and two more gets a device hit of 0 and ``host_hit`` 24;
admitted with ``num_external_computed_tokens=24``, 12 ``load`` transfers per group put the
pages back into fresh device pages, which become the request's first 12 blocks.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from properties.core.engine import (
    HOST_FETCH,
    HOST_LOAD,
    HOST_STORE,
    HOST_WRITE,
    EngineError,
    HostPoolUsage,
    HostTransfer,
)

#: The parallel ranks of a one-GPU deployment, published while the host tier is built.
SINGLE_RANK = {"tp_rank": 0, "pp_rank": 0, "attn_dcp_rank": 0}
#: The host memory the host pools are booked against (SGLang's own
#: ``host_memory_budget_scope``): far above what the layouts' pools take (kilobytes), so
#: a build never depends on how much memory the machine has free at that moment.
HOST_MEMORY_BUDGET_BYTES = 1 << 30


@dataclass(frozen=True)
class HiCacheConfig:
    """How ``--enable-hierarchical-cache`` is deployed: ``--hicache-write-policy``
    (``write_through``: a node is backed up to the host when inserted;
    ``write_through_selective``: once it was hit; ``write_back``: when the device evicts
    it), ``--hicache-ratio`` (host pool tokens / device pool tokens, per pool), the
    CPU-capable settings of the copy (``--hicache-io-backend direct`` with the
    ``layer_first`` host layout, ``docs/sglang-on-cpu.md``) and an optional storage tier
    (L3): ``--hicache-storage-backend file`` (SGLang's file-backed store, in a directory
    of the engine's own) with ``--hicache-storage-prefetch-policy`` and the
    ``prefetch_threshold`` of ``--hicache-storage-backend-extra-config`` (SGLang's 256
    tokens would decline every prefetch of the layouts drawn: they are 96 tokens at
    most)."""

    write_policy: str
    ratio: float
    io_backend: str = "direct"
    mem_layout: str = "layer_first"
    storage: str | None = None
    prefetch_policy: str = "wait_complete"
    prefetch_threshold: int = 1
    #: the storage tier answers one stage per scheduler poll, as a remote store does:
    #: a prefetch's hit query and host allocation at the first poll after the request
    #: arrived, its page reads at the next (:meth:`HostTier.pump_storage`), so a request
    #: admitted in between finds its prefetch in flight; False: the storage answers at
    #: once. Only with the ``best_effort`` policy (admission takes what is there);
    #: ``wait_complete`` would hold the admission, which the protocol cannot express.
    staged_storage: bool = False

    def __post_init__(self) -> None:
        if self.staged_storage and (self.storage is None or self.prefetch_policy != "best_effort"):
            raise ValueError("staged_storage needs a storage tier with the best_effort policy")

    def server_args(self, storage_dir: str | None = None) -> dict[str, Any]:
        """The ``ServerArgs`` fields of this deployment (SGLang's flag names);
        ``storage_dir``: the storage tier's directory."""
        args: dict[str, Any] = {
            "enable_hierarchical_cache": True,
            "hicache_write_policy": self.write_policy,
            "hicache_ratio": self.ratio,
            "hicache_io_backend": self.io_backend,
            "hicache_mem_layout": self.mem_layout,
        }
        if self.storage is not None:
            extra = {"prefetch_threshold": self.prefetch_threshold}
            if storage_dir is not None:
                extra["file_storage_path"] = storage_dir
            args.update(
                hicache_storage_backend=self.storage,
                hicache_storage_prefetch_policy=self.prefetch_policy,
                hicache_storage_backend_extra_config=json.dumps(extra),
            )
        return args


@dataclass(frozen=True)
class PoolRole:
    """One SGLang host pool as the adapter reports it: its name, the KV cache group it
    backs, the device pool object it copies from and to."""

    name: str
    group_id: int
    device_pool: Any
    host_pool: Any


def storage_directory(owner: object, config: HiCacheConfig | None) -> str | None:
    """A fresh directory for the storage tier of ``config`` (None without one), removed
    when ``owner`` (the engine) is."""
    if config is None or config.storage is None:
        return None
    path = tempfile.mkdtemp(prefix="kvconform-sglang-l3-")
    weakref.finalize(owner, shutil.rmtree, path, True)
    return path


@contextmanager
def deployed(get_context: Any, flags: dict[str, Any]) -> Iterator[Any]:
    """SGLang's flags ``flags`` published while the cache and its host tier are built
    (SGLang's scoped ``override_server_args``, restored after: what the cache, the
    controller and the collectors read, they keep), with one rank of one (the storage
    backend keys its files, the metrics their labels, by the ranks) and the host pools
    (kilobytes) booked against a fixed budget, not against the machine's free memory
    less SGLang's 10 GiB reserve (a busy CI machine has less). Yields the published
    ``ServerArgs``. The CPU seams are replaced first (:mod:`sglang_cpu`)."""
    from properties.engines import sglang_cpu

    sglang_cpu.install()
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    context = get_context()
    with (
        context.override_server_args(**flags) as args,
        context.parallel.override(**SINGLE_RANK),
        host_memory_budget_scope(HOST_MEMORY_BUDGET_BYTES),
    ):
        yield args


class HostTier:
    """SGLang's host tier of one engine (module docstring)."""

    def __init__(
        self,
        cache: Any,
        params: Any,
        server_args: Any,
        config: HiCacheConfig,
        page_size: int,
        groups: dict[str, int],
        init_load_back_params: Any,
        storage_dir: str | None = None,
    ) -> None:
        """Attach the tier to ``cache`` (built from ``params``) as ``init_hicache`` does,
        with ``config``'s flags published (``server_args``: the caller holds
        :func:`deployed`). ``groups``: the group id of the ``kv`` (full) and ``swa``
        host pools; ``storage_dir``: the storage tier's directory (:func:`storage_directory`).
        ``init_hicache`` registers the cache's ``shutdown`` to run at exit; a check builds
        hundreds of engines and starts no storage thread, so that registration is undone
        (it would keep every engine alive until exit)."""
        from properties.engines import sglang_cpu

        self.cache = cache
        self.config = config
        self.page = page_size
        self._load_back_params = init_load_back_params
        self.storage_dir = storage_dir
        cache.init_hicache(server_args, params)
        atexit.unregister(cache.shutdown)
        controller = cache.cache_controller
        if controller is None:
            raise EngineError("sglang adapter: init_hicache attached no cache controller")
        for entry in cache.host_pool_group.entries:
            sglang_cpu.unpin(entry.host_pool)
        self.controller = controller
        self.roles: list[PoolRole] = []
        for entry in cache.host_pool_group.entries:
            name = "full" if entry.name.value == "kv" else entry.name.value
            if name not in groups:
                raise EngineError(f"sglang adapter: unexpected HiCache host pool {name!r}")
            self.roles.append(PoolRole(name, groups[name], entry.device_pool, entry.host_pool))
        self._transfers: list[HostTransfer] = []
        #: tokens copied so far, per (kind, group): what SGLang's metrics must report
        self._copied: Counter = Counter()
        #: submitted copies whose acknowledgement is pending: (finish event, transfers)
        self._in_flight: list[tuple[Any, list[HostTransfer]]] = []
        engine = controller.l2_transfer_engine
        submit_d2h, submit_h2d = engine.submit_device_to_host, engine.submit_host_to_device

        def device_to_host(transfers: list[Any]) -> Any:
            done = submit_d2h(transfers)
            self._record(HOST_WRITE, transfers, done)
            return done

        def host_to_device(transfers: list[Any], **kwargs: Any) -> Any:
            done = submit_h2d(transfers, **kwargs)
            self._record(HOST_LOAD, transfers, done)
            return done

        engine.submit_device_to_host = device_to_host
        engine.submit_host_to_device = host_to_device
        if controller.enable_storage:
            self._observe_storage()

    # -- copies ---------------------------------------------------------------------
    def _role_of(self, transfer: Any) -> PoolRole:
        for role in self.roles:
            if transfer.device_pool is role.device_pool and transfer.host_pool is role.host_pool:
                return role
        raise EngineError("sglang adapter: a HiCache copy between pools the adapter does not know")

    def _record(self, kind: str, transfers: Iterable[Any], done: Any) -> None:
        """One submission: its copies, page by page (module docstring, rule 1)."""
        page = self.page
        out: list[HostTransfer] = []
        for transfer in transfers:
            role = self._role_of(transfer)
            device = transfer.device_indices.tolist()
            host = transfer.host_indices.tolist()
            if len(device) != len(host) or len(device) % page:
                raise EngineError(
                    f"sglang adapter: a HiCache copy of {len(device)} device and {len(host)} "
                    f"host slots in pages of {page}"
                )
            gid = role.group_id
            for i in range(0, len(device), page):
                out.append(HostTransfer(kind, gid, device[i] // page, host[i] // page + 1))
        self._transfers.extend(out)
        self._in_flight.append((done.finish_event, out))
        for t in out:
            self._copied[(kind, t.group_id)] += self.page

    def _observe_storage(self) -> None:
        """Record the storage tier's copies (rule 1 for L3): the full pool's pages go
        through the controller's ``page_set_func`` / ``page_get_func`` (the file
        backend's generic page copies), the SWA pool's through the backend's
        ``batch_set_v2`` / ``batch_get_v2``; each call goes through unchanged, then its
        successful pages are recorded as ``store`` / ``fetch`` transfers keyed by
        SGLang's page hash."""
        controller = self.controller
        backend = controller.storage_backend
        full = next(r for r in self.roles if r.name == "full")
        page_set, page_get = controller.page_set_func, controller.page_get_func

        def set_pages(hash_values: list[str], host_indices: Any, extra_info: Any = None) -> Any:
            ok = page_set(hash_values, host_indices, extra_info)
            if ok:
                self._record_storage(HOST_STORE, full, hash_values, host_indices)
            return ok

        def get_pages(
            operation: Any, hash_values: list[str], host_indices: Any, extra_info: Any = None
        ) -> int:
            count = page_get(operation, hash_values, host_indices, extra_info)
            self._record_storage(HOST_FETCH, full, hash_values[:count], host_indices)
            return count

        controller.page_set_func, controller.page_get_func = set_pages, get_pages
        batch_set, batch_get = backend.batch_set_v2, backend.batch_get_v2

        def set_v2(transfers: list[Any], extra_info: Any = None) -> Any:
            results = batch_set(transfers, extra_info=extra_info)
            self._record_pool_storage(HOST_STORE, transfers, results)
            return results

        def get_v2(transfers: list[Any], extra_info: Any = None) -> Any:
            results = batch_get(transfers, extra_info=extra_info)
            self._record_pool_storage(HOST_FETCH, transfers, results)
            return results

        backend.batch_set_v2, backend.batch_get_v2 = set_v2, get_v2

    def _record_storage(self, kind: str, role: PoolRole, keys: list[str], host: Any) -> None:
        """Pages ``keys[i]`` <-> host pages starting at slot ``host[i * bs]``."""
        slots = host.tolist()
        self._transfers.extend(
            HostTransfer(kind, role.group_id, 0, slots[i * self.page] // self.page + 1, key)
            for i, key in enumerate(keys)
        )

    def _record_pool_storage(self, kind: str, transfers: list[Any], results: Any) -> None:
        """The successful pages of ``batch_set_v2`` / ``batch_get_v2`` per pool."""
        for transfer in transfers:
            role = next((r for r in self.roles if r.name == transfer.name.value), None)
            done = (results or {}).get(transfer.name) or (results or {}).get(transfer.name.value)
            if role is None or transfer.host_indices is None or not transfer.keys or not done:
                continue
            ok = [key for key, success in zip(transfer.keys, done) if success]
            self._record_storage(kind, role, ok, transfer.host_indices)

    def pump_storage(self) -> None:
        """The scheduler's poll of its storage tier: the storage workers run until their
        queues are empty and the scheduler side drains what they produced, until nothing
        is left (:func:`properties.engines.sglang_cpu.run_storage_workers`; SGLang's
        ``drain_storage_control_queues``): a storage that answers at once. With
        ``staged_storage``, the reads of the hits allocated at the previous poll and the
        queued backups settle first, then the prefetches issued since are queried and
        their hits allocated, one drain, and their reads wait for the next poll. No-op
        without a storage tier."""
        from properties.engines import sglang_cpu

        if not self.controller.enable_storage:
            return
        if not self.config.staged_storage:
            self._settle(sglang_cpu.STORAGE_WORKERS)
            return
        self._settle(sglang_cpu.STORAGE_IO_WORKERS)
        sglang_cpu.run_storage_workers(self.controller, sglang_cpu.STORAGE_QUERY_WORKERS)
        self.cache.drain_storage_control_queues()

    def _settle(self, workers: tuple[str, ...]) -> None:
        """Run ``workers`` and drain until the storage tier's queues are empty."""
        from properties.engines import sglang_cpu

        controller = self.controller
        for _ in range(16):
            sglang_cpu.run_storage_workers(controller, workers)
            queues = (
                controller.prefetch_hit_queue,
                controller.ack_prefetch_queue,
                controller.ack_backup_queue,
                controller.host_mem_release_queue,
            )
            if all(q.empty() for q in queues):
                return
            self.cache.drain_storage_control_queues()
        raise EngineError("sglang adapter: the storage tier's queues did not settle")

    def audit_metrics(self) -> None:
        """After a poll (every copy acknowledged): SGLang's own counters of the tokens it
        backed up to and loaded back from the host (``--enable-metrics``,
        ``hicache_backup_tokens_total`` and ``load_back_tokens_total`` per pool, recorded
        by :mod:`sglang_metrics`) equal the tokens of the copies the adapter saw it
        submit; a difference is an engine error. Example: two backed-up pages of the
        ``kv`` pool at bs 2: both are 4."""
        collector = self.cache.metrics_collector
        if collector is None or self._pending_events():
            return
        recorded = collector.recorded
        for role in self.roles:
            pool = "kv" if role.name == "full" else role.name
            for kind, metric in (
                (HOST_WRITE, "backup_num_tokens"),
                (HOST_LOAD, "load_back_num_tokens"),
            ):
                counted = recorded.total(metric, pool=pool)
                copied = self._copied[(kind, role.group_id)]
                if counted != copied:
                    raise EngineError(
                        f"sglang adapter: SGLang's metric {metric}[pool={pool}] says {counted:g} "
                        f"tokens, the adapter saw {copied} copied ({kind})"
                    )

    def take_transfers(self) -> list[HostTransfer]:
        """The copies since the last call, in submission order."""
        out, self._transfers = self._transfers, []
        return out

    def _pending_events(self) -> set[int]:
        """The finish events of the copies SGLang has not acknowledged yet."""
        queues = (self.controller.ack_write_queue, self.controller.ack_load_queue)
        return {id(ack.finish_event) for queue in queues for ack in queue}

    def _queued(self) -> list[HostTransfer]:
        """The copies SGLang has queued but not submitted yet (its ``write_queue`` and
        ``load_queue``: backups of inserted nodes wait there for the next flush, and the
        node already points at its host pages), page by page as :meth:`_record` would
        record them."""
        out: list[HostTransfer] = []
        kv_role = next(r for r in self.roles if r.name == "full")
        for kind, queue in (
            (HOST_WRITE, self.controller.write_queue),
            (HOST_LOAD, self.controller.load_queue),
        ):
            for op in queue:
                pairs = [(kv_role, op.device_indices, op.host_indices)]
                for pool_transfer in op.pool_transfers or ():
                    role = next((r for r in self.roles if r.name == pool_transfer.name.value), None)
                    if role is not None and pool_transfer.device_indices is not None:
                        pairs.append(
                            (role, pool_transfer.device_indices, pool_transfer.host_indices)
                        )
                for role, device, host in pairs:
                    if device is None or host is None:
                        continue
                    d, h = device.tolist()[:: self.page], host.tolist()[:: self.page]
                    out.extend(
                        HostTransfer(kind, role.group_id, a // self.page, b // self.page + 1)
                        for a, b in zip(d, h)
                    )
        return out

    # -- host pools -----------------------------------------------------------------
    def _held_pages(self) -> dict[str, list[int]]:
        """Every host page the radix tree points at, per host pool (rule 2)."""
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        kinds = {"full": ComponentType.FULL, "swa": ComponentType.SWA}
        held: dict[str, list[int]] = {role.name: [] for role in self.roles}
        stack = [self.cache.tree_core.root_node]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for role in self.roles:
                value = node.component_data[kinds[role.name]].host_value
                if value is not None:
                    held[role.name].extend(s // self.page + 1 for s in value.tolist()[:: self.page])
        return held

    def pools(self, idle: bool) -> tuple[HostPoolUsage, ...]:
        """Rule 2, with the blocks of unacknowledged copies (rule 1); ``idle``: no request
        holds a row (then the pages the copies pin are counted, else 0)."""
        held = self._held_pages()
        pending = self._pending_events()
        self._in_flight = [(e, t) for e, t in self._in_flight if id(e) in pending]
        queued = self._queued()
        prefetching = self._prefetch_pages()
        out = []
        for role in self.roles:
            flying = [t for _, ts in self._in_flight for t in ts if t.group_id == role.group_id]
            flying += [t for t in queued if t.group_id == role.group_id]
            out.append(
                HostPoolUsage(
                    role.name,
                    (role.group_id,),
                    role.host_pool.page_num,
                    role.host_pool.available_size() // self.page,
                    tuple(held[role.name]),
                    tuple(sorted({t.host_block for t in flying})),
                    tuple(sorted({t.device_block for t in flying if t.kind == HOST_WRITE})),
                    self._pinned_pages(role) if idle else 0,
                    tuple(sorted(prefetching[role.name])),
                )
            )
        return tuple(out)

    def _prefetch_pages(self) -> dict[str, set[int]]:
        """Rule 2, the storage tier's part (``staging``): the host pages a prefetch holds
        outside the tree, per host pool, read from SGLang's own records: the pages allocated for an
        ongoing prefetch (``ongoing_prefetch``: its Full-KV pages and its components'
        staging), the unread tail of a prefetch the admission took early (the read
        acknowledgement releases it, ``ack_releases_incomplete_host_indices``) and the
        pages queued for release (``host_mem_release_queue`` and the components'
        queues). Empty with a storage that answers at once (every poll settles them).
        Example: a hit of 8 tokens at bs 2 allocated at a poll and taken at admission
        before its read: 4 pages until the next poll releases them."""
        cache, controller = self.cache, self.controller
        pages: dict[str, set[int]] = {role.name: set() for role in self.roles}
        if not controller.enable_storage:
            return pages

        def add(pool: str, host: Any) -> None:
            if host is not None and pool in pages:
                pages[pool].update(s // self.page + 1 for s in host.tolist()[:: self.page])

        def add_staging(transfers: Iterable[Any]) -> None:
            for transfer in transfers:
                if transfer.indices_from_pool is None:
                    name = transfer.name.value
                    add("full" if name == "kv" else name, transfer.host_indices)

        current = set()
        for info in cache.ongoing_prefetch.values():
            current.add(id(info.operation))
            add("full", info.host_indices)
            add_staging(x for xfers in info.comp_xfers.values() for x in xfers)
        queued = [*controller.prefetch_buffer.queue, *controller.prefetch_sync_queue.queue]
        queued += controller.ack_prefetch_queue.queue
        for item in queued:
            op = getattr(item, "operation", None) or item
            if id(op) in current or op.host_indices is None:
                continue
            if op.ack_releases_incomplete_host_indices:
                add("full", op.host_indices[op.completed_tokens :])
                if not op.pool_transfers_done:
                    add_staging(op.pool_transfers or ())
        for page in controller.host_mem_release_queue.queue:
            add("full", page)
        for name, release in controller.extra_host_mem_release_queues.items():
            for page in release.queue:
                add(name.value, page)
        return pages

    def _pinned_pages(self, role: PoolRole) -> int:
        """The device pages of ``role``'s pool that copies in flight pin while no request
        holds a row (the only time the checks read it, :meth:`pools`): SGLang locks the
        whole path of a node it backs up or loads back until the copy is acknowledged,
        and with no request holding a lock every protected page is such a copy's, as long
        as one is in flight (none in flight: 0, so a lock a copy leaked shows).
        Example: a node of 2 pages under a backed-up parent of 3, its backup not
        acknowledged: 5."""
        cache = self.cache
        if not (cache.ongoing_write_through or cache.ongoing_load_back):
            return 0  # no copy in flight: a locked page is a lock leaked
        size = cache.full_protected_size if role.name == "full" else cache.swa_protected_size
        return size() // self.page

    # -- the storage tier ------------------------------------------------------------
    def prefetch(self, req: Any) -> None:
        """A request arrives: SGLang's scheduler asks its storage tier for the prompt past
        what the device and host hold (``Scheduler._prefetch_kvcache``: a match, then
        ``prefetch_from_storage`` from the deepest host-backed node), and the storage
        answers at once (:meth:`pump_storage`; with ``staged_storage`` it is queried at the
        next poll). No-op without a storage tier."""
        cache = self.cache
        if not self.controller.enable_storage:
            return
        req.init_next_round_input(cache, cow_mamba=False)
        anchor = req.last_host_node
        matched = req.prefix_len + req.host_hit_length
        if cache.is_backuped(anchor) or cache.is_root(anchor):
            fill = req.full_untruncated_fill_ids
            end = req._compute_max_prefix_len(len(fill))
            keys = cache.get_prefix_hash_values(anchor)
            cache.prefetch_from_storage(
                req.cache_request_handle,
                anchor,
                fill[matched:end],
                cache.get_last_hash_value(anchor),
                keys if cache.hicache_storage_pass_prefix_keys else None,
                matched_prefix_tokens=fill[:matched],
                extra_key=req.extra_key,
                cache_salt=req.cache_salt,
            )
        if not self.config.staged_storage:
            self.pump_storage()

    def prefetch_done(self, req: Any) -> None:
        """Before a waiting request is matched for admission, SGLang's scheduler finishes
        its prefetch (``check_prefetch_progress``: the fetched pages become host nodes
        of the tree) and takes the loaded span (``pop_prefetch_loaded_span``)."""
        if not self.controller.enable_storage:
            return
        if not self.cache.check_prefetch_progress(req.cache_request_handle):
            raise EngineError(
                f"sglang adapter: the prefetch of {req.rid!r} did not finish although the "
                "storage answered at once"
            )
        self.cache.pop_prefetch_loaded_span(req.cache_request_handle)

    def release(self, req: Any) -> None:
        """A request leaves before its prefetch was taken (SGLang's
        ``_release_aborted_request``: ``release_aborted_request``); with
        ``staged_storage`` the pages it releases wait in the release queue for the next
        poll (:meth:`_prefetch_pages`)."""
        if self.controller.enable_storage:
            self.cache.release_aborted_request(req.cache_request_handle)
            if not self.config.staged_storage:
                self.pump_storage()

    # -- load-back ------------------------------------------------------------------
    def tokens_to_load(self, best_match_node: Any, device_tokens: int, req: Any) -> int:
        """Rule 3: the tokens SGLang's ``init_load_back`` would load past a device hit of
        ``device_tokens`` for a lookup whose deepest accepted node is ``best_match_node``
        (0 when ``load_back`` declines: its own ``build_load_back_spec`` and
        ``load_back_threshold`` decide). Example: a host-only node of 24 tokens under the
        root, threshold 10: 24; a host-only node of 4 tokens and nothing else to load: 0."""
        core = self.cache.tree_core
        kv_transfer, component_transfers = core.build_load_back_spec(best_match_node, req)
        if len(kv_transfer.host_indices) < max(1, self.cache.load_back_threshold) and not (
            component_transfers
        ):
            return 0
        return _path_length(core.node_by_id(best_match_node)) - device_tokens

    def load_back(
        self, best_match_node: Any, host_hit_length: int, req: Any, expected: int
    ) -> Any | None:
        """SGLang's admission of a host hit: ``init_load_back`` (the request's
        ``last_node`` is its device match), then the copy starts. Returns the node the
        request now matches, or None when SGLang loaded nothing (the device pool is short
        even after evicting: the protocol's refusal). Any other count than ``expected``
        (what :meth:`tokens_to_load` said) is an engine error."""
        loaded, node = self.cache.init_load_back(
            self._load_back_params(
                best_match_node=best_match_node, host_hit_length=host_hit_length, req=req
            )
        )
        if loaded == 0:
            return None
        if loaded != expected:
            raise EngineError(
                f"sglang adapter: init_load_back loaded {loaded} tokens for "
                f"{req.rid!r}, host_hit said {expected}"
            )
        self.cache.ready_to_load_host_cache()
        return node


def _path_length(node: Any) -> int:
    """Tokens from the root to ``node`` (the sum of the keys on the path)."""
    n = 0
    while node.parent is not None:
        n += len(node.key)
        node = node.parent
    return n
