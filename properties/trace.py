"""Deprecated old path of :mod:`properties.core.trace` (moved in the reorganisation of
``properties/``); import from ``properties.core.trace`` instead. Removed in the next release."""

from properties.core.deprecated import alias_module

alias_module(__name__, "properties.core.trace", "properties.core.trace")
