"""What the reference and optimized adapters share: both drive a request-level KV cache
manager with the reference's API (``free``, ``reset_prefix_cache``, ``get_block_ids``,
``get_num_free_blocks``, ``last_num_blocks_to_allocate`` and a ``block_pool`` with
``ref_counts()`` and a ``free_block_queue``), keep their requests by id and the hit of each lookup.

A subclass sets ``name``, builds ``self.manager`` and fills ``self.requests`` and
``self._hits``; the calls below only delegate (a request is made by the manager's own
``make_request``, so each adapter gets its manager's request class). Example:
``ReferenceEngine(layout).num_free_blocks()`` is ``layout.num_blocks - 1`` on a fresh pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from properties.core.allocation import TakesAllocations
from properties.core.engine import BlockIds, CacheHit, EngineError, RequestInput
from reference.request import RequestStatus


class ManagerEngine(TakesAllocations):
    """The delegating calls of an engine over a reference-API manager. A subclass
    implements ``allocate(allocation)`` (:class:`properties.core.allocation.Allocation`);
    ``allocate_slots`` builds the value."""

    name = "manager"
    manager: Any
    requests: dict[str, Any]
    _hits: dict[str, Any]

    def _request(self, request_id: str) -> Any:
        try:
            return self.requests[request_id]
        except KeyError:
            raise EngineError(f"{self.name}: unknown request {request_id!r}") from None

    def _computed_blocks(self, request_id: str, hit: CacheHit | None) -> Any:
        """The manager's own computed blocks behind ``hit``: the ones this engine's last
        ``get_computed_blocks`` for the request returned (``None`` without a hit)."""
        if hit is None:
            return None
        kept = self._hits.pop(request_id, None)
        if kept is None or kept[0] != hit:
            raise EngineError(
                f"{self.name}: allocate_slots({request_id!r}) got a hit this engine did not "
                "return from its last get_computed_blocks"
            )
        return kept[1]

    def add_request(self, request: RequestInput) -> None:
        if request.request_id in self.requests:
            raise EngineError(f"{self.name}: request {request.request_id!r} added twice")
        self.requests[request.request_id] = self.manager.make_request(
            request.request_id, request.prompt_token_ids, request.cache_salt, request.lora_name
        )

    def append_output_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._request(request_id).append_output_token_ids(token_ids)

    def set_num_computed_tokens(self, request_id: str, num_computed_tokens: int) -> None:
        """Set the request's computed count; 0 marks it preempted (the scheduler's reset)."""
        req = self._request(request_id)
        req.num_computed_tokens = num_computed_tokens
        if num_computed_tokens == 0:
            req.status = RequestStatus.PREEMPTED

    def new_step(self) -> None:
        self.manager.new_step_starts()

    def free(self, request_id: str) -> None:
        self.manager.free(self._request(request_id))
        self._hits.pop(request_id, None)

    def pop_blocks_for_free(self, request_id: str) -> list[Any]:
        """A deferred free's first half (the manager's ``pop_blocks_for_free``: the
        request gives up its blocks, the pool does not get them yet); not an engine
        protocol call: the scheduler level's replay of vLLM's deferred frees."""
        blocks = self.manager.pop_blocks_for_free(self._request(request_id))
        self._hits.pop(request_id, None)
        return blocks

    def free_popped_blocks(self, blocks: list[Any]) -> None:
        """A deferred free's second half (the manager's ``free_popped_blocks``)."""
        self.manager.free_popped_blocks(blocks)

    def remove_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._hits.pop(request_id, None)

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def get_block_ids(self, request_id: str) -> BlockIds:
        return self.manager.get_block_ids(request_id)

    def num_free_blocks(self) -> int:
        return self.manager.get_num_free_blocks()

    # optional capabilities
    def ref_counts(self) -> dict[int, int]:
        return self.manager.block_pool.ref_counts()

    def free_queue(self) -> list[int]:
        return self.manager.block_pool.free_block_queue.block_ids()

    def last_allocation_estimate(self) -> int | None:
        """The manager's estimate in its last ``allocate_slots`` (``ReportsAllocationEstimate``)."""
        return self.manager.last_num_blocks_to_allocate
