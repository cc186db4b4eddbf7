"""SGLang's cache metrics (``--enable-metrics``) recorded in memory, and checked.

SGLang's metric collectors take their metric classes through a dependency-injection
seam of SGLang's own (``_StatLoggerDIMixin``: "subclasses replace these class attributes
with classes that mirror the prometheus_client API but emit through a different
backend", registered per role in ``ServerArgs.stat_loggers``). The engine environment
has no ``prometheus_client``, and SGLang's collectors import it in their constructor, so
:func:`recording_collector` makes a subclass of a collector whose constructor only keeps
the labels; every metric the collector's own methods touch (``self.<metric>.labels(...)
.inc / .set / .observe``) is then a :class:`RecordedMetric`, which adds up what SGLang
reports. The methods that decide what to report are SGLang's.

The adapter reads the totals back (:meth:`Recorded.total`) and compares them with the
copies it observed (``properties/engines/sglang_hicache.py``): every token SGLang counts
as backed up to or loaded back from the host must be one it copied, pool by pool.

Example: after SGLang backs up a node of 4 tokens of the ``kv`` pool,
``collector.total("backup_num_tokens", pool="kv") == 4``.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any


class Recorded:
    """The values a collector's metrics received, by metric attribute and labels."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple[tuple[str, Any], ...]], float] = defaultdict(float)

    def total(self, metric: str, **labels: Any) -> float:
        """The sum over every series of ``metric`` whose labels include ``labels``."""
        wanted = set(labels.items())
        return sum(
            v
            for (name, series), v in self.values.items()
            if name == metric and wanted <= set(series)
        )


class _Series:
    """One labelled series of a :class:`RecordedMetric` (prometheus_client's child)."""

    def __init__(self, recorded: Recorded, key: tuple) -> None:
        self._recorded = recorded
        self._key = key

    def inc(self, amount: float = 1) -> None:
        self._recorded.values[self._key] += amount

    def dec(self, amount: float = 1) -> None:
        self._recorded.values[self._key] -= amount

    def set(self, value: float) -> None:
        self._recorded.values[self._key] = value

    def observe(self, value: float) -> None:
        self._recorded.values[self._key] += value


class RecordedMetric:
    """A counter, gauge or histogram as SGLang's collectors use them: ``labels(**kw)``
    gives a series with ``inc``, ``dec``, ``set`` and ``observe``."""

    def __init__(self, recorded: Recorded, name: str) -> None:
        self._recorded = recorded
        self._name = name

    def labels(self, **labels: Any) -> _Series:
        key = (self._name, tuple(sorted((k, str(v)) for k, v in labels.items())))
        return _Series(self._recorded, key)


def recording_collector(base: type) -> type:
    """A subclass of SGLang's collector class ``base`` whose metrics are
    :class:`RecordedMetric` (module docstring); its ``recorded`` holds the values."""

    def __init__(self: Any, labels: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        self.labels = labels
        self.recorded = Recorded()

    def __getattr__(self: Any, name: str) -> Any:
        if name.startswith("__") or name in ("labels", "recorded"):
            raise AttributeError(name)
        metric = RecordedMetric(self.recorded, name)
        setattr(self, name, metric)
        return metric

    return type(
        f"Recording{base.__name__}", (base,), {"__init__": __init__, "__getattr__": __getattr__}
    )


@functools.cache
def stat_loggers() -> dict[str, type]:
    """``ServerArgs.stat_loggers`` for the radix cache and the storage tier: their
    collectors, recording (SGLang's role names)."""
    from sglang.srt.observability import metrics_collector as mc

    return {
        mc.STAT_LOGGER_ROLE_RADIX_CACHE: recording_collector(mc.RadixCacheMetricsCollector),
        mc.STAT_LOGGER_ROLE_STORAGE: recording_collector(mc.StorageMetricsCollector),
    }
