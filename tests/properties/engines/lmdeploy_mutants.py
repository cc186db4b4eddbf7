"""Realistic bugs in LMDeploy 0.18.0's paging code, each one line of its source rewritten
at run time; kvconform's ci profile must catch each. Test fixtures, not part of the
package; they need LMDeploy (``.engines/lmdeploy``).

* ``window_one_block_early``: ``window_block_manager._num_blocks_to_drop`` counts the
  window's blocks without its last one (``win_end - win_start`` for ``win_end -
  win_start + 1``), so the sliding-window manager frees the block holding the window's
  first keys one allocation early: a query then reads keys from a freed block
  (``window_liveness``).
* ``trie_keeps_no_reference``: ``KVBlockLifecycle.commit_path_extension`` forgets the
  trie's own allocator reference to the blocks it attaches (``add_ref_count(..., 0)``),
  so a block a request holds has the reference count of a block only the trie holds:
  it is counted obtainable while held (``pool_accounting_per_pool``: free + held >
  capacity), and it returns to the free pool when the request frees it while the trie
  still serves it as a hit.

Each mutation is applied once per process, when the factory first builds an engine
(:mod:`tests.properties.engines.line_mutants`).

Worked example::

    kvconform check --isolation none --level universal --only invariants \\
        --engine tests.properties.engines.lmdeploy_mutants:make_window_one_block_early
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from properties.engines import lmdeploy as adapter
from tests.properties.engines.line_mutants import mutant_factory, mutated_method

#: name -> (module, owner, function, the line as LMDeploy has it, the mutated line);
#: ``owner`` None: a module-level function
MUTATIONS = {
    "window_one_block_early": (
        "lmdeploy.pytorch.paging.block_manager.window_block_manager",
        None,
        "_num_blocks_to_drop",
        "num_win_blocks = win_end_block_id - win_start_block_id + 1",
        "num_win_blocks = win_end_block_id - win_start_block_id",
    ),
    "trie_keeps_no_reference": (
        "lmdeploy.pytorch.paging.block_trie.kv_lifecycle",
        "KVBlockLifecycle",
        "commit_path_extension",
        "self.allocator.add_ref_count(np.array(ref_blocks), 1)",
        "self.allocator.add_ref_count(np.array(ref_blocks), 0)",
    ),
}


class _ModuleFunctions:
    """A module seen as the owner of its functions, for :func:`mutated_method` (which
    reads ``owner.<name>`` and ``owner.__module__``)."""

    def __init__(self, module) -> None:
        self.__module__ = module.__name__
        self.__name__ = module.__name__
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def mutated(name: str) -> tuple[object, str, Callable]:
    """``(owner, function name, mutated function)`` for mutant ``name``; the owner is the
    class, or the module for a module-level function (set the attribute on it)."""
    module_name, owner_name, function, old, new = MUTATIONS[name]
    module = importlib.import_module(module_name)
    if owner_name is None:
        return module, function, mutated_method(_ModuleFunctions(module), function, old, new, name)
    owner = getattr(module, owner_name)
    return owner, function, mutated_method(owner, function, old, new, name)


def _factory(name: str) -> Callable:
    return mutant_factory(
        name,
        mutated,
        adapter.make_engine,
        ("layout_strategy", "spec_types", "known_divergences", "version"),
    )


make_window_one_block_early = _factory("window_one_block_early")
make_trie_keeps_no_reference = _factory("trie_keeps_no_reference")
