"""Realistic bugs of vLLM's scheduler in its calls into the cache manager, each a subclass of
vLLM 0.33's ``Scheduler``: the scheduler level (:mod:`properties.runner.decided`) must
catch every one, and pass unmutated vLLM (``tests/properties/engines/
test_vllm_scheduler_mutants.py``).

* ``lookahead-on-running``: running requests get one lookahead slot too many in
  ``allocate_slots`` (the bonus token reserved as if it were a drafter's lookahead).
  Example: bs 1, ``r0`` decoding position 9: vLLM allocates slots 9 and 10, the
  reference slot 9; the block tables differ after the step.
* ``preemption-frees-late``: a preempted request's blocks go back to the pool at the end
  of ``schedule()`` instead of at the preemption, so the retried allocation still fails
  and the scheduler preempts more requests than it needs (down to the request itself).
* ``connector-told-new-blocks`` (a KV connector path): at admission the connector is told
  the blocks ``allocate_slots`` returned (only the newly allocated ones) instead of the
  request's whole table (``kv_cache_manager.get_blocks``), so it would load the
  external tokens into blocks that are not theirs. Example: bs 2, ``r1`` loads 4
  external tokens and computes 3 more: vLLM tells ``(6, 3)``, the request's table is
  ``(4, 5, 6, 3)``.

* ``connector-end-keeps-skipped-blocks`` (a KV connector path): at a request's end the
  scheduler hands the connector its table without first freeing the blocks that fell
  out of a sliding window on the processed basis (``remove_skipped_blocks`` skipped in
  ``_connector_finished``): the connector is told blocks the window no longer covers,
  and they go back to the pool with the rest, tail first, instead of before it.

* ``deferred-free-ignored`` (a consumer KV connector under asynchronous scheduling):
  the scheduler forgets its fence (``_request_blocks_can_be_freed`` always True), so a
  request freed with tokens in flight returns its blocks to the pool at once, where a
  load could reuse them while the step in flight still writes them. Example: ``r0``
  aborted with position 4 in flight: 7 free blocks at once, the reference's 4 until the
  step is processed.

* ``priority-victim-frees-late`` (priority scheduling): a victim that was scheduled
  earlier in the same step keeps its blocks until the end of ``schedule()`` (as if its
  step's allocation had to stay valid), so the allocation it was preempted for still
  fails and the scheduler preempts on, down to the request itself. Example: ``r0``
  (priority 2, scheduled) preempted for ``r1``: ``r1`` preempts itself too.
* ``encoder-cut-after-allocation`` (image inputs): the chunk vLLM cuts before an image
  the encoder budget cannot take is cut only after ``allocate_slots`` saw it whole, so
  the request holds blocks for tokens it does not compute. Example: ``r1`` (2 text
  tokens, then an image the budget cannot take) runs 2 tokens but is allocated 9
  positions: blocks 7-11, the reference's 7.

* ``connector-delay-ignored`` (a KV connector that saves): the scheduler frees an ended
  request's blocks although its connector asked to keep them while it saves them
  (``request_finished`` returning True is ignored), so they can be reused under the
  save. Example: ``r0`` ends with a save: 7 free blocks at once, the reference's 5 until
  the save is reported.

* ``invalid-block-off-by-one`` (block-level load failures): a request whose loaded block
  the worker reports invalid falls back to the *end* of that block instead of its start,
  so the block's unwritten tokens count as computed. Example: ``r1`` loaded 8 tokens
  (bs 2), block 2 invalid: 6 computed tokens, the reference's 4.

* ``grammar-error-keeps-blocks`` (structured output): a request its grammar ends with an
  error (a rejected token) is finished but its blocks are never freed (the error path
  skips the free). Example: ``r0`` rejected at position 4: 4 free blocks, the
  reference's 7.

* ``reset-delivers-stale-output`` (a reset that preempts running requests): the
  requests it preempts keep their in-flight output (it is delivered, not dropped), so
  each waits for it before it runs again and then carries a token its reset state
  never sampled. Example: ``r0`` preempted with position 4 in flight: not re-admitted
  in the next step, where the reference runs its 5 tokens.

Each mutant is built on first use (vLLM is imported then): :func:`mutant_class`.
"""

from __future__ import annotations

from typing import Any

#: name -> one-line description of each mutant
MUTANTS: dict[str, str] = {
    "lookahead-on-running": "running requests get num_lookahead_tokens + 1 in allocate_slots",
    "preemption-frees-late": "a preempted request's blocks are freed at the end of schedule()",
    "connector-told-new-blocks": "update_state_after_alloc gets allocate_slots' new blocks only",
    "connector-end-keeps-skipped-blocks": "_connector_finished does not remove skipped blocks",
    "deferred-free-ignored": "blocks of a request with tokens in flight are freed at once",
    "encoder-cut-after-allocation": "allocate_slots sees the chunk before the encoder cut",
    "priority-victim-frees-late": "a victim scheduled in the step is freed at its end",
    "connector-delay-ignored": "an ended request's blocks are freed while its connector saves",
    "invalid-block-off-by-one": "an invalid loaded block counts as computed",
    "grammar-error-keeps-blocks": "a request a grammar ends keeps its blocks",
    "reset-delivers-stale-output": "a reset's preemptions deliver their in-flight output",
}


def _lookahead_on_running(base: type) -> type:
    class LookaheadOnRunning(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            manager = self.kv_cache_manager
            allocate = manager.allocate_slots
            running = self.running

            def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
                if request in running and "num_lookahead_tokens" in kwargs:
                    kwargs["num_lookahead_tokens"] += 1
                return allocate(request, *args, **kwargs)

            manager.allocate_slots = allocate_slots

    return LookaheadOnRunning


def _preemption_frees_late(base: type) -> type:
    class PreemptionFreesLate(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._late: list[Any] = []

        def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
            free = self._free_request_blocks
            self._free_request_blocks = self._late.append  # type: ignore[method-assign]
            try:
                super()._preempt_request(request, *args, **kwargs)
            finally:
                self._free_request_blocks = free  # type: ignore[method-assign]

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            out = super().schedule(*args, **kwargs)
            late, self._late = self._late, []
            for request in late:
                self.kv_cache_manager.free(request)
            return out

    return PreemptionFreesLate


def _connector_told_new_blocks(base: type) -> type:
    class ConnectorToldNewBlocks(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            manager = self.kv_cache_manager
            allocate = manager.allocate_slots
            returned: dict[str, Any] = {}

            def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
                new = allocate(request, *args, **kwargs)
                returned[request.request_id] = new
                return new

            manager.allocate_slots = allocate_slots
            connector = self.connector
            if connector is None:
                return
            tell = connector.update_state_after_alloc

            def update_state_after_alloc(request: Any, blocks: Any, num_external: int) -> Any:
                return tell(request, returned.get(request.request_id, blocks), num_external)

            connector.update_state_after_alloc = update_state_after_alloc

    return ConnectorToldNewBlocks


def _connector_end_keeps_skipped_blocks(base: type) -> type:
    class ConnectorEndKeepsSkippedBlocks(base):  # type: ignore[misc, valid-type]
        def _connector_finished(self, request: Any) -> Any:
            manager = self.kv_cache_manager
            manager.remove_skipped_blocks = lambda *args, **kwargs: None
            try:
                return super()._connector_finished(request)
            finally:
                del manager.remove_skipped_blocks

    return ConnectorEndKeepsSkippedBlocks


def _deferred_free_ignored(base: type) -> type:
    class DeferredFreeIgnored(base):  # type: ignore[misc, valid-type]
        def _request_blocks_can_be_freed(self, request: Any) -> bool:
            return True

    return DeferredFreeIgnored


def _encoder_cut_after_allocation(base: type) -> type:
    class EncoderCutAfterAllocation(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            #: request id -> the chunk before the encoder cut (read by allocate_slots)
            self._uncut: dict[str, int] = {}
            manager = self.kv_cache_manager
            allocate = manager.allocate_slots
            uncut = self._uncut

            def allocate_slots(request: Any, num_new_tokens: int, *args: Any, **kw: Any) -> Any:
                whole = uncut.pop(request.request_id, 0)
                return allocate(request, max(whole, num_new_tokens), *args, **kw)

            manager.allocate_slots = allocate_slots

        def _try_schedule_encoder_inputs(
            self, request: Any, num_computed_tokens: int, num_new_tokens: int, *args: Any, **kw: Any
        ) -> Any:
            out = super()._try_schedule_encoder_inputs(
                request, num_computed_tokens, num_new_tokens, *args, **kw
            )
            if 0 < out[1] < num_new_tokens:
                self._uncut[request.request_id] = num_new_tokens
            return out

    return EncoderCutAfterAllocation


def _priority_victim_frees_late(base: type) -> type:
    class PriorityVictimFreesLate(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            #: requests allocated in the schedule() running now, and their late frees
            self._allocated: set[str] = set()
            self._late: list[Any] = []
            manager = self.kv_cache_manager
            allocate = manager.allocate_slots
            allocated = self._allocated

            def allocate_slots(request: Any, *args: Any, **kw: Any) -> Any:
                new = allocate(request, *args, **kw)
                if new is not None:
                    allocated.add(request.request_id)
                return new

            manager.allocate_slots = allocate_slots

        def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
            if request.request_id not in self._allocated:
                super()._preempt_request(request, *args, **kwargs)
                return
            free = self._free_request_blocks
            self._free_request_blocks = self._late.append  # type: ignore[method-assign]
            try:
                super()._preempt_request(request, *args, **kwargs)
            finally:
                self._free_request_blocks = free  # type: ignore[method-assign]

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            self._allocated.clear()
            out = super().schedule(*args, **kwargs)
            late, self._late = self._late, []
            for request in late:
                self.kv_cache_manager.free(request)
            return out

    return PriorityVictimFreesLate


def _connector_delay_ignored(base: type) -> type:
    class ConnectorDelayIgnored(base):  # type: ignore[misc, valid-type]
        def _connector_finished(self, request: Any) -> Any:
            _, params = super()._connector_finished(request)
            return False, params

    return ConnectorDelayIgnored


def _invalid_block_off_by_one(base: type) -> type:
    class InvalidBlockOffByOne(base):  # type: ignore[misc, valid-type]
        def _update_requests_with_invalid_blocks(
            self,
            requests: Any,
            invalid_block_ids: Any,
            num_scheduled_tokens: Any,
            *a: Any,
            **k: Any,
        ) -> Any:
            requests = list(requests)
            before = {
                r.request_id: r.num_computed_tokens - num_scheduled_tokens.get(r.request_id, 0)
                for r in requests
            }
            out = super()._update_requests_with_invalid_blocks(
                requests, invalid_block_ids, num_scheduled_tokens, *a, **k
            )
            for r in requests:
                if r.request_id in out[0] and r.num_computed_tokens < before[r.request_id]:
                    r.num_computed_tokens += self.block_size
            return out

    return InvalidBlockOffByOne


def _grammar_error_keeps_blocks(base: type) -> type:
    class GrammarErrorKeepsBlocks(base):  # type: ignore[misc, valid-type]
        def _free_request(self, request: Any, delay_free_blocks: bool = False) -> Any:
            from vllm.v1.request import RequestStatus

            if request.status == RequestStatus.FINISHED_ERROR and request.use_structured_output:
                delay_free_blocks = True
            return super()._free_request(request, delay_free_blocks)

    return GrammarErrorKeepsBlocks


def _reset_delivers_stale_output(base: type) -> type:
    class ResetDeliversStaleOutput(base):  # type: ignore[misc, valid-type]
        def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
            preempt = self._preempt_request

            def delivering(request: Any, timestamp: float, drop_stale_output: bool = False):
                return preempt(request, timestamp, drop_stale_output=False)

            self._preempt_request = delivering  # type: ignore[method-assign]
            try:
                return super().reset_prefix_cache(*args, **kwargs)
            finally:
                self._preempt_request = preempt  # type: ignore[method-assign]

    return ResetDeliversStaleOutput


_BUILDERS = {
    "lookahead-on-running": _lookahead_on_running,
    "preemption-frees-late": _preemption_frees_late,
    "connector-told-new-blocks": _connector_told_new_blocks,
    "connector-end-keeps-skipped-blocks": _connector_end_keeps_skipped_blocks,
    "deferred-free-ignored": _deferred_free_ignored,
    "encoder-cut-after-allocation": _encoder_cut_after_allocation,
    "priority-victim-frees-late": _priority_victim_frees_late,
    "connector-delay-ignored": _connector_delay_ignored,
    "invalid-block-off-by-one": _invalid_block_off_by_one,
    "grammar-error-keeps-blocks": _grammar_error_keeps_blocks,
    "reset-delivers-stale-output": _reset_delivers_stale_output,
}


def mutant_class(name: str, asynchronous: bool = False) -> type:
    """The mutant ``name`` as a subclass of vLLM's ``Scheduler`` (``AsyncScheduler`` with
    ``asynchronous``; an unknown name is a one-line ``KeyError``)."""
    if name not in _BUILDERS:
        raise KeyError(f"unknown vLLM scheduler mutant {name!r}; known: {sorted(MUTANTS)}")
    if asynchronous:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as base

    return _BUILDERS[name](base)


__all__ = ["MUTANTS", "mutant_class"]
