"""Deprecated old path of :mod:`properties.generate.strategies` (moved when ``properties/`` was
reorganised); import from ``properties.generate.strategies`` instead (removed next release)."""

from properties.core.deprecated import alias_module

alias_module(__name__, "properties.generate.strategies", "properties.generate.strategies")
