"""get_computed_blocks (SGLang match_prefix) changes which cached prefix is evicted next.

Run: .engines/sglang/bin/python -W ignore findings/sglang/lookup_refreshes_lru.py
Prints the hit of C after the pool is filled, with and without a lookup of A first.
"""

from properties.core.engine import RequestInput
from properties.engines.sglang import make_engine
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, SlidingWindowSpec

LAYOUT = KVCacheLayout(
    groups=(
        KVCacheGroup(("f",), FullAttentionSpec(block_size=1)),
        KVCacheGroup(("s",), SlidingWindowSpec(block_size=1, sliding_window=4)),
    ),
    num_blocks=11,
    max_model_len=32,
)  # 10 slots per pool


def run(rid, e, prompt):
    e.add_request(RequestInput(rid, tuple(prompt)))
    hit = e.get_computed_blocks(rid)
    assert (
        e.allocate_slots(
            rid, len(prompt) - hit.num_tokens, hit.num_tokens, hit if hit.num_tokens else None
        )
        is not None
    )
    e.set_num_computed_tokens(rid, len(prompt))
    e.free(rid)
    e.remove_request(rid)


def scenario(lookup_a_first: bool) -> tuple[int, int]:
    e = make_engine(LAYOUT)
    run("A", e, [1, 1, 1, 1, 9])  # cached first (older)
    run("B", e, [2, 2, 2, 2, 9])  # cached second (newer)
    if lookup_a_first:  # a lookup that is never followed by allocation
        e.add_request(RequestInput("probe", (1, 1, 1, 1, 5)))
        e.get_computed_blocks("probe")
        e.remove_request("probe")
    run("X", e, [3, 3, 3, 3])  # needs 4 slots: evicts the LRU prefix
    hits = []
    for rid, prompt in (("A2", [1, 1, 1, 1, 5]), ("B2", [2, 2, 2, 2, 5])):
        e.add_request(RequestInput(rid, tuple(prompt)))
        hits.append(e.get_computed_blocks(rid).num_tokens)
    return tuple(hits)


if __name__ == "__main__":
    print("hits (A, B) without lookup:", scenario(False))
    print("hits (A, B) with a lookup of A:", scenario(True))
