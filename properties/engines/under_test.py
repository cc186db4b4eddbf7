"""The engine under test as one value: :class:`EngineUnderTest`, made by :func:`resolve_engine`.

The CLI, the pytest plugin, fuzz, the corpus, the conformance tests and the benches
resolve the engine once (``resolve_engine("vllm")``, ``resolve_engine("pkg.mod:make")``,
``resolve_engine("exec:./engine")`` or ``resolve_engine(factory)``) and pass the result
everywhere; nothing reads a factory's attributes after that.

An adapter declares what it supports in one of two ways, read here and nowhere else:

* it exports an :class:`EngineUnderTest` (``--engine pkg.mod:ENGINE``), or
* it exports a factory with optional function attributes of the same names
  (``spec_types``, ``known_divergences``, ``production_settings``, ``layout_strategy``,
  ``version``; ``enforces_call_timeout`` for a factory that runs its engine in a child
  with its own deadline). An ``exec:`` engine's factory exposes its ``hello``
  declarations as these attributes (:class:`properties.engines.exec_engine.ExecEngineFactory`),
  so they are converted here too.

Every declaration is checked on load (:mod:`properties.core.declarations`): a wrong type
is one line naming the field and the type expected, exit 2. A ``layout_strategy`` is
also tried once: it must return a Hypothesis strategy whose first draw is a
:class:`reference.layout.KVCacheLayout`.

Worked example: the vLLM adapter's factory carries ``known_divergences`` and
``production_settings``, so ``resolve_engine("vllm")`` is ``EngineUnderTest(name="vllm",
factory=make_engine, spec_types=SPEC_KINDS, known_divergences=KNOWN_DIVERGENCES,
production_settings=PRODUCTION_SETTINGS, ...)``; ``resolve_engine("pkg.mod:make")`` with
the default ``isolation="auto"`` and a call timeout wraps ``make`` so that each engine
runs in a child process (``enforces_call_timeout=True``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from properties.core.constants import DEFAULT_CALL_TIMEOUT_S, DEFAULT_ISOLATION, SPEC_KINDS
from properties.core.declarations import (
    DeclarationError,
    check_flag,
    check_known_divergences,
    check_layout_strategy,
    check_spec_types,
    check_version,
    read_declaration,
)
from properties.core.engine import (
    EngineFactory,
    EngineLoadError,
    KnownDivergence,
    KVCacheEngine,
    load_engine_factory,
)
from properties.core.modes import SYNC, ServingMode, check_production_settings
from reference.layout import KVCacheLayout

#: The declarations a factory may carry as function attributes (module docstring).
DECLARED_ATTRIBUTES = (
    "spec_types",
    "known_divergences",
    "production_settings",
    "layout_strategy",
    "version",
    "enforces_call_timeout",
)


@dataclass(frozen=True)
class EngineUnderTest:
    """The engine under test and what its adapter declares (module docstring).

    ``name``: what ``--engine`` named (a built-in name, ``module:factory``,
    ``exec:COMMAND``) or ``module:qualname`` of a factory given as an object;
    ``factory(layout) -> engine``; ``spec_types``: the spec types its engines support
    (all four by default); ``known_divergences``: layouts not drawn, each printed with
    its finding; ``production_settings``: the production layout settings (and the
    ``external`` serving mode) it implements; ``layout_strategy``: a function returning
    a strategy of the layouts it supports, or None; ``enforces_call_timeout``: the
    factory runs its engines under its own deadline (a child killed on time), so no
    in-process one is added; ``version``: the engine's version, recorded in traces.
    Calling it builds an engine: ``engine_under_test(layout)``.
    """

    name: str
    factory: EngineFactory
    spec_types: tuple[str, ...] = SPEC_KINDS
    known_divergences: tuple[KnownDivergence, ...] = ()
    production_settings: frozenset[str] = frozenset()
    layout_strategy: Callable | None = None
    enforces_call_timeout: bool = False
    version: str | None = None

    def __post_init__(self) -> None:
        where = f"engine {self.name!r}: EngineUnderTest"
        if not isinstance(self.name, str) or not self.name:
            raise DeclarationError(f"{where}.name must be a non-empty string, got {self.name!r}")
        if not callable(self.factory):
            raise DeclarationError(
                f"{where}.factory must be a callable (layout -> engine), got {self.factory!r}"
            )
        fields = {
            "spec_types": check_spec_types(self.spec_types, f"{where}.spec_types"),
            "known_divergences": check_known_divergences(
                self.known_divergences, f"{where}.known_divergences", SYNC
            ),
            "production_settings": check_production_settings(
                self.production_settings, f"{where}.production_settings"
            ),
        }
        check_layout_strategy(self.layout_strategy, f"{where}.layout_strategy")
        check_flag(self.enforces_call_timeout, f"{where}.enforces_call_timeout")
        check_version(self.version, f"{where}.version")
        for name, value in fields.items():  # their one form (tuples, frozensets)
            object.__setattr__(self, name, value)

    def __call__(self, layout: KVCacheLayout) -> KVCacheEngine:
        return self.factory(layout)

    def call_timeout(self, requested: float) -> float:
        """The in-process deadline of one call: none (0) when the factory enforces its
        own, else ``requested``. Example: an isolated adapter with ``--call-timeout 5``
        -> 0.0 here (the child is killed after 5 s instead)."""
        return 0.0 if self.enforces_call_timeout else requested

    def serving_mode(
        self,
        drawn: ServingMode,
        supports_serving_modes: bool,
        layout: KVCacheLayout | None = None,
    ) -> ServingMode:
        """What the engine gets of a drawn serving mode: the default one when its engines
        lack the serving calls (:class:`properties.core.engine.SupportsServingModes`), no
        external hits (nor their asynchronous or failed loads) unless it declares the
        ``external`` production setting, and the default one for a run of ``layout``
        that a known divergence of a serving mode applies to
        (:meth:`KnownDivergence.applies_to`). Example: ``ServingMode(async_scheduling=True,
        external_hits=True)`` for an engine declaring only ``retention`` ->
        ``ServingMode(async_scheduling=True)``."""
        if not supports_serving_modes:
            return SYNC
        mode = drawn
        if "external" not in self.production_settings:
            mode = dataclasses.replace(
                mode, external_hits=False, async_loads=False, load_failures=False
            )
        if layout is not None and any(d.applies_to(layout, mode) for d in self.known_divergences):
            return SYNC
        return mode

    def close(self) -> None:
        """Stop the factory's child process, if it has one (exec and isolated engines)."""
        close = getattr(self.factory, "close", None)
        if callable(close):
            close()


def from_factory(name: str, factory: object) -> EngineUnderTest:
    """The one conversion of a factory and its function attributes (or an ``exec:``
    engine's ``hello``, which its factory exposes as those attributes) into an
    :class:`EngineUnderTest`; each one is checked (:mod:`properties.core.declarations`)."""
    if isinstance(factory, EngineUnderTest):
        return factory if factory.name == name else dataclasses.replace(factory, name=name)
    if not callable(factory):
        raise EngineLoadError(
            f"--engine {name!r}: {type(factory).__name__} is not a callable factory"
        )
    where = f"--engine {name!r}: factory attribute"
    declared = {a: read_declaration(factory, a, where) for a in DECLARED_ATTRIBUTES}
    return EngineUnderTest(
        name=name,
        factory=factory,
        spec_types=check_spec_types(declared["spec_types"], f"{where} spec_types"),
        known_divergences=check_known_divergences(
            declared["known_divergences"], f"{where} known_divergences", SYNC
        ),
        production_settings=check_production_settings(
            declared["production_settings"], f"{where} production_settings"
        ),
        layout_strategy=check_layout_strategy(
            declared["layout_strategy"], f"{where} layout_strategy"
        ),
        enforces_call_timeout=check_flag(
            declared["enforces_call_timeout"], f"{where} enforces_call_timeout"
        ),
        version=check_version(declared["version"], f"{where} version"),
    )


def factory_name(factory: object) -> str:
    """``module:qualname`` of a factory given as an object (its name in traces)."""
    module = getattr(factory, "__module__", None) or "?"
    qualname = getattr(factory, "__qualname__", None) or type(factory).__name__
    return f"{module}:{qualname}"


def resolve_engine(
    target: str | Callable | EngineUnderTest,
    *,
    isolation: str = DEFAULT_ISOLATION,
    call_timeout: float = DEFAULT_CALL_TIMEOUT_S,
) -> EngineUnderTest:
    """The engine under test ``target`` names, loaded and checked (module docstring).

    ``target`` is what ``--engine`` takes (a built-in name, ``module:factory``,
    ``module:ENGINE`` naming an :class:`EngineUnderTest`, ``exec:COMMAND``), a factory
    object, or an :class:`EngineUnderTest`. A name is run in a child process when
    ``isolation`` asks for it (:func:`properties.engines.isolation.wants_isolation`); a
    factory or :class:`EngineUnderTest` object runs as given. Raises
    :class:`properties.core.engine.EngineLoadError` (exit 2) when the adapter cannot be
    loaded or a declaration is wrong.
    """
    from properties.engines.isolation import isolated_factory, wants_isolation

    if isinstance(target, str):
        engine = from_factory(target, load_engine_factory(target))
        if wants_isolation(target, isolation, call_timeout):
            child = isolated_factory(target, engine.factory, call_timeout)
            engine = dataclasses.replace(engine, factory=child, enforces_call_timeout=True)
    elif isinstance(target, EngineUnderTest):
        engine = target
    else:
        engine = from_factory(factory_name(target), target)
    try_layout_strategy(engine)
    return engine


def try_layout_strategy(engine: EngineUnderTest) -> None:
    """Draw one layout from the engine's ``layout_strategy`` (if it has one): it must
    return a Hypothesis strategy whose draws are :class:`KVCacheLayout` (checked on load,
    so a wrong one is a usage error, not a failure inside a worker). One derandomized
    example under a settings object of its own: the properties' streams are untouched."""
    if engine.layout_strategy is None:
        return
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import HypothesisException
    from hypothesis.strategies import SearchStrategy

    where = f"--engine {engine.name!r}: layout_strategy"
    try:
        strategy = engine.layout_strategy()
    except Exception as exc:  # noqa: BLE001 - the adapter's own code
        raise DeclarationError(f"{where}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(strategy, SearchStrategy):
        raise DeclarationError(
            f"{where}() must return a Hypothesis strategy of KVCacheLayout, got "
            f"{type(strategy).__name__} {strategy!r:.200}"
        )
    drawn: list[object] = []

    @settings(
        max_examples=1,
        database=None,
        derandomize=True,
        phases=(Phase.generate,),
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def draw_one(layout: object) -> None:
        drawn.append(layout)

    try:
        draw_one()
    except (Exception, HypothesisException) as exc:  # noqa: BLE001 - the adapter's strategy
        raise DeclarationError(
            f"{where}(): drawing a layout raised {type(exc).__name__}: {exc}"
        ) from exc
    if drawn and not isinstance(drawn[0], KVCacheLayout):
        raise DeclarationError(
            f"{where}() must draw KVCacheLayout values, drew {type(drawn[0]).__name__} "
            f"{drawn[0]!r:.200}"
        )


__all__ = ["EngineUnderTest", "from_factory", "resolve_engine", "try_layout_strategy"]
