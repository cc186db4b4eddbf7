"""Block-level KV load failures as vLLM 0.33's scheduler handles them: which requests a
report of invalid blocks affects, how far their computed tokens fall back, which blocks
the ``fail`` policy evicts, and the order in which failed requests end.

A KV connector's worker may report, with a step's output, the ids of loaded blocks it
could not write (``invalid_block_ids``; single-group layouts only: block ids repeat
across groups). vLLM scans the requests that may hold them, in order (:func:`scan`):

* a request is affected when a block within its computed tokens *before the step*
  (``num_computed_tokens - scheduled``) is invalid;
* the first affected request to meet an invalid block marks it and falls back to
  ``index * block_size`` computed tokens (the block's start); a later request meeting
  only blocks marked already (it shares them: a hit on blocks the same step loaded and
  cached) keeps its computed tokens before the step (the first one recomputes them);
* every affected request skips its step's output; with the ``fail`` policy the blocks
  from each marking request's first invalid one on lose their cached hashes
  (``evict_blocks``) and the requests end with an error.

The requests scanned are the running ones (synchronous loads, blocks already cached:
evicted under ``fail``) and, separately, the ones waiting for an asynchronous load
(never cached yet: nothing evicted), each scan with its own marks.

vLLM ends failed requests by iterating a set built through a fixed sequence of set
operations (:func:`error_order`); CPython iterates sets built by the same operations on
the same strings in the same order, so the reference frees them in vLLM's order.

Worked example (bs 2): ``r1`` loaded positions 0-7 into blocks (3, 4, 5, 6) and then
computed 2 more tokens in the same step; the worker reports block 5 invalid: ``r1``
falls back to ``2 * 2 = 4`` computed tokens and skips its output. ``r2``, admitted in
the same step with a hit on (3, 4, 5), also meets 5 (marked by ``r1``): it keeps the 6
tokens it had before the step and skips its output too. Under ``fail``, blocks 5 and 6
lose their hashes and both requests end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from reference.specs import cdiv


@dataclass(frozen=True)
class ScannedRequest:
    """A request a scan looks at: its block ids (the one group) and its computed tokens
    before the step."""

    request_id: str
    block_ids: tuple[int, ...]
    num_computed_before: int


@dataclass(frozen=True)
class ScanResult:
    """What :func:`scan` decided: the affected requests in the order vLLM adds them, each
    one's computed tokens after the scan, and the blocks to evict under ``fail``."""

    affected: tuple[str, ...]
    num_computed: dict[str, int]
    to_evict: frozenset[int]


def scan(requests: Sequence[ScannedRequest], invalid: set[int], block_size: int) -> ScanResult:
    """The scan of the module docstring over ``requests`` in order."""
    marked: set[int] = set()
    affected: list[str] = []
    computed: dict[str, int] = {}
    evict: set[int] = set()
    for req in requests:
        hit = marked_here = False
        num_blocks = cdiv(req.num_computed_before, block_size)
        for index, block in enumerate(req.block_ids[:num_blocks]):
            if block not in invalid:
                continue
            hit = True
            if block in marked:
                continue  # shared with an earlier request, which recomputes it
            marked.add(block)
            if marked_here:
                continue
            marked_here = True
            computed[req.request_id] = index * block_size
            evict.update(req.block_ids[index:])
        if hit:
            if not marked_here:
                computed[req.request_id] = req.num_computed_before
            affected.append(req.request_id)
    return ScanResult(tuple(affected), computed, frozenset(evict))


def error_order(
    failed_loads: Sequence[str],
    async_affected: Sequence[str],
    sync_affected: Sequence[str],
    ended: frozenset[str] = frozenset(),
) -> list[str]:
    """The order in which vLLM's ``fail`` policy ends the failed requests of one step's
    output: the set operations of ``update_from_output`` on the whole failures
    (``failed_recving``, built in report order; those ``ended`` already are passed
    over), then the two scans' affected sets (``async | sync``), then
    ``finish_requests`` iterating a copy. Example: one whole failure ``r1`` and no
    invalid block -> ``["r1"]``."""
    failed_recving: set[str] = set()
    for rid in failed_loads:
        failed_recving.add(rid)
    handled: set[str] = set()
    for rid in failed_recving:
        if rid not in ended:
            handled.add(rid)
    failed_ids: set[str] = set()
    failed_ids.update(handled)
    async_set: set[str] = set()
    for rid in async_affected:
        async_set.add(rid)
    sync_set: set[str] = set()
    for rid in sync_affected:
        sync_set.add(rid)
    failed_ids.update(async_set | sync_set)
    errors: set[str] = set()
    errors.update(failed_ids)
    return list(set(errors))


__all__ = ["ScanResult", "ScannedRequest", "error_order", "scan"]
