"""kvconform's public API: what an adapter and an engine's CI import.

Everything an adapter needs is importable from this one package; the modules behind it
(``properties.core.engine``, ``reference.layout`` ...) are internal and may move between
releases. The names listed in :data:`__all__` follow the stability promise of
``docs/public-api.md``: within a major version they are neither removed nor renamed, and
their signatures only gain optional arguments.

Worked example (an adapter's imports)::

    from kvconform import CacheHit, KVCacheEngine, KVCacheLayout, RequestInput

    def make_engine(layout: KVCacheLayout) -> KVCacheEngine:
        ...

The groups of names:

* the engine protocol and its optional capabilities: :class:`KVCacheEngine`,
  :class:`ExposesRefCounts`, :class:`ExposesFreeQueue`, :class:`ExposesCachedBlocks`,
  :class:`ReportsAllocationEstimate`, :class:`ReportsPools`, :class:`PlansSteps`,
  :class:`CommitsSteps`, :class:`FreesInBatch`, :class:`ExposesDataPlane`,
  :class:`SupportsServingModes`,
  :class:`HasSelfChecks` (checks the bench turns off), :class:`BuildsAsDeployed` (the
  configuration the bench times), with the
  values they take and return (:class:`RequestInput`, :class:`CacheHit`,
  :class:`CachedBlock`, :class:`PoolUsage`,
  :class:`SlotRequest`, :class:`StepUpdate`, ``BlockIds``, ``EngineFactory``) and
  :class:`KnownDivergence`; the engine under test as one object, :class:`EngineUnderTest`
  (an adapter may export one), and :func:`resolve_engine` (a name, factory or
  ``EngineUnderTest`` loaded, validated and isolated once);
* layouts and specs: :class:`KVCacheLayout`, :class:`KVCacheGroup`, :class:`KVCacheSpec`,
  :class:`AttentionSpec`, :class:`FullAttentionSpec`, :class:`SlidingWindowSpec`,
  :class:`ChunkedLocalAttentionSpec`, :class:`MambaSpec`;
* errors: :class:`KVConformError` (the root; a ``ValueError``), :class:`EngineError`,
  :class:`EngineLoadError`, :class:`CallTimeoutError`, :class:`UnsupportedLayoutError`;
* serving modes: :class:`ServingMode`, :data:`SYNC`, :data:`PRODUCTION_SETTINGS`,
  :data:`MAX_DRAFT_TOKENS`;
* running: :data:`PROPERTIES`, :data:`LEVELS`, :data:`PROFILES`, :data:`DEFAULTS` (the
  defaults the CLI and the pytest plugin share) and :data:`__version__`.
"""

from importlib import metadata as _metadata

from properties.core.constants import DEFAULTS, LEVELS, PROFILES, PROPERTIES, Defaults
from properties.core.engine import (
    BlockIds,
    BuildsAsDeployed,
    CachedBlock,
    CacheHit,
    CallTimeoutError,
    CommitsSteps,
    EngineError,
    EngineFactory,
    EngineLoadError,
    ExposesCachedBlocks,
    ExposesDataPlane,
    ExposesFreeQueue,
    ExposesRefCounts,
    FreesInBatch,
    HasSelfChecks,
    KnownDivergence,
    KVCacheEngine,
    PlansSteps,
    PoolUsage,
    ReportsAllocationEstimate,
    ReportsPools,
    RequestInput,
    SlotRequest,
    StepUpdate,
    SupportsServingModes,
    UnsupportedLayoutError,
)
from properties.core.modes import MAX_DRAFT_TOKENS, PRODUCTION_SETTINGS, SYNC, ServingMode
from properties.engines.under_test import EngineUnderTest, resolve_engine
from reference.errors import KVConformError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

try:
    __version__: str = _metadata.version("kvconform")
except _metadata.PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+unknown"

__all__ = [
    # the engine protocol, its optional capabilities and values
    "KVCacheEngine",
    "ExposesRefCounts",
    "ExposesFreeQueue",
    "ExposesCachedBlocks",
    "ReportsAllocationEstimate",
    "ReportsPools",
    "EngineUnderTest",
    "resolve_engine",
    "PoolUsage",
    "PlansSteps",
    "CommitsSteps",
    "FreesInBatch",
    "ExposesDataPlane",
    "HasSelfChecks",
    "BuildsAsDeployed",
    "SupportsServingModes",
    "RequestInput",
    "CacheHit",
    "CachedBlock",
    "SlotRequest",
    "StepUpdate",
    "BlockIds",
    "EngineFactory",
    "KnownDivergence",
    # layouts and specs
    "KVCacheLayout",
    "KVCacheGroup",
    "KVCacheSpec",
    "AttentionSpec",
    "FullAttentionSpec",
    "SlidingWindowSpec",
    "ChunkedLocalAttentionSpec",
    "MambaSpec",
    # errors
    "KVConformError",
    "EngineError",
    "EngineLoadError",
    "CallTimeoutError",
    "UnsupportedLayoutError",
    # serving modes
    "ServingMode",
    "SYNC",
    "PRODUCTION_SETTINGS",
    "MAX_DRAFT_TOKENS",
    # running
    "PROPERTIES",
    "LEVELS",
    "PROFILES",
    "DEFAULTS",
    "Defaults",
    "__version__",
]


def __dir__() -> list[str]:
    """The public names only (``dir(kvconform)``): what :data:`__all__` promises."""
    return sorted(__all__)
