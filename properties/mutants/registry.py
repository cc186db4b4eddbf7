"""The mutants' catalogue entries and the two helpers every mutant module uses.

A mutant module keeps a :class:`Registry`; each factory is registered where it is
defined, next to the class carrying its bug::

    REGISTRY = Registry(REFERENCE_CATALOGUE, production_settings=PRODUCTION_SETTINGS)

    @REGISTRY.mutant("universal", ["window_liveness"], "sliding window frees ...")
    def make_swa_off_by_one(layout): ...

and :mod:`properties.mutants` collects the registries. :func:`per_manager` builds the
per-manager subclasses of a bug written once as a mixin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from properties.core.engine import KVCacheEngine
from reference.layout import KVCacheLayout

Factory = Callable[[KVCacheLayout], KVCacheEngine]

#: The modules that address mutants on ``--engine`` (``module:make_<name>``): they stay
#: the public names whatever file of ``properties/mutants/`` defines the mutant.
REFERENCE_CATALOGUE = "properties.mutants.reference_mutants"
OPTIMIZED_CATALOGUE = "properties.mutants.optimized_mutants"


@dataclass(frozen=True)
class MutantInfo:
    """One mutant: its bug, the level that catches it and the checks seen firing.

    ``caught_by`` names :class:`properties.checks.invariants.PropertyViolation` names
    (``exact_match`` at the exact level), or fragments of the failure message, observed
    as the first failure under the ``ci`` profile; the tests accept any of them.
    """

    name: str
    description: str
    level: str
    caught_by: frozenset[str]
    factory: Factory
    #: the ``kvconform check`` property whose machine catches it: ``invariants``,
    #: ``production`` for bugs of the deployed settings (retention, EAGLE, async, gate),
    #: ``attention`` for bugs of the data plane
    prop: str = "invariants"
    #: the module that addresses it on ``--engine`` (see :data:`REFERENCE_CATALOGUE`)
    module: str = REFERENCE_CATALOGUE
    #: the large scale tier whose examples catch it (a bug of a path only many requests
    #: at once take), run after the small one as ``kvconform check --tier-examples 20``
    #: runs it; None: the small tier's machine catches it
    tier: str | None = None

    @property
    def target(self) -> str:
        """``module:factory``, as ``--engine`` takes it."""
        return f"{self.module}:{self.factory.__name__}"


class Registry:
    """The mutants of one module, in the order they are defined.

    ``production_settings`` is given to every factory registered (a mutant of the
    reference takes every production setting the reference takes)."""

    def __init__(self, module: str, production_settings: Iterable[str] | None = None) -> None:
        self.module = module
        self.production_settings = (
            None if production_settings is None else frozenset(production_settings)
        )
        self.entries: list[MutantInfo] = []

    def mutant(
        self,
        level: str,
        caught_by: Sequence[str],
        description: str,
        prop: str = "invariants",
        tier: str | None = None,
    ) -> Callable[[Factory], Factory]:
        """Register the decorated ``make_<name>`` factory as mutant ``<name>``."""

        def register(factory: Factory) -> Factory:
            name = factory.__name__.removeprefix("make_")
            info = MutantInfo(
                name, description, level, frozenset(caught_by), factory, prop, self.module, tier
            )
            self.entries.append(info)
            if self.production_settings is not None:
                factory.production_settings = self.production_settings  # type: ignore[attr-defined]
            return factory

        return register


def collect(*registries: Registry) -> dict[str, MutantInfo]:
    """Name -> entry over ``registries``, in order; a name registered twice is an error."""
    out: dict[str, MutantInfo] = {}
    for registry in registries:
        for info in registry.entries:
            if info.name in out:
                raise ValueError(f"mutant {info.name!r} is registered twice")
            out[info.name] = info
    return out


def per_manager(mixin: type, *managers: type) -> dict[Any, Any]:
    """``{manager class: mixin over it}`` for each of ``managers``: one bug, written once
    as ``mixin``, in every single-type manager class it applies to (the mapping
    ``mutated_manager``/``replace_managers`` take). The class built for
    ``FullAttentionManager`` from mixin ``_ExternalCountedTwice`` is
    ``ExternalCountedTwiceFullAttentionManager(_ExternalCountedTwice,
    FullAttentionManager)``."""
    return {
        manager: type(
            mixin.__name__.lstrip("_") + manager.__name__,
            (mixin, manager),
            dict(__doc__=mixin.__doc__, __module__=mixin.__module__),
        )
        for manager in managers
    }
