"""The garbage collector is set for a check's heap when a process builds its first engine,
once: the young threshold raised, what is alive frozen (``properties/core/heap.py``)."""

from __future__ import annotations

import gc

from properties.core.heap import YOUNG_THRESHOLD, tune_collector
from properties.engines.under_test import resolve_engine
from properties.runner.config import CheckConfig
from properties.runner.run import TraceRun
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec


def test_the_first_engine_run_sets_the_collector_once() -> None:
    layout = KVCacheLayout(
        groups=(KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),),
        num_blocks=8,
        max_model_len=16,
    )
    TraceRun(CheckConfig(), layout, resolve_engine("reference"))
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # the modules and classes imported so far
    assert gc.get_threshold()[0] >= YOUNG_THRESHOLD
    kept = [object() for _ in range(10)]
    tune_collector()
    TraceRun(CheckConfig(), layout, resolve_engine("reference"))
    assert gc.get_freeze_count() == frozen and kept
