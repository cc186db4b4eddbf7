"""Deprecated old path of :mod:`properties.core.engine` (moved in the reorganisation of
``properties/``); import from ``kvconform`` instead. Removed in the next release."""

from properties.core.deprecated import alias_module

alias_module(__name__, "properties.core.engine", "kvconform")
