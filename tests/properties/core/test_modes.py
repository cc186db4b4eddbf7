"""Serving modes (properties/core/modes.py): what a mode accepts, and the load-failure
rule."""

from __future__ import annotations

import hashlib

import pytest

from properties.core.modes import ServingMode, load_fails
from reference.errors import KVConformError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"async_loads": True}, "async_loads needs external_hits=True"),
        ({"external_hits": True, "load_failures": True}, "load_failures needs async_loads"),
        ({"num_draft_tokens": 5}, r"num_draft_tokens must be an integer in \[0, 4\]"),
        ({"async_scheduling": 1}, "async_scheduling must be a boolean"),
        ({"load_failures": "yes"}, "load_failures must be a boolean"),
        ({"async_scheduling": True, "num_draft_tokens": 2}, "drafts with asynchronous"),
    ],
)
def test_impossible_modes_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(KVConformError, match=message):
        ServingMode(**kwargs)


def test_describe_names_every_part() -> None:
    mode = ServingMode(external_hits=True, async_loads=True, load_failures=True)
    assert mode.describe() == "external_hits async_loads load_failures"
    assert ServingMode().describe() == "sync"


def test_a_first_load_fails_by_the_first_digest_byte_and_a_retry_never() -> None:
    for i in range(20):
        rid = f"r{i}"
        first_byte = hashlib.sha256(f"load:{rid}".encode()).digest()[0]
        assert load_fails(rid, 0) == (first_byte % 2 == 0)
        assert not load_fails(rid, 1) and not load_fails(rid, 7)
    # by hand: the digests of these two ids start with an even and an odd byte
    assert load_fails("r0", 0) and not load_fails("r1", 0)
