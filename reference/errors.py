"""Errors raised by the reference model.

Every invalid input raises a subclass of :class:`KVConformError`, itself a
``ValueError``, whose message names the offending field and its value, e.g.
``SlidingWindowSpec.sliding_window must be >= 1, got 0``.
"""

from __future__ import annotations


class KVConformError(ValueError):
    """Base class of every error kvconform raises for bad input."""


class InvalidSpecError(KVConformError):
    """A KV cache spec field is out of range (window, chunk, block size, ...)."""


class InvalidLayoutError(KVConformError):
    """Layers cannot be grouped, pages cannot be unified, or a size is impossible."""


class InvalidRequestError(KVConformError):
    """A request-level call is impossible (unknown request, too long, nothing to do)."""


def require_positive(owner: str, field: str, value: int) -> None:
    """Raise :class:`InvalidSpecError` unless ``value`` is an int >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidSpecError(f"{owner}.{field} must be an integer >= 1, got {value!r}")


def require_given(owner: str, field: str, value: object) -> None:
    """Raise :class:`InvalidSpecError` when a field without a sensible default is missing
    (``SlidingWindowSpec(block_size=16)`` has no window)."""
    if value is None:
        raise InvalidSpecError(f"{owner}.{field} is missing (it has no default)")
