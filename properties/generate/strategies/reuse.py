"""One strategy object per distinct arguments, so that a strategy drawn thousands of
times is validated once.

Hypothesis validates a strategy object and computes its properties (is it empty, its
label: for a lambda, from its source) on the object's first draw, and the stateful
machine draws prompts, outputs, pools, specs and steps thousands of times from
factories called anew each time: a third of the draw time went there. What is drawn
is the same: a strategy's draws depend on its definition and arguments, never on which
object it is (the derandomized streams, layouts, operations and engine calls, are
unchanged).

Example: with ``outputs = _reused(outputs_factory)``, ``outputs(layout, 31) is
outputs(layout, 31)``; ``_integers_either((1, 4), (2, 4))`` is one object for those
bounds, drawing as ``st.one_of(st.integers(1, 4), st.integers(2, 4))``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import strategies as st

_Factory = TypeVar("_Factory", bound=Callable[..., Any])


def _reused(factory: _Factory) -> _Factory:
    """``factory`` (a function returning a strategy) returning one object per distinct
    arguments; unhashable arguments (a list) build a new object, as before."""
    memo = functools.lru_cache(maxsize=4096)(factory)

    @functools.wraps(factory)
    def reuse(*args: Any, **kwargs: Any) -> Any:
        try:
            return memo(*args, **kwargs)
        except TypeError as exc:
            if "unhashable" not in str(exc):
                raise
            return factory(*args, **kwargs)

    return reuse  # type: ignore[return-value]


@functools.lru_cache(maxsize=4096)
def _sampled_list(values: tuple) -> st.SearchStrategy:
    """``st.sampled_from(list(values))``, one object per ``values``: the list form (its
    label is computed element by element, unlike a tuple's), as the strategies drew it."""
    return st.sampled_from(list(values))


@functools.lru_cache(maxsize=4096)
def _integers_either(low: tuple[int, int], high: tuple[int, int]) -> st.SearchStrategy[int]:
    """``st.one_of(st.integers(*low), st.integers(*high))``, one object per bounds."""
    return st.one_of(st.integers(*low), st.integers(*high))
