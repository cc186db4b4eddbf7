"""A toy "engine module" whose branches are known by hand, for test_engine_coverage.py.

The adapter (:mod:`tests.properties.tools.toy_cov_adapter`) calls ``parity(0)`` and
``parity(1)`` when it builds an engine and ``checked_size(n)`` (``n >= 0``) on every
``add_request``; nothing calls ``never_called``. So of the 6 branches of the function
bodies 3 are reached (50.0%), and the unreached ones are ``checked_size``'s jump to its
``raise`` and both of ``never_called``'s. The module-level ``if`` runs at import only
and is not counted.
"""

from __future__ import annotations

import os

if os.environ.get("KVCONFORM_TOY_NEVER_SET"):  # module level: not counted
    PREFIX = "set"
else:
    PREFIX = "unset"


def checked_size(size: int) -> int:
    if size < 0:
        raise ValueError(f"negative size {size}")
    return size


def parity(n: int) -> str:
    if n % 2:
        return "odd"
    return "even"


def never_called(flag: bool) -> int:
    if flag:
        return 1
    return 0
