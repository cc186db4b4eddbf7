"""Block lifecycles as vLLM 0.33's KV block metrics collector records them, when it samples
every block (``kv_cache_metrics``, sample rate 1): which blocks it tracks and the
eviction events it emits.

Rules (:class:`BlockLifecycles`):

* a block's life starts when the pool hands it out (``get_new_blocks``: new tokens,
  external tokens); handing out a block that is in a life already ends that life with
  an eviction event when prefix caching is on (the pool evicts a block it reuses), and
  replaces it silently when caching is off;
* a hit that adopts a block (``touch``) is an access of its life; an event carries the
  gaps between the last accesses, at most four accesses kept, so ``min(accesses, 4) - 1``
  gaps (none below two accesses);
* a reset of the prefix cache forgets every life and the events not taken yet.

Worked example (caching on): blocks 1 and 2 handed out, 1 adopted by two hits, then 1
handed out again: one event with ``min(2, 4) - 1 = 1`` gap; blocks 1 (a new life) and 2
are tracked. After five hits of block 2 and its reuse: an event with 3 gaps.
"""

from __future__ import annotations

from collections.abc import Iterable

#: accesses a life keeps (vLLM's ``access_history``)
MAX_ACCESSES = 4


class BlockLifecycles:
    """The collector's state (module docstring): per tracked block, the accesses of its
    life; the events not taken yet, each as its number of reuse gaps."""

    def __init__(self, enable_caching: bool) -> None:
        self.enable_caching = enable_caching
        self.accesses: dict[int, int] = {}
        self.events: list[int] = []

    def handed_out(self, block_ids: Iterable[int]) -> None:
        for block in block_ids:
            if self.enable_caching and block in self.accesses:
                self.events.append(max(0, min(self.accesses[block], MAX_ACCESSES) - 1))
            self.accesses[block] = 0

    def adopted(self, block_ids: Iterable[int]) -> None:
        for block in block_ids:
            if block in self.accesses:
                self.accesses[block] += 1

    def reset(self) -> None:
        self.accesses.clear()
        self.events.clear()

    def take_events(self) -> list[int]:
        events, self.events = self.events, []
        return events


__all__ = ["MAX_ACCESSES", "BlockLifecycles"]
