"""Argument checks for the reference's public constructors and calls.

Each helper raises the given :class:`reference.errors.KVConformError` subclass with a
message naming the field and the value, e.g.
``KVCacheLayout.num_blocks must be an integer, got 16.0``. ``bool`` is never accepted
where an integer is meant, nor an integer where a bool is meant.

Worked example: ``require_int(InvalidLayoutError, "KVCacheLayout", "num_blocks", 16.0)``
raises ``InvalidLayoutError("KVCacheLayout.num_blocks must be an integer, got 16.0")``;
``require_bool(InvalidLayoutError, "KVCacheLayout", "enable_caching", "yes")`` raises
``... enable_caching must be a bool (True or False), got 'yes'``.
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.errors import KVConformError


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def require_int(
    error: type[KVConformError], owner: str, field: str, value: object, lowest: int | None = None
) -> None:
    """``value`` is an int (and ``>= lowest`` when given)."""
    if not is_int(value):
        raise error(f"{owner}.{field} must be an integer, got {value!r}")
    if lowest is not None and value < lowest:
        raise error(f"{owner}.{field} must be >= {lowest}, got {value!r}")


def require_bool(error: type[KVConformError], owner: str, field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise error(f"{owner}.{field} must be a bool (True or False), got {value!r}")


def require_str(
    error: type[KVConformError], owner: str, field: str, value: object, optional: bool = False
) -> None:
    """A non-empty string (or None when ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, str) or not value:
        kind = "a non-empty string or None" if optional else "a non-empty string"
        raise error(f"{owner}.{field} must be {kind}, got {value!r}")


def require_token_ids(error: type[KVConformError], owner: str, field: str, value: object) -> None:
    """A sequence (not a string) of ints >= 0."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise error(f"{owner}.{field} must be a sequence of token ids, got {value!r}")
    if all(type(token) is int and token >= 0 for token in value):
        return  # the common case, one pass without a call per token (128k-token prompts)
    for token in value:
        if not is_int(token) or token < 0:
            raise error(f"{owner}.{field} must hold integers >= 0, got {token!r}")


def require_instance(
    error: type[KVConformError], owner: str, field: str, value: object, cls: type
) -> None:
    """``value`` is a ``cls``: ``KVCacheManager.layout must be a KVCacheLayout, got 3``."""
    if not isinstance(value, cls):
        raise error(f"{owner}.{field} must be a {cls.__name__}, got {value!r}")
