"""The content model: vectors depend on the whole prefix, salt, LoRA, layer; exact in float32."""

from __future__ import annotations

import struct

from reference.content import ContentModel


def _f32_exact(x: float) -> bool:
    return struct.unpack("f", struct.pack("f", x))[0] == x


def test_same_last_token_different_prefix_gives_different_kv() -> None:
    m = ContentModel()
    a = m.prefix_hashes([5, 9])
    b = m.prefix_hashes([6, 9])
    assert m.key(a, 1, 0) != m.key(b, 1, 0)
    assert m.value(a, 1, 0) != m.value(b, 1, 0)


def test_same_prefix_gives_same_kv_whatever_follows() -> None:
    m = ContentModel()
    a = m.prefix_hashes([5, 9, 1])
    b = m.prefix_hashes([5, 9, 2, 3])
    assert m.key(a, 1, 0) == m.key(b, 1, 0)
    assert m.query(a, 1, 3) == m.query(b, 1, 3)
    assert m.key(a, 2, 0) != m.key(b, 2, 0)


def test_salt_lora_layer_and_seed_change_the_vectors() -> None:
    m = ContentModel()
    plain = m.prefix_hashes([1, 2, 3])
    salted = m.prefix_hashes([1, 2, 3], cache_salt="s")
    lora = m.prefix_hashes([1, 2, 3], lora_name="l")
    assert m.key(plain, 0, 0) != m.key(salted, 0, 0)
    assert m.key(plain, 0, 0) != m.key(lora, 0, 0)
    assert m.key(plain, 0, 0) != m.key(plain, 0, 1)
    other = ContentModel(seed=1)
    assert other.key(other.prefix_hashes([1, 2, 3]), 0, 0) != m.key(plain, 0, 0)


def test_key_value_query_are_different_vectors() -> None:
    m = ContentModel()
    h = m.prefix_hashes([4])
    assert len({m.key(h, 0, 0), m.value(h, 0, 0), m.query(h, 0, 0)}) == 3


def test_shapes_and_range_and_float32_exactness() -> None:
    m = ContentModel(num_kv_heads=2, head_size=3, state_size=5)
    h = m.prefix_hashes(range(50))
    k = m.key(h, 49, 0)
    assert len(k) == 2 and all(len(head) == 3 for head in k)
    assert len(m.state(h, 50, 0)) == 5
    values = [x for p in range(50) for head in m.value(h, p, 2) for x in head]
    assert all(-1.0 <= x < 1.0 for x in values)
    assert all(_f32_exact(x) for x in values)
    assert len(set(values)) == len(values)  # no repeats among 300 24-bit draws here


def test_state_at_boundary_depends_on_the_prefix_before_it() -> None:
    m = ContentModel()
    a = m.prefix_hashes([1, 2, 3, 4])
    b = m.prefix_hashes([1, 2, 7, 4])
    assert m.state(a, 2, 0) == m.state(b, 2, 0)  # tokens[0:2] agree
    assert m.state(a, 3, 0) != m.state(b, 3, 0)
    assert m.state(a, 4, 0) != m.state(b, 4, 0)
    assert m.state(a, 0, 0) == m.state(m.prefix_hashes([]), 0, 0)


def test_extend_hashes_continues_the_same_chain() -> None:
    m = ContentModel()
    whole = m.prefix_hashes([3, 1, 4, 1, 5], cache_salt="x")
    part = m.prefix_hashes([3, 1], cache_salt="x")
    assert m.extend_hashes(part, [4, 1, 5]) == whole
    assert len(whole) == 6
