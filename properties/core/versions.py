"""The versions a failure trace records, so that a failure can be put in context later.

:func:`versions` returns ``{"kvconform", "python", "hypothesis", "torch"}`` (read from the
installed distributions' metadata: nothing is imported) plus ``"engine"`` when the
adapter exposes one (a ``version`` attribute on the engine or its factory). A package
that is not installed reads ``None``. Example: ``versions()["python"] == "3.11.7"``.
Each distribution's metadata is read once per process (every run of a check records the
versions: reading them from disk per run cost more than the run's engine calls).
"""

from __future__ import annotations

import functools
import platform
from importlib import metadata


@functools.cache
def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def versions(*owners: object) -> dict[str, str | None]:
    """The versions of kvconform, Python, Hypothesis, torch and, when one of ``owners``
    (the engine, its factory) has a string ``version`` attribute, the engine's."""
    out: dict[str, str | None] = {
        "kvconform": _dist_version("kvconform"),
        "python": platform.python_version(),
        "hypothesis": _dist_version("hypothesis"),
        "torch": _dist_version("torch"),
    }
    for owner in owners:
        version = getattr(owner, "version", None)
        if isinstance(version, str) and version:
            out["engine"] = version
            break
    return out
