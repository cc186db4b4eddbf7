"""The scheduler of a serving mode, assembled from its parts: :func:`make_scheduler`.

Parts (:class:`properties.core.modes.ServingMode`):

* the class: :class:`properties.runner.async_scheduler.AsyncScheduler` for
  ``async_scheduling``, else :class:`properties.runner.scheduler.Scheduler` (the
  synchronous rules and batching; the admission gate and the drafts hook are its own);
* the connector: a :class:`properties.runner.connector.Connector` for ``external_hits``
  on a layout without a Mamba group (loaded Mamba states are not modelled: the mode then
  runs without one), carrying the offload and load observers; for an engine that owns
  its host tier (``OwnsHostTier``) an
  :class:`properties.runner.connector.EngineTierConnector`, which asks the engine.

Example: ``make_scheduler(engine, layout, ServingMode(async_scheduling=True))`` is an
``AsyncScheduler`` without a connector; ``ServingMode(external_hits=True)`` on one full
attention group gives a ``Scheduler`` whose ``connector.host_tier`` holds ``2 *
layout.num_blocks`` blocks.
"""

from __future__ import annotations

from properties.core.engine import KVCacheEngine, OwnsHostTier
from properties.core.modes import SYNC, ServingMode
from properties.runner.async_scheduler import AsyncScheduler
from properties.runner.connector import (
    Connector,
    EngineTierConnector,
    LoadObserver,
    OffloadObserver,
)
from properties.runner.scheduler import Scheduler, StepObserver, mamba_block_size
from reference.host_tier import HostTier
from reference.layout import KVCacheLayout


def connector_host_tier(
    layout: KVCacheLayout, mode: ServingMode, engine: object = None
) -> HostTier | None:
    """The host tier a KV connector of ``mode`` loads from: ``2 * num_blocks`` blocks for
    ``external_hits`` on a layout without a Mamba group, else None (no connector); None
    too for an ``engine`` that owns its host tier (its connector asks the engine). Made
    before the run so the scheduler's connector and the checks share it (X1)."""
    if isinstance(engine, OwnsHostTier):
        return None
    if mode.external_hits and mamba_block_size(layout) is None:
        return HostTier(layout, 2 * layout.num_blocks)
    return None


def make_scheduler(
    engine: KVCacheEngine,
    layout: KVCacheLayout,
    mode: ServingMode = SYNC,
    on_scheduled: StepObserver | None = None,
    on_offload: OffloadObserver | None = None,
    on_load: LoadObserver | None = None,
    host_tier: HostTier | None = None,
) -> Scheduler:
    """The scheduler that serves ``mode`` over ``engine`` (see the module docstring);
    ``on_scheduled`` observes every step after scheduling, ``on_offload`` and ``on_load``
    the connector's offloads and loads (unused without a connector); ``host_tier`` the
    connector's store (default: :func:`connector_host_tier`)."""
    if host_tier is None:
        host_tier = connector_host_tier(layout, mode, engine)
    connector: Connector | None = None
    if host_tier is not None:
        connector = Connector(engine, layout, mode, host_tier, on_offload, on_load)
    elif (
        isinstance(engine, OwnsHostTier) and mode.external_hits and mamba_block_size(layout) is None
    ):
        connector = EngineTierConnector(engine, layout, mode)
    kind = AsyncScheduler if mode.async_scheduling else Scheduler
    return kind(engine, layout, mode, on_scheduled=on_scheduled, connector=connector)
