"""Old import paths kept for one release: a module that moved stays importable under its
old name, with a :class:`KVConformDeprecationWarning` naming the new import.

``properties/engine.py`` (moved to :mod:`properties.core.engine`; adapters import
:mod:`kvconform` now) is one line::

    alias_module(__name__, "properties.core.engine", "kvconform")

After it, ``import properties.engine`` *is* the module at the new path (the same
objects: ``properties.engine.RequestInput is kvconform.RequestInput``), and the warning
says ``properties.engine is deprecated ...: import from kvconform instead``.

The warning is a ``DeprecationWarning`` subclass that Python shows by default (an
adapter is imported by kvconform, not by ``__main__``, where plain deprecation warnings
are hidden), unless the interpreter was given warning options (``-W``,
``PYTHONWARNINGS``): those decide then.
"""

from __future__ import annotations

import importlib
import sys
import warnings

#: The release that removes the old paths.
REMOVED_IN = "0.2.0"


class KVConformDeprecationWarning(DeprecationWarning):
    """An old kvconform import path; the message names the new one."""


if not sys.warnoptions:
    warnings.filterwarnings("default", category=KVConformDeprecationWarning)


def alias_module(old: str, new: str, public: str) -> None:
    """Make module ``old`` an alias of module ``new`` and warn that ``public`` is the
    import to use. Example: ``alias_module("properties.trace", "properties.core.trace",
    "properties.core.trace")``."""
    warnings.warn(
        f"{old} is deprecated and will be removed in kvconform {REMOVED_IN}: "
        f"import from {public} instead",
        KVConformDeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)
