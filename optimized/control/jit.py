"""Compiled loops through numba, when it is installed (the ``jit`` extra).

:func:`compiled` returns a function compiled by ``numba.njit`` (cached on disk next to its
module), or None when numba is missing or ``KVCONFORM_JIT=0``: the caller then keeps its
numpy path. The compiled functions are plain Python written for numba's subset (scalar
loops over arrays), so ``NUMBA_DISABLE_JIT=1`` runs them as Python (coverage.py sees their
branches) and a test can call them either way. Example: ``compiled(loud_pass)`` is the
decode step's compiled pass, or None.
"""

from __future__ import annotations

import os
from collections.abc import Callable

try:  # an optional dependency
    import numba
except ImportError:  # pragma: no cover - depends on the environment
    numba = None

#: Is compiled code on (numba installed and not turned off by ``KVCONFORM_JIT=0``)?
ENABLED = numba is not None and os.environ.get("KVCONFORM_JIT", "1") != "0"


def compiled(function: Callable) -> Callable | None:
    """``function`` compiled (nopython, no GIL held, cached), or None when off."""
    if not ENABLED:
        return None
    return numba.njit(cache=True, nogil=True)(function)
