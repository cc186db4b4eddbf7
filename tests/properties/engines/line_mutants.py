"""One-line mutants of a real engine's source, for the adapter tests.

A mutant rewrites one line of one method at run time: the method's source (decorators
dropped) with ``old`` replaced by ``new`` is compiled in the method's own module, so it
sees the same names. ``old`` must stand exactly once in the method, so a mutant that no
longer fits the engine's code fails loudly instead of silently testing nothing.

Worked example: ``mutated_method(BlockPool, "touch", "ref_cnt += 1", "ref_cnt += 2",
"double_touch")`` returns ``touch`` with that line changed; ``mutant_factory`` wraps an
adapter's ``make_engine`` so that the first engine it builds applies the mutant for the
rest of the process (how a ``--engine tests...:make_NAME`` run uses it).
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from collections.abc import Callable

from reference.layout import KVCacheLayout

_APPLIED: set[str] = set()


def mutated_method(owner: type, method: str, old: str, new: str, name: str) -> Callable:
    """``owner.method`` with its one line ``old`` replaced by ``new`` (see the module)."""
    function = inspect.unwrap(getattr(owner, method))
    source = textwrap.dedent(inspect.getsource(function))
    if source.count(old) != 1:
        raise RuntimeError(f"mutant {name}: {old!r} not found once in {owner.__name__}.{method}")
    source = "\n".join(line for line in source.splitlines() if not line.startswith("@"))
    namespace: dict = {}
    code = compile(source.replace(old, new), f"<mutant {name}>", "exec")
    exec(code, vars(sys.modules[owner.__module__]), namespace)
    return namespace[method]


def mutant_factory(
    name: str,
    mutated: Callable[[str], tuple[type, str, Callable]],
    make_engine: Callable[[KVCacheLayout], object],
    attributes: tuple[str, ...],
) -> Callable[[KVCacheLayout], object]:
    """``make_engine`` that first applies mutant ``name`` (``mutated(name)`` gives its
    class, method and function) once per process, carrying the adapter's ``attributes``."""

    def make(layout: KVCacheLayout) -> object:
        if name not in _APPLIED:
            owner, method, function = mutated(name)
            setattr(owner, method, function)
            _APPLIED.add(name)
        return make_engine(layout)

    for attribute in attributes:
        setattr(make, attribute, getattr(make_engine, attribute))
    make.__name__ = f"make_{name}"
    return make
