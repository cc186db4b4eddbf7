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

Each mutation rewrites one line of the method's source at run time (``_mutate``) and is
applied once per process, when the factory first builds an engine.

Worked example::

    kvconform check --engine tests.properties.engines.vllm_event_mutants:make_event_offset \\
        --isolation none --level exact --only invariants
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from collections.abc import Callable

from properties.engines import vllm as adapter
from reference.layout import KVCacheLayout

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
_APPLIED: set[str] = set()


def mutated(name: str) -> tuple[type, str, Callable]:
    """``(BlockPool, method, mutated function)`` for mutant ``name`` (see
    :data:`MUTATIONS`): the method's source with one line replaced."""
    from vllm.v1.core.block_pool import BlockPool

    method, old, new = MUTATIONS[name]
    source = textwrap.dedent(inspect.getsource(getattr(BlockPool, method)))
    if source.count(old) != 1:
        raise RuntimeError(f"mutant {name}: {old!r} not found once in BlockPool.{method}")
    namespace: dict = {}
    code = compile(source.replace(old, new), f"<mutant {name}>", "exec")
    exec(code, vars(sys.modules[BlockPool.__module__]), namespace)
    return BlockPool, method, namespace[method]


def _mutate(name: str) -> None:
    """Apply mutant ``name`` for the rest of this process (once)."""
    if name not in _APPLIED:
        owner, method, function = mutated(name)
        setattr(owner, method, function)
        _APPLIED.add(name)


def _factory(name: str) -> Callable[[KVCacheLayout], object]:
    def make(layout: KVCacheLayout) -> object:
        _mutate(name)
        return adapter.make_engine(layout)

    for attribute in ("known_divergences", "production_settings"):
        setattr(make, attribute, getattr(adapter.make_engine, attribute))
    make.__name__ = f"make_{name}"
    return make


make_event_offset = _factory("event_offset")
make_removed_with_group = _factory("removed_with_group")
