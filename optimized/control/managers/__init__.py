"""One manager per attention type (:mod:`reference.managers`), on array-backed rows."""

from __future__ import annotations

from collections.abc import Iterable

from optimized.control.managers.base import SingleTypeKVCacheManager
from optimized.control.managers.chunked_local import ChunkedLocalAttentionManager
from optimized.control.managers.full import FullAttentionManager
from optimized.control.managers.mamba import MambaManager
from optimized.control.managers.sliding_window import SlidingWindowManager
from reference.managers import MANAGER_CLASSES, class_for_spec
from reference.specs import KVCacheSpec

#: Reference managers the optimized engine does not implement: its factory refuses layouts
#: with their spec types (``properties.engines.optimized.make_engine``).
UNIMPLEMENTED = frozenset({"RSWAManager", "CircularBufferManager"})


def registry_like(
    classes: Iterable[type], unimplemented: frozenset[str] = UNIMPLEMENTED
) -> dict[type[KVCacheSpec], type]:
    """The reference's spec -> manager registry (:data:`reference.managers.MANAGER_CLASSES`)
    with each manager replaced by the class of ``classes`` of the same name (another
    engine's managers), leaving out the ``unimplemented`` ones. Example: the optimized
    managers give ``{FullAttentionSpec: optimized FullAttentionManager, ...}``; a missing
    name (not in ``unimplemented``) raises TypeError."""
    by_name = {cls.__name__: cls for cls in classes}
    names = {spec: cls.__name__ for spec, cls in MANAGER_CLASSES.items()}
    missing = sorted(n for n in names.values() if n not in by_name and n not in unimplemented)
    if missing:
        raise TypeError(f"registry_like: no class named {', '.join(missing)}")
    return {spec: by_name[name] for spec, name in names.items() if name in by_name}


#: the reference's registry (:func:`registry_like`), optimized classes
_MANAGERS = registry_like(
    (
        ChunkedLocalAttentionManager,
        FullAttentionManager,
        MambaManager,
        SlidingWindowManager,
    )
)


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class that serves ``spec`` (:func:`reference.managers.class_for_spec`)."""
    return class_for_spec(spec, _MANAGERS)


__all__ = [
    "ChunkedLocalAttentionManager",
    "FullAttentionManager",
    "MambaManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "manager_class_for",
]
