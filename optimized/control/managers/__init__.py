"""One manager per attention type (:mod:`reference.managers`), on array-backed rows."""

from __future__ import annotations

from optimized.control.managers.base import SingleTypeKVCacheManager
from optimized.control.managers.chunked_local import ChunkedLocalAttentionManager
from optimized.control.managers.full import FullAttentionManager
from optimized.control.managers.mamba import MambaManager
from optimized.control.managers.sliding_window import SlidingWindowManager
from reference.managers import class_for_spec, registry_like
from reference.specs import KVCacheSpec

#: the reference's registry (:func:`reference.managers.registry_like`), optimized classes
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
