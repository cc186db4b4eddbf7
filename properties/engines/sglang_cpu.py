"""SGLang 0.5.23's HiCache on a machine without a GPU: the seams that need one, replaced.

``--enable-hierarchical-cache`` builds a host memory pool beside each device pool and a
cache controller that copies KV between them. Everything that decides *what* is copied
(the radix tree, its components, the pools and their allocators, the controller's write
and load queues, acknowledgements and locks) is Python over torch and runs unchanged on
CPU tensors. Two calls below it assume CUDA, the storage tier's workers run on
threads whose timing would make runs differ, and its page hash is a C++ extension built
at its first call; :func:`install` replaces each at SGLang's
own seam (the module attribute SGLang's code calls through) with the smallest CPU,
deterministic equivalent. ``docs/sglang-on-cpu.md`` lists them with the reasons.

1. ``sglang.srt.mem_cache.pool_host.common._cuda_host_register`` (called by
   ``alloc_with_host_register`` when the host pool is pinned, SGLang's default): it
   registers the host buffer with ``cudaHostRegister`` so that the GPU's copy engines can
   read it. Without a device there is nothing to register it with (torch's CPU build
   raises on ``torch.cuda.cudart()``): :func:`register_host_memory` does nothing, and the
   buffer stays the ordinary CPU tensor SGLang allocated. For the same reason each host
   pool's ``pin_memory`` flag is cleared once built (:func:`unpin`): the pages it
   allocates later would ask torch for pinned memory, which a CPU-only torch refuses.
2. ``sglang.srt.mem_cache.pool_host.mha.transfer_kv_direct`` (``sgl_kernel.kvcacheio``'s
   op, imported by that module on CUDA, ROCm and XPU only): the copy of the ``direct`` io
   backend with the ``layer_first`` host layout, for both directions (device to host
   when a node is backed up, host to device when it is loaded back). On CPU it is
   :func:`transfer_kv_direct`: for every layer, the rows of ``src_indices`` are copied
   into the rows of ``dst_indices``, synchronously.

3. ``threading`` and ``Queue`` as ``sglang.srt.managers.cache_controller`` sees them, for
   the storage tier (L3): with a storage backend attached, the controller starts four
   worker threads (``prefetch_thread_func``: the storage hit query;
   ``prefetch_io_aux_func``: the storage-to-host page copy; ``prefetch_sync_thread_func``:
   the rank agreement on a prefetch; ``backup_thread_func``: the host-to-storage writes)
   that the scheduler thread feeds and polls through queues. Their timing would make a
   run depend on the machine's load. :class:`SynchronousThread` keeps each worker's own
   loop function as SGLang creates it, unstarted; the adapter runs it at the scheduler's
   poll points until its queue is empty (:class:`DrainableQueue` ends the loop there
   with :class:`QueueDrained`), as if the storage were infinitely fast. The workers'
   code, the queues and the scheduler-side drains are SGLang's.

4. ``sglang.srt.mem_cache.cpp_utils.native_hash._load_native_hash_module``, for the
   storage tier: it JIT-builds SGLang's C++ page hash (``hicache_hash_cpp``: ninja and a
   compiler in a subprocess, under a machine-wide file lock) at the first page hashed,
   which is inside an engine call: about 30 s on a two-core machine while the call's
   thread sleeps, so the per-call deadline ended it (killing the build, which therefore
   never finished) and every storage deployment's first arrival or insert timed out.
   :func:`properties.engines.sglang_hash.load_page_hasher` returns a Python hasher
   with the same digests instead (:mod:`sglang_hash`): no build, no subprocess, no lock.

Not replaced: SGLang's streams and events. On a CPU-only torch, SGLang's
``get_device_module()`` is ``torch.cpu``, whose ``Stream`` and ``Event`` exist for
device-agnostic code (``record``, ``wait`` and ``synchronize`` do nothing, ``query()`` is
True): SGLang's own choice for a CPU device, and right here since the copies of (2) are
done when the controller submits them. The controller still queues every write and
load, acknowledges it on the scheduler's next ``check_hicache_events`` and releases the
locks it took, exactly as on a GPU.

Worked example (``transfer_kv_direct``): layers ``[a]`` -> ``[b]``, ``src_indices [4, 5]``,
``dst_indices [8, 9]``: ``b[8] = a[4]`` and ``b[9] = a[5]``, every other row of ``b``
unchanged.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

_installed: list[bool] = []

#: The storage workers' loop functions, in the order the adapter runs them (the
#: pipeline's order: hit query, page copy, agreement, writes).
STORAGE_WORKERS = (
    "prefetch_thread_func",
    "prefetch_io_aux_func",
    "prefetch_sync_thread_func",
    "backup_thread_func",
)
#: the prefetch's first stage: the storage hit query
STORAGE_QUERY_WORKERS = STORAGE_WORKERS[:1]
#: the rest: the prefetch's page reads and their acknowledgement, the backups
STORAGE_IO_WORKERS = STORAGE_WORKERS[1:]


class QueueDrained(Exception):
    """A storage worker found its queue empty: its synchronous run ends here."""


class DrainableQueue(queue.Queue):
    """Replacement 3's queue: a blocking ``get`` on an empty queue raises
    :class:`QueueDrained` instead of waiting for a producer thread that does not exist
    (the scheduler side only takes items it counted, so it never meets it)."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if block and self.empty():
            raise QueueDrained
        return super().get(block, timeout)


class SynchronousThread:
    """Replacement 3's thread: created by the controller exactly as a
    ``threading.Thread``, but ``start()`` only registers the worker on its controller
    (``_kvconform_workers``, by function name); :func:`run_storage_workers` runs it."""

    def __init__(self, target: Callable[[], None] | None = None, **kwargs: Any) -> None:
        self.target = target
        self.name = getattr(target, "__name__", "worker")

    def start(self) -> None:
        owner = getattr(self.target, "__self__", None)
        if owner is not None:
            owner.__dict__.setdefault("_kvconform_workers", {})[self.name] = self

    def join(self, timeout: float | None = None) -> None:
        """Nothing runs on its own: nothing to wait for."""

    def is_alive(self) -> bool:
        return False

    def run_until_drained(self) -> None:
        """The worker's loop, until its queue is empty."""
        if self.target is None:
            return
        with contextlib.suppress(QueueDrained):
            self.target()


class _StorageThreading:
    """``threading`` as the cache controller module sees it: ``Thread`` is
    :class:`SynchronousThread`, everything else the real module's."""

    Thread = SynchronousThread

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)


def run_storage_workers(controller: Any, names: tuple[str, ...] = STORAGE_WORKERS) -> None:
    """Run the storage workers ``names`` of ``controller`` (default: all) until their
    queues are empty, in the pipeline's order (:data:`STORAGE_WORKERS`)."""
    workers = controller.__dict__.get("_kvconform_workers", {})
    for name in STORAGE_WORKERS:
        if name not in names:
            continue
        worker = workers.get(name)
        if worker is not None:
            worker.run_until_drained()


def register_host_memory(buffer: Any, registration_granularity_bytes: int | None = None) -> None:
    """Replacement 1: a host pool buffer needs no registration when there is no device."""


def unpin(host_pool: Any) -> None:
    """Replacement 1, for the pages a host pool allocates later (the storage tier's
    bounce pages, ``get_dummy_flat_data_page``): its ``pin_memory`` flag is cleared where
    torch has no CUDA, which cannot pin (``torch.zeros(..., pin_memory=True)`` raises)."""
    import torch

    if not torch.cuda.is_available():
        host_pool.pin_memory = False


def transfer_kv_direct(
    src_layers: Sequence[Any],
    dst_layers: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    page_size: int,
) -> None:
    """Replacement 2: copy the token rows ``src_indices`` of every source layer into the
    rows ``dst_indices`` of the matching destination layer (module docstring's example).
    ``page_size`` is the kernel's copy granularity; a row copy needs none. Raises
    ``ValueError`` on layer or index lists of different lengths, as the kernel does."""
    if len(src_layers) != len(dst_layers):
        raise ValueError(
            f"transfer_kv_direct: {len(src_layers)} source layers, {len(dst_layers)} destination"
        )
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(
            f"transfer_kv_direct: {src_indices.numel()} source rows, "
            f"{dst_indices.numel()} destination rows"
        )
    src = src_indices.to("cpu", dtype=_long())
    dst = dst_indices.to("cpu", dtype=_long())
    for source, target in zip(src_layers, dst_layers):
        target[dst] = source[src]


def _long() -> Any:
    import torch

    return torch.int64


def install() -> None:
    """Put each replacement in place where SGLang left the seam to a GPU: the copy where
    ``pool_host.mha`` bound no kernel (a CPU build), the registration where torch has no
    CUDA. Once per process; SGLang must be importable."""
    if _installed:
        return
    import sglang.srt.mem_cache.pool_host.common as host_common
    import sglang.srt.mem_cache.pool_host.mha as host_mha
    import torch

    if not torch.cuda.is_available():
        host_common._cuda_host_register = register_host_memory
    if not hasattr(host_mha, "transfer_kv_direct"):
        host_mha.transfer_kv_direct = transfer_kv_direct
    import sglang.srt.mem_cache.cpp_utils.native_hash as native_hash

    from properties.engines import sglang_hash

    native_hash._load_native_hash_module = sglang_hash.load_page_hasher
    import sglang.srt.managers.cache_controller as controller_module

    controller_module.threading = _StorageThreading()
    controller_module.Queue = DrainableQueue
    _installed.append(True)
