"""Deprecated old path of :mod:`properties.generate.presets` (moved when ``properties/`` was
reorganised); import from ``properties.generate.presets`` instead. Removed in the next release."""

from properties.core.deprecated import alias_module

alias_module(__name__, "properties.generate.presets", "properties.generate.presets")
