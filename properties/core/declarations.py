"""What an adapter declares about its engine, checked when the engine is loaded.

An adapter declares, on its factory (function attributes), in an
:class:`properties.engines.under_test.EngineUnderTest`, or in an ``exec:`` engine's
``hello``: the spec types its engines support (``spec_types``), its documented
divergences (``known_divergences``), the production settings it implements
(``production_settings``, checked by :func:`properties.core.modes.check_production_settings`),
a strategy of the layouts it supports (``layout_strategy``) and its ``version``. Each
checker here takes the declared value and ``where`` (the field, named as the adapter
wrote it) and returns the value in its one form, or raises :class:`DeclarationError`:
one line naming the field and the type expected, a usage error (exit 2).

Worked example: ``check_spec_types("full", "spec_types")`` raises ``spec_types must be a
list of spec type names among full, sliding_window, chunked_local, mamba, got the string
'full'`` (a string would otherwise read as the letters f, u, l, l).
"""

from __future__ import annotations

from collections.abc import Callable

from properties.core.constants import SPEC_KINDS
from properties.core.engine import EngineLoadError, KnownDivergence
from reference.errors import KVConformError


class DeclarationError(EngineLoadError):
    """An adapter's declaration is not of the type its field expects (exit 2)."""


def read_declaration(factory: object, attribute: str, where: str) -> object:
    """``factory.attribute``, or None when it has none; a factory whose attribute lookup
    raises something else (a ``__getattr__`` that raises) is a :class:`DeclarationError`
    naming the attribute. Example: a factory class whose ``__getattr__`` raises
    ``RuntimeError("no")`` gives ``DeclarationError("--engine 'm:f': factory attribute
    spec_types: reading it raised RuntimeError: no")``."""
    try:
        return getattr(factory, attribute, None)
    except KVConformError:  # kvconform's own error (an exec: engine that cannot start)
        raise
    except Exception as exc:  # noqa: BLE001 - any adapter failure is reported as its own
        raise DeclarationError(
            f"{where} {attribute}: reading it raised {type(exc).__name__}: {exc}"
        ) from exc


def check_spec_types(declared: object, where: str) -> tuple[str, ...]:
    """``None`` (all of :data:`SPEC_KINDS`) or a non-empty list or tuple of names among
    them, without repeats. Example: ``["full", "sliding_window"]`` -> ``("full",
    "sliding_window")``; ``["full", "linear"]`` is refused (unknown type ``linear``)."""
    known = ", ".join(SPEC_KINDS)
    if declared is None:
        return SPEC_KINDS
    if isinstance(declared, str):
        raise DeclarationError(
            f"{where} must be a list of spec type names among {known}, got the string {declared!r}"
        )
    if not isinstance(declared, (list, tuple)) or not all(isinstance(k, str) for k in declared):
        raise DeclarationError(
            f"{where} must be a list of spec type names among {known}, got {declared!r}"
        )
    unknown = [k for k in declared if k not in SPEC_KINDS]
    if unknown or not declared or len(set(declared)) != len(declared):
        why = f"unknown {unknown}" if unknown else "empty" if not declared else "repeated names"
        raise DeclarationError(
            f"{where} must be a non-empty list of distinct spec type names among {known}, "
            f"got {list(declared)!r} ({why})"
        )
    return tuple(declared)


def check_known_divergences(
    declared: object, where: str, default_mode: object = None
) -> tuple[KnownDivergence, ...]:
    """``None`` (none) or a list or tuple of :class:`KnownDivergence`, each with a
    callable ``applies``, at most two ``features`` and ``modes`` (if given) false for
    ``default_mode`` (the caller's :data:`properties.core.modes.SYNC`). Example:
    ``(KnownDivergence("x", "...", "findings/x.md", lambda layout: False),)`` is kept;
    ``["x"]`` is refused."""
    if declared is None:
        return ()
    expected = f"{where} must be a list of properties.core.engine.KnownDivergence"
    if not isinstance(declared, (list, tuple)):
        raise DeclarationError(f"{expected}, got {declared!r}")
    for index, item in enumerate(declared):
        if not isinstance(item, KnownDivergence):
            raise DeclarationError(f"{expected}, got {item!r} at index {index}")
        if not callable(item.applies):
            raise DeclarationError(
                f"{where}[{index}].applies must be a callable (layout -> bool), "
                f"got {item.applies!r}"
            )
        if item.modes is not None and (
            not callable(item.modes) or (default_mode is not None and item.modes(default_mode))
        ):
            raise DeclarationError(
                f"{where}[{index}].modes must be a callable (serving mode -> bool) that is "
                f"false for the default synchronous mode, got {item.modes!r}"
            )
        features = item.features
        if (
            not isinstance(features, tuple)
            or len(features) > 2
            or not all(isinstance(f, str) for f in features)
        ):
            raise DeclarationError(
                f"{where}[{index}].features must be a tuple of at most two pair-table "
                f"feature names, got {features!r}"
            )
        if not isinstance(item.checks, tuple) or not all(isinstance(c, str) for c in item.checks):
            raise DeclarationError(
                f"{where}[{index}].checks must be a tuple of invariant names, got {item.checks!r}"
            )
    return tuple(declared)


def check_layout_strategy(declared: object, where: str) -> Callable | None:
    """``None`` or a callable returning a Hypothesis strategy of
    :class:`reference.layout.KVCacheLayout` (what it draws is checked when the engine
    is loaded, :func:`properties.engines.under_test.resolve_engine`)."""
    if declared is not None and not callable(declared):
        raise DeclarationError(
            f"{where} must be a callable returning a Hypothesis strategy of KVCacheLayout, "
            f"got {type(declared).__name__} {declared!r}"
        )
    return declared


def check_version(declared: object, where: str) -> str | None:
    """``None`` or a non-empty string (recorded in failure traces)."""
    if declared is not None and (not isinstance(declared, str) or not declared):
        raise DeclarationError(f"{where} must be a non-empty string, got {declared!r}")
    return declared


def check_flag(declared: object, where: str) -> bool:
    """``True`` or ``False`` (``None``: False)."""
    if declared is None:
        return False
    if not isinstance(declared, bool):
        raise DeclarationError(f"{where} must be True or False, got {declared!r}")
    return declared
