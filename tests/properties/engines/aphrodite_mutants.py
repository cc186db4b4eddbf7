"""Two realistic bugs in Aphrodite 0.24.1's own KV cache manager (``aphrodite/v1/core``),
each of which the ci profile must catch through the Aphrodite adapter. Test fixtures, not
part of the package; they need Aphrodite (``.engines/aphrodite``).

* ``lookup_whole_prompt``: ``KVCacheManager.get_computed_blocks`` bounds the lookup by
  ``request.num_tokens`` instead of ``num_tokens - 1``: a prompt whose every block is
  cached hits all its tokens, so no token is left to compute the logits from (the H1 hit
  bound: a hit is at most ``num_tokens - 1``).
* ``window_skips_one_more``: ``SlidingWindowManager.get_num_skipped_tokens`` skips one
  token more than the window allows (``- sliding_window + 2``): when the oldest token a
  query still reads opens a block, that block is freed and nulled while the window reads
  it. The same count sizes ``get_num_blocks_to_allocate``, so the ci profile first sees
  an allocation pulling a block its estimate left out (A4, ``estimate_matches_pulls``).

Each mutation rewrites one line of the method's source at run time and is applied once per
process, when the factory first builds an engine (:mod:`tests.properties.engines.line_mutants`).

Worked example::

    kvconform check --engine tests.properties.engines.aphrodite_mutants:make_lookup_whole_prompt \\
        --isolation none --level exact --only invariants
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from properties.engines import aphrodite as adapter
from tests.properties.engines.line_mutants import mutant_factory, mutated_method

#: name -> (module, class, method, the line as Aphrodite has it, the mutated line)
MUTATIONS = {
    "lookup_whole_prompt": (
        "aphrodite.v1.core.kv_cache_manager",
        "KVCacheManager",
        "get_computed_blocks",
        "max_cache_hit_length = request.num_tokens - 1",
        "max_cache_hit_length = request.num_tokens",
    ),
    "window_skips_one_more": (
        "aphrodite.v1.core.single_type_kv_cache_manager",
        "SlidingWindowManager",
        "get_num_skipped_tokens",
        "num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens,",
        "num_computed_tokens - self.sliding_window + 2 - self.extra_retained_tokens,",
    ),
}


def mutated(name: str) -> tuple[type, str, Callable]:
    """``(class, method, mutated function)`` for mutant ``name`` (see :data:`MUTATIONS`)."""
    module_name, class_name, method, old, new = MUTATIONS[name]
    owner = getattr(importlib.import_module(module_name), class_name)
    return owner, method, mutated_method(owner, method, old, new, name)


def _factory(name: str) -> Callable:
    attributes = ("known_divergences", "production_settings")
    return mutant_factory(name, mutated, adapter.make_engine, attributes)


make_lookup_whole_prompt = _factory("lookup_whole_prompt")
make_window_skips_one_more = _factory("window_skips_one_more")
