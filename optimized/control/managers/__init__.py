"""One manager per attention type (:mod:`reference.managers`), on array-backed rows."""

from __future__ import annotations

from optimized.control.managers.base import SingleTypeKVCacheManager
from optimized.control.managers.chunked_local import ChunkedLocalAttentionManager
from optimized.control.managers.full import FullAttentionManager
from optimized.control.managers.mamba import MambaManager
from optimized.control.managers.sliding_window import SlidingWindowManager
from reference.managers import class_for_spec
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

_MANAGERS: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
}


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
