"""One ``allocate_slots`` call as a value: :class:`Allocation`, and :func:`allocate`, the
one place that turns it into an engine's call.

The public engine protocol stays ``allocate_slots(request_id, num_new_tokens,
num_new_computed_tokens=0, hit=None, num_lookahead_tokens=0, **serving-mode keywords)``
(:class:`properties.core.engine.KVCacheEngine`): adapters written by users implement it.
Inside the suite an allocation travels as an :class:`Allocation`, whose fields are
exactly those parameters in that order, so a new serving-mode keyword is one new field
here, not one more parameter in every wrapper. A class that takes allocations as values
(:class:`TakesAllocations`: the engine proxies, the reference and optimized adapters)
implements ``allocate(allocation)`` and inherits an ``allocate_slots`` that builds the
value.

:func:`allocate` maps an allocation to an engine: the five protocol arguments by
position (an adapter may name them as it likes) and the serving-mode keywords only when
they are not at their default, so an engine is never handed a keyword of a mode it is
not driven in. Worked example: ``allocate(engine, Allocation("r0", 8, 4, hit,
full_sequence_must_fit=True))`` calls ``engine.allocate_slots("r0", 8, 4, hit, 0,
full_sequence_must_fit=True)``; ``Allocation("r0", 1)`` calls
``engine.allocate_slots("r0", 1, 0, None, 0)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from properties.core.engine import BlockIds, CacheHit


@dataclass(frozen=True)
class Allocation:
    """The arguments of one ``allocate_slots`` call (see the module docstring).

    ``num_new_computed_tokens`` tokens of ``hit`` are adopted (a waiting request's prefix
    hit), ``num_new_tokens`` slots are asked for, plus ``num_lookahead_tokens``
    (speculative slots); the last three fields are the serving-mode keywords
    (:mod:`properties.core.modes`): the admission gate, the tokens a KV connector loads,
    and whether the loaded blocks are cached only once the load completes.
    """

    request_id: str
    num_new_tokens: int
    num_new_computed_tokens: int = 0
    hit: CacheHit | None = None
    num_lookahead_tokens: int = 0
    full_sequence_must_fit: bool = False
    num_external_computed_tokens: int = 0
    delay_cache_blocks: bool = False

    def positional(self) -> tuple[str, int, int, CacheHit | None, int]:
        """The five arguments every engine takes, in the protocol's order."""
        return (
            self.request_id,
            self.num_new_tokens,
            self.num_new_computed_tokens,
            self.hit,
            self.num_lookahead_tokens,
        )

    def keywords(self) -> dict[str, bool | int]:
        """The serving-mode keywords not at their default. Example: an allocation with
        ``full_sequence_must_fit=True`` and no external tokens ->
        ``{"full_sequence_must_fit": True}``; a plain one -> ``{}``."""
        keywords: dict[str, bool | int] = {}
        if self.full_sequence_must_fit:
            keywords["full_sequence_must_fit"] = True
        if self.num_external_computed_tokens:
            keywords["num_external_computed_tokens"] = int(self.num_external_computed_tokens)
        if self.delay_cache_blocks:
            keywords["delay_cache_blocks"] = True
        return keywords

    def describe(self) -> str:
        """The call as reports show it (the hit left out), e.g.
        ``allocate_slots('r0', num_new_tokens=8, num_new_computed_tokens=0,
        num_lookahead_tokens=0, full_sequence_must_fit=True)``."""
        modes = "".join(f", {key}={value}" for key, value in self.keywords().items())
        return (
            f"allocate_slots({self.request_id!r}, num_new_tokens={self.num_new_tokens}, "
            f"num_new_computed_tokens={self.num_new_computed_tokens}, "
            f"num_lookahead_tokens={self.num_lookahead_tokens}" + modes + ")"
        )


class TakesAllocations:
    """A class implementing ``allocate(allocation)``; its ``allocate_slots`` (the
    protocol's call, any arguments of it) builds the :class:`Allocation` and calls it."""

    def allocate_slots(self, *args: Any, **kwargs: Any) -> BlockIds | None:
        """The protocol's ``allocate_slots``: the arguments are :class:`Allocation`'s
        fields, by position or by name."""
        return self.allocate(Allocation(*args, **kwargs))

    def allocate(self, allocation: Allocation) -> BlockIds | None:
        raise NotImplementedError(f"{type(self).__name__}.allocate")


def allocate(engine: Any, allocation: Allocation) -> BlockIds | None:
    """``allocation`` applied to ``engine`` (see the module docstring): its ``allocate``
    directly when it takes allocations and does not redefine ``allocate_slots``, else
    ``allocate_slots`` with the five protocol arguments by position and the serving-mode
    keywords that are not at their default."""
    if (
        isinstance(engine, TakesAllocations)
        and type(engine).allocate_slots is TakesAllocations.allocate_slots
    ):
        return engine.allocate(allocation)
    return engine.allocate_slots(*allocation.positional(), **allocation.keywords())
