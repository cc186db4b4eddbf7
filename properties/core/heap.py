"""The garbage collector, set for a check's heap (once per process).

A check allocates millions of short-lived objects (Hypothesis' choices, the checks'
reads of tables and pools), and its large tiers keep a large heap alive (thousands of
requests, the shadow of every block). With CPython's default thresholds (a young
collection every 700 net allocations, a full one whenever the objects that survived
reach a quarter of the old ones) the collector walked that heap over and over: 9.7 s
of 33 s of CPU went to 14,360 collections (90 of them full) in the reference's
invariants property with its production tier. Once the first engine of a process is
built (:class:`properties.runner.run.TraceRun`), :func:`tune_collector`

* raises the young generation's threshold to :data:`YOUNG_THRESHOLD` (never lowers
  it): most short-lived objects are freed by their reference counts before a young
  collection looks at them, and fewer young collections mean fewer full ones (the same
  run: 103 collections, 2 of them full, 0.5 s);
* collects once and moves every object alive into the collector's permanent generation
  (``gc.freeze``): the objects an engine's import leaves (vLLM's with torch: about
  700,000) are no longer walked by each full collection.

Nothing changes but the collector's work. Frozen objects are never freed by the
collector (reference counting still frees them); that holds for modules, classes and
what an import builds. A forked child inherits both settings.

Worked example: after ``tune_collector()``, ``gc.get_threshold()[0] >= 10000`` and
``gc.get_freeze_count()`` is the number of objects alive at that moment; a second call
does nothing.
"""

from __future__ import annotations

import gc
import os

from properties.core.coverage_probe import ENV as COVERAGE_ENV

#: The young generation's collection threshold (net allocations) a check runs with.
YOUNG_THRESHOLD = 10_000


class _Collector:
    tuned = False


def tune_collector() -> None:
    """Once per process: raise the young threshold, collect, freeze what is alive."""
    if _Collector.tuned:
        return
    _Collector.tuned = True
    if os.environ.get(COVERAGE_ENV):
        # engine coverage is measured: collecting and freezing here ended an isolated
        # engine's measurement (the pytest route's toy adapter measured 0 branches);
        # a measuring run keeps the default collector
        return
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_THRESHOLD), middle, old)
    gc.collect()
    gc.freeze()
