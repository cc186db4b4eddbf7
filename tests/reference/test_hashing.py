"""Check values of spec 2.1-2.2: the hash chain, extra keys, coarse views, cache keys."""

from __future__ import annotations

import hashlib
import pickle

from reference.hashing import (
    NONE_HASH,
    block_extra_keys,
    cache_key,
    extend_block_hashes,
    hash_block_tokens,
    hashes_at_block_size,
)
from reference.request import Request

NONE_HEX = "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
H16_BLOCK0 = "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798"
H16_BLOCK1 = "8be7aaa33831156d316f1f463ae57e643deb63f42e633e2d631df88815cc4629"
H4_1234 = "52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a"
H4_5678 = "bee96bce54f5fcaba04c4a3fc2491b30b48e29dbbd38a327d41bc1f76b956dde"
H4_SALT = "45db905e66930a912f81892274e2b4d44bb6b54188f5fe652a03bd11c3fe8c9b"


def test_none_hash_check_value() -> None:
    assert NONE_HASH.hex() == NONE_HEX


def test_h16_chain_check_values() -> None:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(40)), 16)
    assert [h.hex() for h in hashes] == [H16_BLOCK0, H16_BLOCK1]


def test_h4_chain_check_values() -> None:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert [h.hex() for h in hashes] == [H4_1234, H4_5678]


def test_salt_check_value_and_chain() -> None:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8], 4, cache_salt="s")
    assert hashes[0].hex() == H4_SALT
    # block 1 carries no salt key: SHA256(pickle((h0, tokens, None))) with the salted parent
    expected1 = hashlib.sha256(pickle.dumps((hashes[0], (5, 6, 7, 8), None), protocol=5))
    assert hashes[1] == expected1.digest()
    assert hashes[1].hex() != H4_5678  # the salt reaches block 1 through the chain


def test_missing_parent_is_none_hash() -> None:
    assert hash_block_tokens(None, [1, 2, 3, 4], None).hex() == H4_1234
    assert hash_block_tokens(NONE_HASH, [1, 2, 3, 4], None).hex() == H4_1234


def test_extra_keys() -> None:
    # (start, end) of the block's token window: H 4 -> block 1 is (4, 8)
    assert block_extra_keys(0, 4, None, None) is None
    assert block_extra_keys(0, 4, "s", None) == (("cache_salt", "s"),)
    assert block_extra_keys(4, 8, "s", None) is None
    assert block_extra_keys(0, 4, "s", "ad") == (("lora", "ad", "ad"), ("cache_salt", "s"))
    assert block_extra_keys(12, 16, None, "ad") == (("lora", "ad", "ad"),)


def test_lora_changes_every_block() -> None:
    plain: list[bytes] = []
    lora: list[bytes] = []
    extend_block_hashes(plain, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    extend_block_hashes(lora, [1, 2, 3, 4, 5, 6, 7, 8], 4, lora_name="ad")
    expected0 = hashlib.sha256(
        pickle.dumps((NONE_HASH, (1, 2, 3, 4), (("lora", "ad", "ad"),)), protocol=5)
    ).digest()
    assert lora[0] == expected0
    assert lora[0] != plain[0] and lora[1] != plain[1]


def test_only_full_blocks_are_hashed_and_extension_is_incremental() -> None:
    req = Request("r", list(range(10)), 4)
    assert len(req.block_hashes) == 2
    first_two = list(req.block_hashes)
    req.append_output_token_ids([10])
    assert len(req.block_hashes) == 2
    req.append_output_token_ids([11])
    assert len(req.block_hashes) == 3
    assert req.block_hashes[:2] == first_two
    assert req.num_tokens == 12


def test_coarse_view_takes_the_end_boundary_hash() -> None:
    a, b, c, d, e = (bytes([i]) * 32 for i in range(5))
    assert hashes_at_block_size([a, b, c, d], 16, 32) == [b, d]
    assert hashes_at_block_size([a, b, c, d, e], 16, 32) == [b, d]
    assert hashes_at_block_size([a, b, c, d, e], 4, 12) == [c]
    assert list(hashes_at_block_size([a, b], 16, 16)) == [a, b]


def test_cache_key_appends_group_id() -> None:
    h = bytes.fromhex(H4_1234)
    assert cache_key(h, 1).hex() == H4_1234 + "00000001"
    assert cache_key(h, 0).hex() == H4_1234 + "00000000"
    assert cache_key(h, 258)[-4:] == b"\x00\x00\x01\x02"
    assert len(cache_key(h, 7)) == 36
