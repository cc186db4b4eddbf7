"""The engine boundary: every call to the engine under test goes through here.

:func:`guard_engine` wraps an engine in an :class:`EngineBoundary` that, for each call,

1. runs it under the call deadline (:func:`properties.core.deadline.call_deadline`;
   engines in a child process have their own, which kills the child);
2. turns any exception it raises into an :class:`properties.core.engine.EngineError`
   naming the call and its arguments (``allocate_slots('r3', num_new_tokens=8, ...)
   raised KeyError: 'r3'``); a :class:`CallTimeoutError` stays one;
3. validates the answer (:mod:`properties.checks.answers`) and returns it normalised;
4. hands the engine copies of what it could mutate (the prompt as a tuple, output tokens
   as a fresh list), so an engine never changes kvconform's own model of a request, and
   marks the call as running (:mod:`properties.core.current_call`), so a worker process
   the engine ends (``os._exit``) is reported with the call it was in.

The boundary offers exactly the optional capabilities the engine offers (so the
``isinstance(engine, ExposesRefCounts)`` tests of the checks see the same thing), and
the hit it returns is the engine's own object when handed back to ``allocate_slots``.

Worked example: ``guard_engine(make_engine(layout), layout, 5.0).get_block_ids("r0")``
returns ``((1, 2),)``; had the engine returned ``[[1, None]]`` it would raise
``AnswerError("...get_block_ids('r0') returned None for group 0, not an integer")``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from properties.checks import answers
from properties.core import current_call
from properties.core.allocation import Allocation, allocate
from properties.core.coverage_probe import engine_call_ended, engine_call_started
from properties.core.deadline import DeadlinePassed, call_deadline, timeout_message
from properties.core.engine import (
    BlockIds,
    CachedBlock,
    CacheHit,
    CallTimeoutError,
    CommitsSteps,
    CopiesBlocks,
    EngineError,
    ExposesCachedBlocks,
    ExposesFreeQueue,
    ExposesRefCounts,
    FreesInBatch,
    HostPoolUsage,
    HostTransfer,
    KVCacheEngine,
    OwnsHostTier,
    PlansSteps,
    PoolUsage,
    ReportsAllocationEstimate,
    ReportsPools,
    RequestInput,
    SlotRequest,
    StepUpdate,
    SupportsServingModes,
    UnsupportedLayoutError,
)
from properties.core.proxy import EngineProxy
from reference.layout import KVCacheLayout


def engine_name(engine: object) -> str:
    name = getattr(engine, "name", None)
    return name if isinstance(name, str) and name else type(engine).__name__


def call_engine(name: str, what: str, timeout: float, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` under the deadline; any exception becomes an EngineError naming
    ``what`` (the call as text) and the engine; so does ``sys.exit()`` inside the engine
    (a ``SystemExit`` must never end kvconform with the engine's exit status)."""
    current_call.entered(f"{name}: {what}")
    engine_call_started()  # --engine-coverage traces engine calls only
    try:
        with call_deadline(timeout, f"{name}: {what}"):
            return fn(*args)
    except DeadlinePassed:  # the deadline passed just as the call returned
        raise CallTimeoutError(timeout_message(f"{name}: {what}", timeout)) from None
    except EngineError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any engine failure is reported
        raise EngineError(f"{name}: {what} raised {type(exc).__name__}: {exc}") from exc
    finally:
        engine_call_ended()
        current_call.left()


#: A factory call gets at least this many seconds: the first one may import the engine.
MIN_FACTORY_TIMEOUT_S = 120.0


def build_engine(factory: Callable, layout: KVCacheLayout, timeout: float) -> Any:
    """``factory(layout)`` under the deadline (at least :data:`MIN_FACTORY_TIMEOUT_S`
    when there is one); UnsupportedLayoutError passes through."""
    name = getattr(factory, "__name__", type(factory).__name__)
    if timeout > 0:
        timeout = max(timeout, MIN_FACTORY_TIMEOUT_S)
    current_call.entered(f"factory {name}(layout)")
    engine_call_started()
    try:
        with call_deadline(timeout, f"factory {name}(layout)"):
            engine = factory(layout)
    except (UnsupportedLayoutError, EngineError):
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        raise EngineError(
            f"factory {name}(layout) raised {type(exc).__name__}: {exc} "
            f"(layout {layout.describe()})"
        ) from exc
    finally:
        engine_call_ended()
        current_call.left()
    missing = [m for m in _REQUIRED if not callable(getattr(engine, m, None))]
    if missing:
        raise EngineError(
            f"factory {name}(layout) returned a {type(engine).__name__} without "
            f"{', '.join(missing)} (the engine protocol: properties/core/engine.py)"
        )
    return engine


_REQUIRED = (
    "add_request",
    "append_output_tokens",
    "set_num_computed_tokens",
    "new_step",
    "get_computed_blocks",
    "allocate_slots",
    "free",
    "remove_request",
    "reset_prefix_cache",
    "get_block_ids",
    "num_free_blocks",
)


class EngineBoundary(EngineProxy):
    """See the module docstring. Built by :func:`guard_engine`."""

    def __init__(self, engine: KVCacheEngine, layout: KVCacheLayout, timeout: float) -> None:
        super().__init__(engine)
        self.layout = layout
        self.timeout = timeout
        self.name = engine_name(engine)
        self.separate_group_pools = bool(getattr(engine, "separate_group_pools", False))
        self.lookahead_on_prefill_chunks = bool(
            getattr(engine, "lookahead_on_prefill_chunks", True)
        )
        #: request id -> (the validated hit, the engine's own hit object)
        self._hits: dict[str, tuple[CacheHit, Any]] = {}

    def _call(self, what: str, fn: Callable, *args: Any) -> Any:
        return call_engine(self.name, what, self.timeout, fn, *args)

    def add_request(self, request: RequestInput) -> None:
        # the engine gets its own copy of what it could mutate (never kvconform's state)
        mine = replace(request, prompt_token_ids=tuple(request.prompt_token_ids))
        self._call(f"add_request({request.request_id!r})", self.inner.add_request, mine)

    def append_output_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._call(
            f"append_output_tokens({request_id!r}, {list(token_ids)})",
            self.inner.append_output_tokens,
            request_id,
            list(token_ids),  # the engine's own copy: it may keep or mutate it
        )

    def set_num_computed_tokens(self, request_id: str, num_computed_tokens: int) -> None:
        self._call(
            f"set_num_computed_tokens({request_id!r}, {num_computed_tokens})",
            self.inner.set_num_computed_tokens,
            request_id,
            num_computed_tokens,
        )

    def new_step(self) -> None:
        self._call("new_step()", self.inner.new_step)

    def get_computed_blocks(self, request_id: str) -> CacheHit:
        what = f"get_computed_blocks({request_id!r})"
        raw = self._call(what, self.inner.get_computed_blocks, request_id)
        hit = answers.check_hit(f"{self.name}: {what}", raw, self.layout)
        self._hits[request_id] = (hit, raw)
        return hit

    def allocate(self, allocation: Allocation) -> BlockIds | None:
        """The engine's own hit object goes back to it (the validated copy was handed out);
        the serving-mode keywords only when not at their default (:func:`allocate`)."""
        what = allocation.describe()
        kept = self._hits.pop(allocation.request_id, None)
        if allocation.hit is not None and kept is not None and kept[0] is allocation.hit:
            allocation = replace(allocation, hit=kept[1])
        raw = self._call(what, allocate, self.inner, allocation)
        return answers.check_new_blocks(f"{self.name}: {what}", raw, self.layout)

    def free(self, request_id: str) -> None:
        self._hits.pop(request_id, None)
        self._call(f"free({request_id!r})", self.inner.free, request_id)

    def remove_request(self, request_id: str) -> None:
        self._hits.pop(request_id, None)
        self._call(f"remove_request({request_id!r})", self.inner.remove_request, request_id)

    def reset_prefix_cache(self) -> bool:
        raw = self._call("reset_prefix_cache()", self.inner.reset_prefix_cache)
        return answers.check_bool(f"{self.name}: reset_prefix_cache()", raw)

    def get_block_ids(self, request_id: str) -> BlockIds:
        what = f"get_block_ids({request_id!r})"
        raw = self._call(what, self.inner.get_block_ids, request_id)
        return answers.check_table(f"{self.name}: {what}", raw, self.layout)

    def num_free_blocks(self) -> int:
        raw = self._call("num_free_blocks()", self.inner.num_free_blocks)
        return answers.check_free_count(
            f"{self.name}: num_free_blocks()", raw, self.layout, not self.separate_group_pools
        )


def schedule_text(items: Sequence[SlotRequest]) -> str:
    """``schedule_step([('r0', 8), ('r1', 1)])``."""
    return f"schedule_step({[(i.request_id, i.num_new_tokens) for i in items]})"


class _PlansSteps:
    def schedule_step(self, items: Sequence[SlotRequest]) -> list[BlockIds | None]:
        what = schedule_text(items)
        raw = self._call(what, self.inner.schedule_step, list(items))
        return answers.check_batch(f"{self.name}: {what}", raw, len(items), self.layout)


class _CommitsSteps:
    def commit_step(self, updates: Sequence[StepUpdate]) -> None:
        what = f"commit_step({len(updates)} updates: {', '.join(u.request_id for u in updates)})"
        self._call(what, self.inner.commit_step, list(updates))


class _FreesInBatch:
    def free_requests(self, request_ids: Sequence[str]) -> None:
        ids = list(request_ids)
        self._call(f"free_requests({ids!r})", self.inner.free_requests, ids)

    def remove_requests(self, request_ids: Sequence[str]) -> None:
        ids = list(request_ids)
        for request_id in ids:
            self._hits.pop(request_id, None)
        self._call(f"remove_requests({ids!r})", self.inner.remove_requests, ids)


class _ServingModes:
    def set_in_flight(
        self, request_id: str, num_in_flight_tokens: int, num_pending_tokens: int
    ) -> None:
        self._call(
            f"set_in_flight({request_id!r}, {num_in_flight_tokens}, {num_pending_tokens})",
            self.inner.set_in_flight,
            request_id,
            num_in_flight_tokens,
            num_pending_tokens,
        )

    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        self._call(
            f"cache_blocks({request_id!r}, {num_tokens})",
            self.inner.cache_blocks,
            request_id,
            num_tokens,
        )


class _RefCounts:
    def ref_counts(self) -> dict[int, int]:
        raw = self._call("ref_counts()", self.inner.ref_counts)
        return answers.check_ref_counts(f"{self.name}: ref_counts()", raw, self.layout)


class _FreeQueue:
    def free_queue(self) -> list[int]:
        raw = self._call("free_queue()", self.inner.free_queue)
        return answers.check_free_queue(f"{self.name}: free_queue()", raw, self.layout)


class _CachedBlocks:
    def cached_blocks(self) -> list[CachedBlock]:
        raw = self._call("cached_blocks()", self.inner.cached_blocks)
        return answers.check_cached_blocks(f"{self.name}: cached_blocks()", raw, self.layout)


class _AllocationEstimate:
    def last_allocation_estimate(self) -> int | None:
        what = "last_allocation_estimate()"
        raw = self._call(what, self.inner.last_allocation_estimate)
        return answers.check_estimate(f"{self.name}: {what}", raw)


class _Pools:
    def pool_usage(self) -> tuple[PoolUsage, ...]:
        raw = self._call("pool_usage()", self.inner.pool_usage)
        return answers.check_pool_usage(f"{self.name}: pool_usage()", raw, self.layout)


class _HostTier:
    def host_hit(self, request_id: str) -> int:
        what = f"host_hit({request_id!r})"
        raw = self._call(what, self.inner.host_hit, request_id)
        return answers.check_host_hit(f"{self.name}: {what}", raw)

    def host_pools(self) -> tuple[HostPoolUsage, ...]:
        raw = self._call("host_pools()", self.inner.host_pools)
        return answers.check_host_pools(f"{self.name}: host_pools()", raw, self.layout)

    def take_host_transfers(self) -> list[HostTransfer]:
        what = "take_host_transfers()"
        raw = self._call(what, self.inner.take_host_transfers)
        return answers.check_host_transfers(f"{self.name}: {what}", raw, self.layout)


class _BlockCopies:
    def pending_block_copies(self) -> list[tuple[int, int]]:
        raw = self._call("pending_block_copies()", self.inner.pending_block_copies)
        return answers.check_block_copies(f"{self.name}: pending_block_copies()", raw, self.layout)

    def take_block_copies(self) -> list[tuple[int, int]]:
        raw = self._call("take_block_copies()", self.inner.take_block_copies)
        return answers.check_block_copies(f"{self.name}: take_block_copies()", raw, self.layout)


#: The capabilities the boundary passes on, each call validated; the data plane is not
#: offered through it.
EngineBoundary.CAPABILITIES = (
    (ExposesRefCounts, _RefCounts),
    (ExposesFreeQueue, _FreeQueue),
    (ExposesCachedBlocks, _CachedBlocks),
    (PlansSteps, _PlansSteps),
    (CommitsSteps, _CommitsSteps),
    (FreesInBatch, _FreesInBatch),
    (SupportsServingModes, _ServingModes),
    (ReportsAllocationEstimate, _AllocationEstimate),
    (ReportsPools, _Pools),
    (OwnsHostTier, _HostTier),
    (CopiesBlocks, _BlockCopies),
)


def guard_engine(engine: KVCacheEngine, layout: KVCacheLayout, timeout: float) -> EngineBoundary:
    """``engine`` behind an :class:`EngineBoundary` offering the same capabilities."""
    return EngineBoundary.around(engine, layout, timeout)
