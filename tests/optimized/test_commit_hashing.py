"""The hashing of blocks completed at the end of a step (:func:`commit_updates`,
:func:`hash_completed_blocks`): the fast path (one block of outputs only per request)
and its fallback (a block holding prompt tokens, block 0, several blocks in one commit)
give the chain :func:`optimized.control.hashing.extend_block_hashes` gives the same tokens
as a prompt, and the hand-computed link ``SHA-256(parent || int64 LE tokens || extra)``.
The optimized engine defers that hashing to its next lookup, allocation or step, and skips
it for a request removed in between.

Hand scenario of the engine test: one full-attention group, bs 2 (``H = 2``), prefix
caching on. ``a`` (prompt ``1 2 3``) decodes ``9 8 7 6``: block 1 ``[3, 9]`` spans prompt
and output (fallback), block 2 ``[8, 7]`` is outputs only (fast path). ``b`` (prompt
``1 2 3 9 8 7 6 5``) then hits blocks 0..2 (6 tokens), ``c`` (``1 2 3 9 8 0 0``) blocks
0..1 (4 tokens), in both engines.
"""

from __future__ import annotations

import hashlib
import sys

import pytest

from optimized.control.hashing import ROOT_HASH, key_words
from optimized.control.request import Request, commit_updates, hash_completed_blocks
from properties.core.engine import CacheHit, RequestInput, StepUpdate
from properties.engines.optimized import make_engine
from properties.engines.reference import make_engine as make_reference_engine
from reference.errors import InvalidRequestError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec


def _le(*tokens: int) -> bytes:
    return b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _spy_fallbacks(monkeypatch) -> list[tuple[str, int]]:
    """Record ``(request_id, hashes before)`` of every fallback (per-request) hashing."""
    calls: list[tuple[str, int]] = []
    fallback = Request._hash_new_blocks

    def spy(self: Request) -> None:
        calls.append((self.request_id, len(self.block_hashes)))
        fallback(self)

    monkeypatch.setattr(Request, "_hash_new_blocks", spy)
    return calls


def test_an_output_block_gets_the_hand_computed_link(monkeypatch) -> None:
    # H = 2, prompt [1, 2] (hash 0), outputs 5, 6: block 1 = [5, 6], fast path
    fallbacks = _spy_fallbacks(monkeypatch)
    req = Request("a", [1, 2], 2)
    h0 = _sha(ROOT_HASH + _le(1, 2))
    assert req.block_hashes == [h0]
    assert commit_updates({"a": req}, [("a", 2, 5)]) is None
    assert req.block_hashes == [h0]
    assert commit_updates({"a": req}, [("a", 3, 6)]) is None
    assert fallbacks == []  # the fast path
    assert req.block_hashes == [h0, _sha(h0 + _le(5, 6))]
    assert req.all_token_ids == [1, 2, 5, 6] and req.num_tokens == 4


def test_a_block_spanning_prompt_and_outputs_and_block_zero_fall_back(monkeypatch) -> None:
    # H = 4; "s": prompt [1, 2, 3, 4, 5] then 9, 3, 3 -> block 1 = [5, 9, 3, 3] (fallback);
    # "z": prompt [7], salt "x", LoRA "l", then 8, 9, 10 -> block 0 from outputs (fallback)
    fallbacks = _spy_fallbacks(monkeypatch)
    s = Request("s", [1, 2, 3, 4, 5], 4)
    z = Request("z", [7], 4, cache_salt="x", lora_name="l")
    ups = [("s", 5, 9), ("z", 1, 8), ("s", 6, 3), ("z", 2, 9), ("s", 7, 3), ("z", 3, 10)]
    assert commit_updates({"s": s, "z": z}, ups) is None
    h0 = _sha(ROOT_HASH + _le(1, 2, 3, 4))
    assert s.block_hashes == [h0, _sha(h0 + _le(5, 9, 3, 3))]
    lora = b"L" + (1).to_bytes(8, "little") + b"l"
    salt = b"S" + (1).to_bytes(8, "little") + b"x"
    assert z.block_hashes == [_sha(ROOT_HASH + _le(7, 8, 9, 10) + lora + salt)]
    assert z.block_hashes == Request("w", [7, 8, 9, 10], 4, "x", "l").block_hashes
    assert fallbacks == [("s", 1), ("z", 0)]


def test_two_blocks_in_one_commit_and_a_mixed_batch(monkeypatch) -> None:
    # H = 2: "m" gets 4 outputs in one commit (2 blocks: fallback, then nothing to do at
    # its second completion); "o1", "o2" one output block each (fast path)
    fallbacks = _spy_fallbacks(monkeypatch)
    m = Request("m", [1, 2], 2)
    o1 = Request("o1", [1, 2, 3], 2)
    o2 = Request("o2", [4, 5, 6, 7], 2, lora_name="q")
    commit_updates({"o1": o1, "o2": o2}, [("o1", 3, 9), ("o2", 4, 8)])  # o1 block 1: [3, 9]
    fallbacks.clear()
    reqs = {"m": m, "o1": o1, "o2": o2}
    ups = [("m", 2, 3), ("o1", 4, 5), ("m", 3, 4), ("m", 4, 5), ("o2", 5, 9), ("m", 5, 6)]
    ups.append(("o1", 5, 6))
    assert commit_updates(reqs, [StepUpdate(*u) for u in ups]) is None
    assert fallbacks == [("m", 1), ("m", 3)]  # both blocks at once, then nothing to do
    assert m.block_hashes == Request("x", [1, 2, 3, 4, 5, 6], 2).block_hashes
    assert o1.block_hashes == Request("x", [1, 2, 3, 9, 5, 6], 2).block_hashes
    assert o2.block_hashes == Request("x", [4, 5, 6, 7, 8, 9], 2, None, "q").block_hashes
    assert len(o2.block_hashes) == 3


def test_hash_completed_blocks_leaves_an_up_to_date_request() -> None:
    req = Request("a", [1, 2, 3, 4], 2)
    before = list(req.block_hashes)
    hash_completed_blocks([req, req])
    assert req.block_hashes == before and len(before) == 2


def test_an_unknown_id_stops_after_hashing_the_blocks_before_it() -> None:
    req = Request("a", [1], 2)
    assert commit_updates({"a": req}, [("a", 1, 2), ("nope", 1, 1), ("a", 2, 3)]) == "nope"
    assert req.block_hashes == [_sha(ROOT_HASH + _le(1, 2))]
    assert req.all_token_ids == [1, 2] and req.num_computed_tokens == 1


def test_append_paths_agree_with_commit_and_prompt_hashing() -> None:
    # the per-request calls (one token, several tokens) and commit_updates: same state
    tokens = [5, 6, 7, 8, 9, 10, 11]
    a, b = Request("a", [1, 2, 3], 4), Request("b", [1, 2, 3], 4)
    for t in tokens:
        a.append_token(t)
    b.append_output_token_ids(tokens[:2])
    b.append_output_token_ids(tokens[2:])
    c = Request("c", [1, 2, 3], 4)
    commit_updates({"c": c}, [("c", 3 + i, t) for i, t in enumerate(tokens)])
    whole = Request("w", [1, 2, 3, *tokens], 4)
    for req in (a, b, c):
        assert req.block_hashes == whole.block_hashes and len(whole.block_hashes) == 2
        assert req.all_token_ids == [1, 2, 3, *tokens] and req.num_tokens == 10
        # the chain's words (the key index's form) follow every way of appending
        assert req.block_hashes.words().tolist() == key_words(whole.block_hashes).tolist()


def test_a_token_that_is_not_an_int64_is_refused_when_its_block_is_hashed() -> None:
    req = Request("a", [1], 2)
    with pytest.raises(InvalidRequestError, match="must be int64 integers"):
        commit_updates({"a": req}, [("a", 1, 2**70)])


def _layout() -> KVCacheLayout:
    return KVCacheLayout(
        (KVCacheGroup(("l0",), FullAttentionSpec(block_size=2)),),
        num_blocks=20,
        max_model_len=64,
    )


@pytest.mark.parametrize("make", [make_engine, make_reference_engine], ids=["opt", "ref"])
def test_blocks_of_outputs_are_hit_by_a_later_prompt(make) -> None:
    engine = make(_layout())
    engine.add_request(RequestInput("a", (1, 2, 3)))
    engine.get_computed_blocks("a")
    assert engine.allocate_slots("a", 3, 0, None, 0) is not None
    for computed, token in ((3, 9), (4, 8), (5, 7), (6, 6)):
        if computed > 3:
            engine.new_step()
            assert engine.allocate_slots("a", 1, 0, None, 0) is not None
        if hasattr(engine, "commit_step"):
            engine.commit_step([StepUpdate("a", computed, token)])
        else:
            engine.set_num_computed_tokens("a", computed)
            engine.append_output_tokens("a", [token])
    engine.new_step()
    assert engine.allocate_slots("a", 1, 0, None, 0) is not None  # caches block 2 [8, 7]
    table = engine.get_block_ids("a")[0]
    engine.add_request(RequestInput("b", (1, 2, 3, 9, 8, 7, 6, 5)))
    engine.add_request(RequestInput("c", (1, 2, 3, 9, 8, 0, 0)))
    hit_b, hit_c = engine.get_computed_blocks("b"), engine.get_computed_blocks("c")
    assert (hit_b.num_tokens, hit_c.num_tokens) == (6, 4)
    assert hit_b.block_ids == (table[:3],) and hit_c.block_ids == (table[:2],)


def test_a_hash_list_takes_sixteen_output_blocks_without_moving() -> None:
    # a 2048-token prompt at H = 16: 128 hashes, a list grown one append at a time to a
    # capacity of exactly 128; the 16 spare slots given at creation take 16 more blocks
    # (256 outputs) without a reallocation (the list's size in memory stays the same)
    req = Request("a", list(range(2048)), 16)
    assert len(req.block_hashes) == 128
    size = sys.getsizeof(req.block_hashes)
    ups = [("a", 2048 + i, 7) for i in range(256)]
    assert commit_updates({"a": req}, ups) is None
    assert len(req.block_hashes) == 144
    assert sys.getsizeof(req.block_hashes) == size
    # its words buffer had room too: the 16 decoded blocks' words, then one more (grown)
    assert req.block_hashes.words().tolist() == key_words(req.block_hashes).tolist()
    assert commit_updates({"a": req}, [("a", 2304 + i, 7) for i in range(16)]) is None
    assert req.block_hashes.words().tolist() == key_words(req.block_hashes).tolist()


def test_commit_updates_can_leave_the_hashing_to_the_caller() -> None:
    # H = 2: "a" (prompt [1, 2]) gets 3 then 4 -> block 1 = [3, 4] completed, not hashed
    # until the caller hashes the list it was given
    req = Request("a", [1, 2], 2)
    unhashed: list[Request] = []
    assert commit_updates({"a": req}, [("a", 2, 3), ("a", 3, 4)], unhashed) is None
    assert unhashed == [req] and len(req.block_hashes) == 1
    hash_completed_blocks(unhashed)
    assert req.block_hashes == Request("x", [1, 2, 3, 4], 2).block_hashes


def test_the_engine_hashes_a_commits_blocks_before_the_next_lookup() -> None:
    # "a" decodes 9: block 1 [3, 9] lags after the commit, is hashed by the next lookup
    engine = make_engine(_layout())
    engine.add_request(RequestInput("a", (1, 2, 3)))
    assert engine.allocate_slots("a", 3, 0, None, 0) is not None
    engine.commit_step([StepUpdate("a", 3, 9)])
    req = engine.requests["a"]
    assert len(req.block_hashes) == 1
    engine.add_request(RequestInput("b", (5, 6, 7)))
    assert engine.get_computed_blocks("b").num_tokens == 0
    assert req.block_hashes == Request("x", [1, 2, 3, 9], 2).block_hashes


def test_a_request_removed_before_the_next_call_is_never_hashed() -> None:
    engine = make_engine(_layout())
    engine.add_request(RequestInput("a", (1, 2, 3)))
    assert engine.allocate_slots("a", 3, 0, None, 0) is not None
    engine.commit_step([StepUpdate("a", 3, 9)])
    req = engine.requests["a"]
    engine.free_requests(["a"])
    engine.remove_request("a")
    engine.add_request(RequestInput("a", (1, 2, 3, 9, 8)))  # a new request, same id
    assert engine.get_computed_blocks("a").num_tokens == 2  # block 0 [1, 2] cached
    assert len(req.block_hashes) == 1  # the removed request's block 1 was never hashed


@pytest.mark.parametrize("make", [make_engine, make_reference_engine], ids=["opt", "ref"])
def test_a_preempted_request_hits_the_blocks_its_last_commits_completed(make) -> None:
    # "b" (prompt 1 2 3 9 8) caches [1, 2] and [3, 9]; "a" (prompt 1 2 3) decodes 9 and 8
    # in two commits with no allocation between, is preempted and looked up again: its
    # tokens 1 2 3 9 8 hit both blocks (4 tokens <= 5 - 1) only if [3, 9] was hashed
    engine = make(_layout())
    engine.add_request(RequestInput("b", (1, 2, 3, 9, 8)))
    assert engine.allocate_slots("b", 5, 0, None, 0) is not None
    engine.add_request(RequestInput("a", (1, 2, 3)))
    assert engine.get_computed_blocks("a").num_tokens == 2
    assert engine.allocate_slots("a", 3, 0, None, 0) is not None
    for computed, token in ((3, 9), (4, 8)):
        if hasattr(engine, "commit_step"):
            engine.commit_step([StepUpdate("a", computed, token)])
        else:
            engine.set_num_computed_tokens("a", computed)
            engine.append_output_tokens("a", [token])
    engine.free("a")
    if hasattr(engine, "commit_step"):
        engine.commit_step([StepUpdate("a", 0, None)])
    else:
        engine.set_num_computed_tokens("a", 0)
    b_table = engine.get_block_ids("b")[0]
    assert engine.get_computed_blocks("a") == CacheHit((b_table[:2],), 4)
