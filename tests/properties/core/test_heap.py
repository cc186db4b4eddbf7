"""The heap alive when a process builds its first engine is frozen out of the garbage
collector's walks, once (``properties/core/heap.py``)."""

from __future__ import annotations

import gc

from properties.core.heap import freeze_imported_heap
from properties.engines.under_test import resolve_engine
from properties.runner.config import CheckConfig
from properties.runner.run import TraceRun
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec


def test_the_first_engine_run_freezes_the_heap_once() -> None:
    layout = KVCacheLayout(
        groups=(KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),),
        num_blocks=8,
        max_model_len=16,
    )
    TraceRun(CheckConfig(), layout, resolve_engine("reference"))
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # the modules and classes imported so far
    kept = [object() for _ in range(10)]
    freeze_imported_heap()
    TraceRun(CheckConfig(), layout, resolve_engine("reference"))
    assert gc.get_freeze_count() == frozen and kept
