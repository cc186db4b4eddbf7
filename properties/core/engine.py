"""The engine protocol: the one interface a KV cache manager under test implements.

An engine is built by a *factory* ``factory(layout: KVCacheLayout) -> KVCacheEngine``
and then driven one scheduler step at a time. Requests are named by string ids;
the engine keeps its own request objects. The calls mirror the request-level API
of the reference (:mod:`reference.kv_cache_manager`):

====================================  ===============================================
call                                  meaning
====================================  ===============================================
``add_request(RequestInput)``         a new request (prompt tokens, salt, LoRA name)
``append_output_tokens(id, tokens)``  decoded tokens join the request (hashes extend)
``set_num_computed_tokens(id, n)``    the step's tokens were computed (or 0: preempted)
``new_step()``                        a scheduler step begins
``get_computed_blocks(id)``           longest prefix hit, no side effects -> CacheHit
``allocate_slots(id, n, ...)``        new blocks per group, or None when the pool can't
``free(id)``                          release every block of the request
``remove_request(id)``                forget a request (after ``free``)
``reset_prefix_cache()``              drop all cached keys; False while blocks are held
``get_block_ids(id)``                 the request's block table per group (0 = null)
``num_free_blocks()``                 blocks an allocation could take now
====================================  ===============================================

Block ids are ints, ``0`` is the null block. ``BlockIds`` is one tuple of ids
per KV cache group, in the layout's group order.

Optional capabilities (checked with ``isinstance`` against the runtime-checkable
protocols below) enable more invariants when an engine offers them:
``ExposesRefCounts`` (ref count per block: I3), ``ExposesFreeQueue`` (the free
queue in eviction order: I2, A3), ``ExposesCachedBlocks`` (which blocks hold a
cached prefix: hit maximality at the universal level), ``PlansSteps`` (a batched
``schedule_step`` for the running requests of a step: the scheduler then drives it, and
the lockstep compares it with the reference's per-request calls), ``CommitsSteps`` (a
batched ``commit_step`` for the end of a step: the scheduler then hands it every scheduled
request's computed tokens and new output token in one call), ``FreesInBatch`` (a batched
``free_requests`` of the requests that end in the same step: the scheduler then frees them
in one call, and forgets them with one ``remove_requests``), ``ExposesDataPlane``
(the engine's own device block tables, slot mapping, paged caches and attention: the
``attention`` property then runs through them instead of the harness's copies),
``ReportsAllocationEstimate`` (the number of blocks the last ``allocate_slots`` estimated
it needed: A4 compares it with the blocks the call pulled from the free pool),
``ReportsPools`` (engines whose groups live in separate block pools, such as SGLang's full
and SWA pools or TensorRT-LLM's pool per window size: each pool's groups, capacity and
free count, so that S1-S3 check accounting, idle pools and failed allocations per pool),
``OwnsHostTier`` (an engine with its own host tier, SGLang's HiCache: the tokens its tier
would load past a device hit, its host pools and the copies between the tiers: the
host-tier checks X3-X6 follow every block's content through them), ``CopiesBlocks``
(copy-on-write of partial prefix hits: the block copies a step's allocations queued,
handed over once the step is planned).

Serving modes (:mod:`properties.core.modes`) need ``SupportsServingModes``:
``set_in_flight(id, num_in_flight_tokens, num_pending_tokens)`` (asynchronous
scheduling: tokens planned but not processed, sampled tokens not appended yet),
``cache_blocks(id, num_tokens)`` (the scheduler commits the processed tokens when a
step's output is processed, as vLLM's ``update_from_output`` does) and the keyword
``full_sequence_must_fit`` of ``allocate_slots`` (the admission gate). An engine
without them is only driven in the default (synchronous, ungated) mode.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from reference.errors import KVConformError
from reference.layout import KVCacheLayout

BlockIds = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class RequestInput:
    """What a request brings: its prompt and the extra keys of its hashes.

    ``mm_items``: its multimodal items, ``(identifier, offset, length)`` each (an image whose
    placeholder tokens are the prompt positions ``[offset, offset + length)``);
    ``prompt_embeds``: None, or the embedding id the model reads at each prompt position
    instead of the token's own (:mod:`reference.media`). Engines given requests with either
    declare the ``multimodal`` production setting (:mod:`properties.core.modes`)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    cache_salt: str | None = None
    lora_name: str | None = None
    mm_items: tuple[tuple[str, int, int], ...] = ()
    prompt_embeds: tuple[int, ...] | None = None

    @property
    def has_media(self) -> bool:
        """Whether the request carries multimodal items or prompt embeddings."""
        return bool(self.mm_items) or self.prompt_embeds is not None


@dataclass(frozen=True)
class CacheHit:
    """A prefix hit: ``num_tokens`` computed tokens backed by ``block_ids`` per group.

    Entries of ``block_ids`` may be ``0`` (null) where a group no longer needs the
    tokens (sliding window, chunked local, Mamba).
    """

    block_ids: BlockIds
    num_tokens: int


@dataclass(frozen=True)
class CachedBlock:
    """A block registered in the prefix cache: ``group_id``, and the prefix it ends."""

    block_id: int
    group_id: int
    num_tokens: int


class EngineError(KVConformError):
    """The engine under test raised, returned garbage, or cannot be built."""


class EngineLoadError(EngineError):
    """The adapter cannot be loaded: unknown name, a module that cannot be imported (missing,
    syntax error, raising on import), or no callable factory. A usage error (exit 2)."""


class CallTimeoutError(EngineError):
    """A call to the engine under test ran past its deadline (``--call-timeout``).

    The run stops at once (a hang is not shrunk: each attempt would cost the whole
    deadline again); the trace so far is saved."""


class UnsupportedLayoutError(EngineError):
    """The engine cannot be built for this layout (the suite skips such examples).

    An adapter whose engine supports only some layouts should also give its factory
    a ``layout_strategy`` attribute: a function returning a Hypothesis strategy of
    the layouts it supports (``kvconform check`` then draws from it).
    """


class KnownDivergenceMet(EngineError):
    """An adapter met one of its engine's known divergences in a call (one declared
    with ``at_run_time``: it depends on the calls, not on the layout). The example stops
    there and is not counted (as a layout the engine refuses); ``divergence`` is the
    divergence's name. Example: vLLM's Mamba estimate below zero after a draft rollback."""

    def __init__(self, divergence: str, message: str) -> None:
        super().__init__(f"known divergence {divergence}: {message}")
        self.divergence = divergence


@runtime_checkable
class KVCacheEngine(Protocol):
    """The calls every engine under test implements (see the module docstring)."""

    def add_request(self, request: RequestInput) -> None: ...

    def append_output_tokens(self, request_id: str, token_ids: Sequence[int]) -> None: ...

    def set_num_computed_tokens(self, request_id: str, num_computed_tokens: int) -> None: ...

    def new_step(self) -> None: ...

    def get_computed_blocks(self, request_id: str) -> CacheHit: ...

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        hit: CacheHit | None = None,
        num_lookahead_tokens: int = 0,
    ) -> BlockIds | None: ...

    def free(self, request_id: str) -> None: ...

    def remove_request(self, request_id: str) -> None: ...

    def reset_prefix_cache(self) -> bool: ...

    def get_block_ids(self, request_id: str) -> BlockIds: ...

    def num_free_blocks(self) -> int: ...


@runtime_checkable
class SupportsServingModes(Protocol):
    """Optional calls for :class:`properties.core.modes.ServingMode` (module docstring).

    ``allocate_slots`` must also accept ``full_sequence_must_fit: bool = False``.
    """

    def set_in_flight(
        self, request_id: str, num_in_flight_tokens: int, num_pending_tokens: int
    ) -> None: ...

    def cache_blocks(self, request_id: str, num_tokens: int) -> None: ...


@runtime_checkable
class ExposesRefCounts(Protocol):
    def ref_counts(self) -> Mapping[int, int]:
        """Ref count of every non-null block id in ``[1, num_blocks)``."""
        ...


@runtime_checkable
class ExposesFreeQueue(Protocol):
    def free_queue(self) -> list[int]:
        """Free block ids from the front (next to allocate / evict) to the back."""
        ...


@runtime_checkable
class ExposesCachedBlocks(Protocol):
    def cached_blocks(self) -> list[CachedBlock]:
        """Every block currently registered in the prefix cache."""
        ...


@runtime_checkable
class ReportsAllocationEstimate(Protocol):
    def last_allocation_estimate(self) -> int | None:
        """The blocks the last ``allocate_slots`` call estimated it needed: the figure it
        compared with its free count (vLLM: what ``get_num_blocks_to_allocate`` returned),
        an integer ``>= 0``. With ``full_sequence_must_fit`` it is the per-step estimate,
        not the admission gate's whole-sequence one. ``None`` when the call computed no
        per-step estimate (the admission gate refused it first).

        Worked example (one full group, bs 4, a fresh request offered a 4-token hit on a
        cached block nobody holds, 6 new tokens): 10 slots need 3 blocks; one is the hit,
        evictable (it leaves the free queue when adopted), two are new: the estimate is
        3, and the call then pulls those 3 blocks from the free pool.
        """
        ...


@runtime_checkable
class CopiesBlocks(Protocol):
    """Copy-on-write of partial (sub-block) prefix hits (vLLM 0.33's CoW copies).

    A hit that ends inside a block gives the request a fresh block in place of the shared
    one, and the content of the shared block must be copied into it before the step runs
    (:mod:`reference.managers.base`); a Mamba request whose prompt's partial tail is keyed
    on the block it keeps writing copies that block out the same way
    (:mod:`reference.managers.mamba`). The engine queues each copy as ``(source,
    destination)`` block ids and keeps both blocks from being reused until it hands the
    copy over.

    ``pending_block_copies`` lists the copies queued since the last hand-over, in the
    order queued, and changes nothing (the checks read it after each allocation: the
    copy happens before the step's writes). ``take_block_copies`` hands them over: the
    scheduler calls it once per step, after the step's allocations and before the step
    runs; the engine then releases what it held for them (vLLM's scheduler:
    ``take_kv_cache_block_copies`` and ``free_blocks`` of their endpoints). Engines that
    offer it may be given layouts with partial hits (the ``partial_hits`` production
    setting, :mod:`properties.core.modes`).

    Worked example (full attention bs 8, Mamba bs 16, sliding window bs 4: hash block 4,
    partial hits): a request hits 12 tokens on full blocks ``[a, b]``; its allocation
    returns ``c`` first in that group, the group's row becomes ``[a, c]``,
    ``pending_block_copies() == [(b, c)]``; at the end of the step's scheduling
    ``take_block_copies() == [(b, c)]`` and ``pending_block_copies() == []``.
    """

    def pending_block_copies(self) -> list[tuple[int, int]]: ...

    def take_block_copies(self) -> list[tuple[int, int]]: ...


@dataclass(frozen=True)
class PoolUsage:
    """One block pool of an engine whose groups do not share a pool (``ReportsPools``).

    ``group_ids``: the KV cache groups (layout order) whose block ids come from this pool;
    ``num_blocks``: the pool's usable blocks (a null block excluded); ``num_free``: the
    blocks an allocation in this pool could take now (free, or reclaimable by evicting
    cached blocks nobody holds). Block ids are per pool: block 5 of one pool and block 5
    of another are different blocks.

    Example (SGLang, full group 0 and SWA group 1, 16 pages each, a request holding 3
    full pages and 2 SWA pages, nothing cached):
    ``(PoolUsage("full", (0,), 16, 13), PoolUsage("swa", (1,), 16, 14))``.
    """

    name: str
    group_ids: tuple[int, ...]
    num_blocks: int
    num_free: int


@runtime_checkable
class ReportsPools(Protocol):
    def pool_usage(self) -> Sequence[PoolUsage]:
        """Every block pool of the engine, each group in exactly one of them (see
        :class:`PoolUsage`). ``num_free_blocks()`` stays the engine's own figure (SGLang:
        the smallest pool's free count)."""
        ...


#: :attr:`HostTransfer.kind` of a copy from a device block to a host block (a backup:
#: write-through or write-back).
HOST_WRITE = "write"
#: :attr:`HostTransfer.kind` of a copy from a host block to a device block (a load-back).
HOST_LOAD = "load"
#: :attr:`HostTransfer.kind` of a copy from a host block into the storage tier under
#: :attr:`HostTransfer.storage_key` (a backup to storage, L3).
HOST_STORE = "store"
#: :attr:`HostTransfer.kind` of a copy from the storage tier into a host block (a
#: prefetch).
HOST_FETCH = "fetch"
#: Every :attr:`HostTransfer.kind`.
HOST_TRANSFER_KINDS = (HOST_WRITE, HOST_LOAD, HOST_STORE, HOST_FETCH)


@dataclass(frozen=True)
class HostTransfer:
    """One block copied between a device pool and the engine's own host tier
    (:class:`OwnsHostTier`): ``kind`` :data:`HOST_WRITE` (device block ``device_block``
    to host block ``host_block``) or :data:`HOST_LOAD` (the other way), for the block
    of KV cache group ``group_id`` (its host pool is the one whose ``group_ids`` hold the
    group). Host block ids are per host pool, ``0`` never used. A storage tier behind
    the host tier (L3) adds :data:`HOST_STORE` (host block into storage under
    ``storage_key``) and :data:`HOST_FETCH` (storage key into a host block), with
    ``device_block`` 0.

    Example (SGLang, full group 0, bs 2): backing up the node of slots ``[8, 9, 10, 11]``
    into host slots ``[4, 5, 6, 7]`` is ``HostTransfer("write", 0, 4, 3)`` and
    ``HostTransfer("write", 0, 5, 4)``; writing host block 3 to storage under key
    ``"ab12"`` is ``HostTransfer("store", 0, 0, 3, "ab12")``."""

    kind: str
    group_id: int
    device_block: int
    host_block: int
    storage_key: str = ""


@dataclass(frozen=True)
class HostPoolUsage:
    """One host pool of an engine's own host tier (:class:`OwnsHostTier`).

    ``group_ids``: the KV cache groups whose blocks it backs up (those of one device
    pool); ``num_blocks``: its capacity (a null block excluded); ``num_free``: blocks a
    backup could take now without evicting; ``held``: the blocks that hold a backed-up
    copy now, each once; ``in_flight``: host blocks a transfer not yet acknowledged
    reads or writes (they must stay held); ``in_flight_device``: the device blocks a
    backup not yet acknowledged reads (they must not be handed to a request before the
    acknowledgement; a load's device blocks are the loading request's own);
    ``num_pinned_device``: how many device blocks of those groups the copies in flight
    keep from being free or reclaimable while no request holds them (the blocks they
    read and any the engine pins with them: SGLang locks a backed-up node's whole path),
    read by the idle-pool checks when no request holds blocks; ``staging``: blocks taken
    for a copy into the host tier that no backed-up copy holds yet, or given up and
    waiting for the engine to free them (SGLang's storage prefetch: pages allocated for a
    fetch from storage before the tree takes them, or the unread rest of a prefetch
    ended early). Between calls, ``num_free + len(held) + len(staging) == num_blocks``.

    Example (32 host blocks, two backed-up nodes of 3 and 2 blocks, one of them still
    being written from device blocks 7 and 8 into host blocks 4 and 5, its parent's block
    6 pinned with them):
    ``HostPoolUsage("full", (0,), 32, 27, (1, 2, 3, 4, 5), (4, 5), (7, 8), 3)``; with
    a fetch from storage into blocks 9 and 10 under way as well, 25 free and
    ``staging=(9, 10)``."""

    name: str
    group_ids: tuple[int, ...]
    num_blocks: int
    num_free: int
    held: tuple[int, ...]
    in_flight: tuple[int, ...] = ()
    in_flight_device: tuple[int, ...] = ()
    num_pinned_device: int = 0
    staging: tuple[int, ...] = ()


@runtime_checkable
class OwnsHostTier(Protocol):
    """An engine whose host tier is its own (SGLang's HiCache): it decides what is backed
    up, evicted from the host and loaded back, where the scheduler's KV connector
    (:mod:`properties.runner.connector`) decides it for engines without one.

    ``host_hit(id)``: after ``get_computed_blocks(id)`` returned a device hit of ``h``
    tokens, the tokens ``e`` past it that the engine's host tier would load back; the
    ``external_hits`` serving mode then passes them as
    ``allocate_slots(..., num_external_computed_tokens=e)`` and the engine loads them
    into the request's blocks (0: none, the request computes them). ``host_pools()``:
    every host pool (:class:`HostPoolUsage`). ``take_host_transfers()``: the copies made
    since the last call, in order (:class:`HostTransfer`); the checks read it after
    every engine call and follow the content of every block through the tiers.
    """

    def host_hit(self, request_id: str) -> int: ...

    def host_pools(self) -> Sequence[HostPoolUsage]: ...

    def take_host_transfers(self) -> list[HostTransfer]: ...


@dataclass(frozen=True)
class SlotRequest:
    """One running request's share of a batched step: the arguments of
    ``allocate_slots(request_id, num_new_tokens, 0, None, num_lookahead_tokens)``."""

    request_id: str
    num_new_tokens: int
    num_lookahead_tokens: int = 0


@runtime_checkable
class PlansSteps(Protocol):
    def schedule_step(self, items: Sequence[SlotRequest]) -> list[BlockIds | None]:
        """``allocate_slots`` of every item in order, in one call; stops after the first
        ``None`` (the list ends with it; later items are not applied). Must equal the
        per-request calls exactly (same results, same state)."""
        ...


class StepUpdate(NamedTuple):
    """One scheduled request at the end of a step: ``set_num_computed_tokens(request_id,
    num_computed_tokens)``, then ``append_output_tokens(request_id, [output_token])`` when
    ``output_token`` is not None. Example: a decode step of request ``"a"`` at 2049 computed
    tokens that decoded token 7 is ``StepUpdate("a", 2049, 7)``."""

    request_id: str
    num_computed_tokens: int
    output_token: int | None


@runtime_checkable
class CommitsSteps(Protocol):
    """The batched end of a step, the companion of :class:`PlansSteps`."""

    def commit_step(self, updates: Sequence[StepUpdate]) -> None:
        """For every update in order: ``set_num_computed_tokens`` then, when it has one,
        ``append_output_tokens`` of its token; in one call. Must equal those per-request
        calls exactly. The scheduler calls it once per step, before the step's ``free``
        calls of finished requests (a request's update never depends on another's)."""
        ...


@runtime_checkable
class FreesInBatch(Protocol):
    """The batched ``free`` of the requests that end in the same step."""

    def free_requests(self, request_ids: Sequence[str]) -> None:
        """Exactly ``free(r)`` for each id in order (same state, same free queue), in one
        call. The scheduler calls it when two or more requests finish in one step, after
        the connector's release hook of each. Example: ``free_requests(["a", "b"])`` equals
        ``free("a"); free("b")``."""
        ...

    def remove_requests(self, request_ids: Sequence[str]) -> None:
        """Exactly ``remove_request(r)`` for each id in order, in one call: the scheduler
        forgets the requests it freed with ``free_requests`` (same ids, right after).
        Example: ``remove_requests(["a", "b"])`` equals ``remove_request("a");
        remove_request("b")``."""
        ...


@runtime_checkable
class HasSelfChecks(Protocol):
    """An adapter that checks its engine on its own, at a cost that is not the engine's.

    ``disable_self_checks`` turns those checks off for the rest of the engine's life; the
    bench calls it before timing, so that a row measures the engine, not the adapter.
    Example: the vLLM adapter compares every hash in vLLM's pool with the KV events at
    each step (O(cached blocks)); after ``disable_self_checks()`` it only drains the
    events, as vLLM's own engine core does.
    """

    def disable_self_checks(self) -> None: ...


@runtime_checkable
class BuildsAsDeployed(Protocol):
    """An adapter that builds its engine in a configuration chosen to observe it, and can
    build it again as the engine's users run it by default.

    ``build_as_deployed`` is called by the bench on a fresh engine, before any request, so
    that a row times what a deployment runs rather than what the checks watch; it raises
    :class:`EngineError` once a request was added. Example: the vLLM adapter turns KV cache
    events on for three layouts in four (to audit them); ``vllm serve`` leaves them off
    unless a KV events config is given, and emitting them costs vLLM about half its
    prefill time on decode-heavy, so the bench's vLLM has them off (and its stats on, as
    ``vllm serve`` logs them by default).
    """

    def build_as_deployed(self) -> None: ...


@runtime_checkable
class ExposesDataPlane(Protocol):
    """The engine's own data plane, driven by the ``attention`` property.

    ``attach_data_plane`` builds the paged caches (called once, before the first step).
    Per step and attention group ``gid``, ``data_plane_attention`` maps the scheduled
    tokens (request ``i``: positions ``starts[i] .. starts[i] + counts[i] - 1``) to slots
    through the engine's device block table, writes ``keys``/``values`` (``[tokens,
    heads, head_size]``, request order) into its paged cache and returns each request's
    attention output (``[counts[i], heads, head_size]``) read through the same tables.
    Mamba groups: ``data_plane_read_state`` returns ``(block id, state)`` of the state of
    ``tokens[0:num_tokens]``; ``data_plane_write_state`` stores it and returns its block.
    Errors (a slot in the null block, a missing row) raise ``KVConformError``.
    """

    def attach_data_plane(
        self, *, num_kv_heads: int, head_size: int, state_size: int, dtype: Any, device: str
    ) -> None: ...

    def data_plane_attention(
        self,
        gid: int,
        request_ids: Sequence[str],
        starts: Sequence[int],
        counts: Sequence[int],
        keys: Any,
        values: Any,
        queries: Sequence[Any],
    ) -> list[Any]: ...

    def data_plane_read_state(
        self, gid: int, request_id: str, num_tokens: int
    ) -> tuple[int, Any]: ...

    def data_plane_write_state(
        self, gid: int, request_id: str, num_tokens: int, state: Any
    ) -> int: ...


EngineFactory = Callable[[KVCacheLayout], KVCacheEngine]


@dataclass(frozen=True)
class KnownDivergence:
    """A documented engine behaviour that breaks a property (a finding).

    An adapter lists them on its factory (``factory.known_divergences``); the suite
    does not draw layouts for which ``applies(layout)`` is true, and ``kvconform
    check`` prints each one with its finding so nothing is hidden. ``features``: one or
    two features of the pair table (:mod:`properties.runner.pairs`) such that the
    divergence removes every layout that has them all, so the pairs they make are
    listed as excluded by it, not missed. Example: an engine without lookahead hashes
    declares ``applies=lambda layout: layout.num_hash_lookahead_tokens > 0,
    features=("lookahead-hashes",)`` (every pair with ``lookahead-hashes`` excluded);
    ``features=("eagle-drop", "retention=sparse")`` excludes that one pair.

    ``modes``: for a behaviour that shows only under some serving modes
    (:class:`properties.core.modes.ServingMode`), a predicate on the mode. The layouts
    are then drawn; a run whose layout and mode the divergence applies to gets the
    default synchronous mode instead (the predicate must be false for it). Example: a
    leak under asynchronous scheduling with Mamba groups: ``applies=has_mamba,
    modes=lambda mode: mode.async_scheduling, features=("async", "mamba")``.

    One that depends on the calls rather than the layout is declared ``at_run_time``
    (its ``applies`` is false for every layout): the adapter detects it in the call
    where it happens and raises :class:`KnownDivergenceMet`, which stops that example
    uncounted.

    ``checks`` (invariant names) is for a behaviour that only some traces of a layout
    show, where leaving the layouts out would leave the engine untested there: the
    layouts are drawn and those checks do not run on them (``kvconform replay`` still
    runs every check, so the finding's trace fails). Example: LMDeploy writes a block
    its prefix trie shares (``exclusive_write``) whenever two requests compute one
    block, so caching layouts are drawn without that check.
    """

    name: str
    summary: str
    finding: str
    applies: Callable[[KVCacheLayout], bool]
    features: tuple[str, ...] = ()
    modes: Callable[[Any], bool] | None = None
    at_run_time: bool = False
    checks: tuple[str, ...] = ()

    def applies_to(self, layout: KVCacheLayout, mode: Any = None) -> bool:
        """Whether the divergence applies to a run of ``layout`` in serving ``mode``
        (``None``: whatever the mode; then only a divergence without ``modes``, one
        that applies to every mode of its layouts, does). Example: the Mamba leak
        above applies to ``(mamba layout, async mode)``, not to ``(mamba layout,
        None)``."""
        if not self.applies(layout):
            return False
        if self.modes is None:
            return True
        return mode is not None and bool(self.modes(mode))


#: Adapters shipped with kvconform: name -> "module:factory".
BUILTIN_ENGINES: dict[str, str] = {
    "reference": "properties.engines.reference:make_engine",
    "optimized": "properties.engines.optimized:make_engine",
    "vllm": "properties.engines.vllm:make_engine",
    "sglang": "properties.engines.sglang:make_engine",
    "aphrodite": "properties.engines.aphrodite:make_engine",
    "lmdeploy": "properties.engines.lmdeploy:make_engine",
}


def quiet_loggers(*names: str, level: int = logging.ERROR) -> None:
    """Raise the level of an engine's own loggers (``"vllm"``, ``"sglang"``) so that its
    warnings (vLLM logs "Failed to reset prefix cache" on every refused reset) do not
    flood a check's output. Adapters call it once their engine is imported."""
    for name in names:
        logger = logging.getLogger(name)
        if logger.level != level:  # setLevel clears every logger's cache, even unchanged
            logger.setLevel(level)


#: Engines named ``scheme:ARGUMENT``: scheme -> "module:function" building the factory
#: from ARGUMENT. ``exec:COMMAND`` runs an engine in any language as a child process
#: (``docs/exec-protocol.md``).
ENGINE_SCHEMES: dict[str, str] = {
    "exec": "properties.engines.exec_engine:factory_from_command",
}


def load_engine_factory(name: str) -> EngineFactory:
    """Resolve ``reference``/``vllm``/..., ``exec:COMMAND`` or an outside
    ``package.module:factory``.

    An outside module is imported as ``python -m`` would: the current directory is
    searched too (the ``kvconform`` script alone would not see the caller's project).
    Example: ``load_engine_factory("exec:./my-manager")`` is the factory of a child
    process running ``./my-manager``.
    """
    scheme, _, argument = name.partition(":")
    if scheme in ENGINE_SCHEMES:
        module_name, _, attr = ENGINE_SCHEMES[scheme].partition(":")
        return getattr(importlib.import_module(module_name), attr)(argument)
    target = BUILTIN_ENGINES.get(name, name)
    if ":" not in target:
        raise EngineLoadError(
            f"--engine {name!r} is neither a built-in engine ({', '.join(BUILTIN_ENGINES)}) "
            "nor of the form 'module:factory'"
        )
    module_name, _, attr = target.partition(":")
    if name not in BUILTIN_ENGINES and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - missing, syntax error, raising on import
        raise EngineLoadError(
            f"--engine {name!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        factory = getattr(module, attr, None)
    except Exception as exc:  # noqa: BLE001 - a module __getattr__ that raises
        raise EngineLoadError(
            f"--engine {name!r}: reading {attr!r} from module {module_name!r} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if factory is None:
        raise EngineLoadError(f"--engine {name!r}: module {module_name!r} has no {attr!r}")
    if not callable(factory):
        raise EngineLoadError(
            f"--engine {name!r}: {module_name}.{attr} is a {type(factory).__name__}, "
            "not a callable factory"
        )
    return factory
