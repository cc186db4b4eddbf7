"""An engine over another engine: :class:`EngineProxy`.

The suite wraps the engine under test several times (the boundary that validates its
answers, the lockstep that checks it, the corpus recorder, mutants without
capabilities). :class:`EngineProxy` forwards every call of the engine protocol to
``self.inner``, so a wrapper overrides only the calls it adds something to; an
allocation reaches it as a value (``allocate(allocation)``,
:mod:`properties.core.allocation`), whatever keywords the protocol grows.

``EngineProxy(inner)`` offers the calls every engine offers, no optional capability.
``SomeProxy.around(inner, ...)`` builds a proxy that offers exactly the optional
capabilities ``inner`` offers (so ``isinstance(proxy, ExposesRefCounts)`` answers as for
``inner``): for each ``(protocol, mixin)`` of the class's :attr:`EngineProxy.CAPABILITIES`
that ``inner`` implements, the mixin's calls are added. The default mixins forward;
a subclass may name its own (the boundary validates each answer).

Worked example: ``EngineProxy.around(ReferenceEngine(layout)).ref_counts()`` is the
reference's ref counts; ``EngineProxy(ReferenceEngine(layout))`` has no ``ref_counts``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from properties.core.allocation import Allocation, TakesAllocations, allocate
from properties.core.engine import (
    BlockIds,
    CachedBlock,
    CacheHit,
    CommitsSteps,
    CopiesBlocks,
    ExposesCachedBlocks,
    ExposesDataPlane,
    ExposesFreeQueue,
    ExposesRefCounts,
    HostPoolUsage,
    HostTransfer,
    OwnsHostTier,
    PlansSteps,
    PoolUsage,
    ReportsAllocationEstimate,
    ReportsPools,
    RequestInput,
    SlotRequest,
    StepUpdate,
    SupportsServingModes,
)


class ForwardRefCounts:
    def ref_counts(self) -> Any:
        return self.inner.ref_counts()  # type: ignore[attr-defined]


class ForwardFreeQueue:
    def free_queue(self) -> list[int]:
        return self.inner.free_queue()  # type: ignore[attr-defined]


class ForwardCachedBlocks:
    def cached_blocks(self) -> list[CachedBlock]:
        return self.inner.cached_blocks()  # type: ignore[attr-defined]


class ForwardPlansSteps:
    def schedule_step(self, items: Sequence[SlotRequest]) -> list[BlockIds | None]:
        return self.inner.schedule_step(items)  # type: ignore[attr-defined]


class ForwardCommitsSteps:
    def commit_step(self, updates: Sequence[StepUpdate]) -> None:
        self.inner.commit_step(updates)  # type: ignore[attr-defined]


class ForwardServingModes:
    def set_in_flight(
        self, request_id: str, num_in_flight_tokens: int, num_pending_tokens: int
    ) -> None:
        self.inner.set_in_flight(  # type: ignore[attr-defined]
            request_id, num_in_flight_tokens, num_pending_tokens
        )

    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        self.inner.cache_blocks(request_id, num_tokens)  # type: ignore[attr-defined]


class ForwardAllocationEstimate:
    def last_allocation_estimate(self) -> int | None:
        return self.inner.last_allocation_estimate()  # type: ignore[attr-defined]


class ForwardPools:
    def pool_usage(self) -> Sequence[PoolUsage]:
        return self.inner.pool_usage()  # type: ignore[attr-defined]


class ForwardBlockCopies:
    def pending_block_copies(self) -> list[tuple[int, int]]:
        return self.inner.pending_block_copies()  # type: ignore[attr-defined]

    def take_block_copies(self) -> list[tuple[int, int]]:
        return self.inner.take_block_copies()  # type: ignore[attr-defined]


class ForwardDataPlane:
    def attach_data_plane(self, **kwargs: Any) -> None:
        self.inner.attach_data_plane(**kwargs)  # type: ignore[attr-defined]

    def data_plane_attention(self, *args: Any) -> list[Any]:
        return self.inner.data_plane_attention(*args)  # type: ignore[attr-defined]

    def data_plane_read_state(self, *args: Any) -> tuple[int, Any]:
        return self.inner.data_plane_read_state(*args)  # type: ignore[attr-defined]

    def data_plane_write_state(self, *args: Any) -> int:
        return self.inner.data_plane_write_state(*args)  # type: ignore[attr-defined]


class ForwardHostTier:
    def host_hit(self, request_id: str) -> int:
        return self.inner.host_hit(request_id)  # type: ignore[attr-defined]

    def host_pools(self) -> Sequence[HostPoolUsage]:
        return self.inner.host_pools()  # type: ignore[attr-defined]

    def take_host_transfers(self) -> list[HostTransfer]:
        return self.inner.take_host_transfers()  # type: ignore[attr-defined]


#: Every optional capability of the protocol, with the mixin forwarding its calls.
FORWARDED_CAPABILITIES: tuple[tuple[type, type], ...] = (
    (ExposesRefCounts, ForwardRefCounts),
    (ExposesFreeQueue, ForwardFreeQueue),
    (ExposesCachedBlocks, ForwardCachedBlocks),
    (PlansSteps, ForwardPlansSteps),
    (CommitsSteps, ForwardCommitsSteps),
    (SupportsServingModes, ForwardServingModes),
    (ReportsAllocationEstimate, ForwardAllocationEstimate),
    (ReportsPools, ForwardPools),
    (OwnsHostTier, ForwardHostTier),
    (CopiesBlocks, ForwardBlockCopies),
    (ExposesDataPlane, ForwardDataPlane),
)

_CLASSES: dict[tuple[type, tuple[type, ...]], type] = {}


class EngineProxy(TakesAllocations):
    """Forwards every call of the engine protocol to ``inner`` (module docstring)."""

    #: ``(protocol, mixin)``: the calls :meth:`around` adds when ``inner`` offers
    #: ``protocol``, in this order.
    CAPABILITIES: ClassVar[tuple[tuple[type, type], ...]] = FORWARDED_CAPABILITIES

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @classmethod
    def around(cls, inner: Any, *args: Any, **kwargs: Any) -> EngineProxy:
        """``cls(inner, *args, **kwargs)`` offering exactly ``inner``'s optional
        capabilities (the mixins of :attr:`CAPABILITIES` whose protocol it implements)."""
        mixins = tuple(mixin for protocol, mixin in cls.CAPABILITIES if isinstance(inner, protocol))
        key = (cls, mixins)
        if key not in _CLASSES:
            name = cls.__name__ + "".join(m.__name__.replace("_", "") for m in mixins)
            _CLASSES[key] = type(name, (*mixins, cls), {})
        return _CLASSES[key](inner, *args, **kwargs)

    def add_request(self, request: RequestInput) -> None:
        self.inner.add_request(request)

    def append_output_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.inner.append_output_tokens(request_id, token_ids)

    def set_num_computed_tokens(self, request_id: str, num_computed_tokens: int) -> None:
        self.inner.set_num_computed_tokens(request_id, num_computed_tokens)

    def new_step(self) -> None:
        self.inner.new_step()

    def get_computed_blocks(self, request_id: str) -> CacheHit:
        return self.inner.get_computed_blocks(request_id)

    def allocate(self, allocation: Allocation) -> BlockIds | None:
        return allocate(self.inner, allocation)

    def free(self, request_id: str) -> None:
        self.inner.free(request_id)

    def remove_request(self, request_id: str) -> None:
        self.inner.remove_request(request_id)

    def reset_prefix_cache(self) -> bool:
        return self.inner.reset_prefix_cache()

    def get_block_ids(self, request_id: str) -> BlockIds:
        return self.inner.get_block_ids(request_id)

    def num_free_blocks(self) -> int:
        return self.inner.num_free_blocks()
