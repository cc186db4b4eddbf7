"""SGLang's storage page hash in Python (``properties/engines/sglang_hash.py``), the seam
that replaced SGLang's JIT-built C++ extension (a build inside the first engine call that
hashed a page: every storage deployment timed out at the call deadline).

The expected digests were produced by SGLang 0.5.23's own extension (``hicache_hash_cpp``,
built from ``sglang/srt/mem_cache/cpp_utils/hash_binding.cpp``) on the same inputs; the
Python hasher must give the same storage keys. Run with ``.engines/sglang/bin/python -W
ignore -m pytest tests/properties/engines/test_sglang_hash.py``.
"""

from __future__ import annotations

import hashlib
from array import array

import pytest

from properties.engines.sglang_hash import PageHasher, load_page_hasher

PRIOR = bytes(range(32))

#: name -> (get_hash's arguments, the extension's answer)
NATIVE = {
    "whole": (
        (array("q", [1, 2, 3]), 3, 1, False, None, None),
        "4636993d3e1da4e9d6b8f87b79e8f7c6d018580d52661950eabc3845c5897a4d",
    ),
    "pages": (
        (array("q", [1, 2, 3]), 3, 1, False, None, 2),
        [
            "34fb5c825de7ca4aea6e712f19d439c1da0c92c37b423936c5f618545ca4fa1f",
            "3ac5d352be720e428633fe34fc74591b2b80060a7764e195d8f34068203ae98f",
        ],
    ),
    "prior_digest_u32_buffer": (
        (array("I", [7, 8, 9, 10]), 4, 1, False, PRIOR, 2),
        [
            "13827b8282c23ddd3d73ab4a1042ce8ad2a9fb08bd09ab26663bcd687d8394d9",
            "d8496427ad39edca4cfe5fd5672151a87522baa2c135db7dd8f252418b124146",
        ],
    ),
    "units_of_two": (
        (array("q", [1, 2, 3, 4, 5, 6]), 3, 2, False, None, 2),
        [
            "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72",
            "ccb860d400a5043f4378cf6408132e442be724ef376ab2f53169b5d9e958f75f",
        ],
    ),
    "bigram": (
        (array("q", [5, 6, 7, 8]), 3, 1, True, None, 2),
        [
            "815792939f86e9c6b410f2cb2741fcb34cfcaf31ea4735b0a5338c1ab8b6ef31",
            "23eb4228798e255477e7e1ef9cc40b0392adac060118604eaa56c39fc8448dab",
        ],
    ),
    "wide_token": (
        (array("q", [1, 2**40, 3]), 3, 1, False, None, 2),
        [
            "74daf9411e6c0c32d9ac28842ed1f75e6bec4330ef5877c1e9c95f0c0d611cf0",
            "4c7b2bb7ad00bb8332277ce996cb01b66eed705858e46ef06dede29be15b8118",
        ],
    ),
    "empty": (
        (array("q", []), 0, 1, False, None, None),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    ),
}


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_the_python_hash_gives_the_extensions_digests(name) -> None:
    args, expected = NATIVE[name]
    assert PageHasher.get_hash(*args) == expected


def test_the_worked_example_chains_little_endian_pages() -> None:
    """The module docstring's example, from the rules alone."""
    d1 = hashlib.sha256(bytes.fromhex("01000000") + bytes.fromhex("02000000")).digest()
    d2 = hashlib.sha256(d1 + bytes.fromhex("03000000")).digest()
    assert PageHasher.get_hash(array("q", [1, 2, 3]), 3, 1, False, None, 2) == [
        d1.hex(),
        d2.hex(),
    ]
    wide = hashlib.sha256(b"\xff" + (2**40).to_bytes(8, "little")).hexdigest()
    assert PageHasher.get_hash(array("q", [2**40]), 1, 1, False, None, None) == wide


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((array("q", [1, 2]), 3, 1, False, None, 2), ValueError, "shorter than logical_len"),
        ((array("q", [1, 2, 3]), 3, 1, True, None, 2), ValueError, "shorter than logical_len"),
        ((array("h", [1, 2]), 2, 1, False, None, 2), ValueError, "itemsize must be 4 or 8"),
        ((array("q", [1, 2]), 2, 1, False, b"short", 2), ValueError, "exactly 32 bytes"),
        ((array("q", [1, 2]), 2, 1, False, None, 0), ValueError, "page_size must be positive"),
        ((array("q", [1, -1]), 2, 1, False, None, 2), IndexError, "non-negative int64"),
        (([1, 2], 2, 1, False, None, 2), TypeError, "bytes-like"),
    ],
)
def test_the_python_hash_refuses_what_the_extension_refuses(args, error, match) -> None:
    with pytest.raises(error, match=match):
        PageHasher.get_hash(*args)


@pytest.mark.engine
def test_sglangs_storage_keys_go_through_the_python_hash() -> None:
    """Once installed, SGLang's own ``get_storage_hash_str`` (its namespace seed for a
    LoRA's pages, its token buffer) and ``get_hash_str`` (a chain on a prior digest) give
    the keys the extension gave."""
    pytest.importorskip("sglang.srt.mem_cache.cpp_utils.native_hash")
    import sglang.srt.mem_cache.cpp_utils.native_hash as native_hash
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str

    from properties.engines import sglang_cpu

    sglang_cpu.install()
    assert native_hash._load_native_hash_module is load_page_hasher
    key = RadixKey(array("q", range(100, 106)), extra_key="lora-a")
    assert get_storage_hash_str(key, None, page_size=2) == [
        "f9bcec8b946f68050b68db1efb3250dd305df0a75b09cd4977fe0c31a957f273",
        "784506036305fe1121b550c1c58f154b8e7714c5c9cd67ebe3848325e26cc3f7",
        "ad2be2000e984dcb99e3c458888c36637ea6f6dc47785ac5b45eb7f9502f8fc8",
    ]
    assert get_hash_str(array("q", [4, 5]), "ab" * 32, page_size=2) == [
        "f4f8b2f61c6e14f69374024f521762a598312d855fc196641840ae9b795f36b7"
    ]
