"""Two realistic bugs in vLLM's KV cache events, placed in branches the ci profile did not
reach before the vLLM adapter drove the events (issue 19): each must be caught by the
adapter's event check (an engine error, exit 3). Test fixtures, not part of the package;
they need vLLM (``.engines/vllm``).

* ``make_event_offset``: ``BlockPool.cache_full_blocks`` announces the hash at the block's
  index counted from the request's first block instead of from the first newly cached
  one (``block_hashes[i]`` for ``new_block_hashes[i]``): once a request has cached
  blocks, its ``BlockStored`` names the wrong hashes.
* ``make_removed_with_group``: ``BlockPool._emit_block_removed_events`` announces the pool
  key (hash plus the 4-byte group id) instead of the hash (``get_block_hash`` forgotten).

Each mutation rewrites one line of the method's source at run time and is applied once per
process, when the factory first builds an engine
(:mod:`tests.properties.engines.line_mutants`).

Worked example::

    kvconform check --engine tests.properties.engines.vllm_event_mutants:make_event_offset \\
        --isolation none --level exact --only invariants
"""

from __future__ import annotations

from collections.abc import Callable

from properties.engines import vllm as adapter
from tests.properties.engines.line_mutants import mutant_factory, mutated_method

#: name -> (method of BlockPool, the line as vLLM has it, the mutated line)
MUTATIONS = {
    "event_offset": (
        "cache_full_blocks",
        "new_hashes.append(maybe_convert_block_hash(block_hash))",
        "new_hashes.append(maybe_convert_block_hash(block_hashes[i]))",
    ),
    "removed_with_group": (
        "_emit_block_removed_events",
        "block_hashes=[maybe_convert_block_hash(get_block_hash(block_hash))],",
        "block_hashes=[maybe_convert_block_hash(block_hash)],",
    ),
}


def mutated(name: str) -> tuple[type, str, Callable]:
    """``(BlockPool, method, mutated function)`` for mutant ``name`` (see :data:`MUTATIONS`)."""
    from vllm.v1.core.block_pool import BlockPool

    method, old, new = MUTATIONS[name]
    return BlockPool, method, mutated_method(BlockPool, method, old, new, name)


def _factory(name: str) -> Callable:
    attributes = ("known_divergences", "production_settings")
    return mutant_factory(name, mutated, adapter.make_engine, attributes)


make_event_offset = _factory("event_offset")
make_removed_with_group = _factory("removed_with_group")
