"""One manager per attention type; all share the block pool.

``manager_class_for(spec)`` picks the class: full, sliding window, chunked local,
Mamba (align mode), reference sliding window (R-SWA), circular buffer.
"""

from __future__ import annotations

from reference.managers.base import SingleTypeKVCacheManager
from reference.managers.chunked_local import ChunkedLocalAttentionManager
from reference.managers.circular_buffer import CircularBufferManager
from reference.managers.full import FullAttentionManager
from reference.managers.mamba import MambaManager
from reference.managers.rswa import RSWAManager
from reference.managers.sliding_window import SlidingWindowManager
from reference.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    RSWASpec,
    SlidingWindowSpec,
)

#: spec type -> the manager class that serves it
MANAGER_CLASSES: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
    RSWASpec: RSWAManager,
    CircularBufferSpec: CircularBufferManager,
}


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class that serves ``spec`` (looked up along the spec's MRO)."""
    return class_for_spec(spec, MANAGER_CLASSES)


def class_for_spec(spec: KVCacheSpec, classes: dict[type[KVCacheSpec], type]) -> type:
    """The class ``classes`` maps ``spec``'s type (or its nearest base) to, for either
    engine's registry. Example: a subclass of ``SlidingWindowSpec`` gets the sliding-window
    manager. An unregistered spec raises TypeError."""
    for cls in type(spec).__mro__:
        if cls in classes:  # pragma: no branch - every spec class is registered
            return classes[cls]
    raise TypeError(  # pragma: no cover - every spec class is registered
        f"no KV cache manager for spec type {type(spec).__name__}"
    )


__all__ = [
    "ChunkedLocalAttentionManager",
    "CircularBufferManager",
    "FullAttentionManager",
    "MambaManager",
    "RSWAManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "manager_class_for",
]
