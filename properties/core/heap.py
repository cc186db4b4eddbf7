"""The objects an engine's import leaves behind are kept out of garbage collection.

A check's process holds what its engine imported: vLLM with torch and its dependencies
leaves about 700,000 objects, every one of which each full collection of the cyclic
garbage collector walks again (about 0.2 s on a busy 2-core machine, several times per
property: a full collection runs whenever the objects that survived younger collections
reach a quarter of the old ones). Once the first engine of a process is built
(:class:`properties.runner.run.TraceRun`), :func:`freeze_imported_heap` collects once and
moves every object alive into the collector's permanent generation (``gc.freeze``):
later collections walk only what the run creates. Nothing changes but the collector's
work: frozen objects are never freed, which holds for modules, classes and the state an
import builds; the few objects alive then that a run later drops stay in memory.

Worked example: after ``freeze_imported_heap()``, ``gc.get_freeze_count()`` is the
number of objects alive at that moment, and a second call does nothing.
"""

from __future__ import annotations

import gc


class _Heap:
    frozen = False


def freeze_imported_heap() -> None:
    """Once per process (a forked child inherits the frozen generation): collect, then
    freeze every object alive now."""
    if _Heap.frozen:
        return
    _Heap.frozen = True
    gc.collect()
    gc.freeze()
