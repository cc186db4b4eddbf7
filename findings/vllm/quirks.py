"""Three vLLM 0.33.0 behaviours a spec-faithful reference may not share.

Run: .engines/vllm/bin/python -W ignore findings/vllm/quirks.py

1. SWA with ``w = 1`` registers no block in the prefix cache (``reachable_block_mask``
   keeps the last ``need = cdiv(w - 1, bs) = 0`` blocks of each segment), so a repeated
   prompt never hits and its freed blocks are prepended as unhashed.
2. Chunked local attention reports a hit of whole chunks without any lookup: a prompt
   never seen before, 9 tokens, C 4, bs 2 -> hit 8 with row ``[0, 0, 0, 0]``.
3. Mamba "align" returns the null padding of a step among its new blocks (raw vLLM
   result ``[0, 3]`` for an 8-token first chunk, bs 4); the adapter drops the 0.
"""

from __future__ import annotations

from properties.core.engine import RequestInput
from properties.engines.vllm import make_engine
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def layout(*specs, num_blocks: int = 20) -> KVCacheLayout:
    groups = tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))
    return KVCacheLayout(groups=groups, num_blocks=num_blocks, max_model_len=64)


def swa_w1() -> None:
    e = make_engine(layout(SlidingWindowSpec(block_size=2, sliding_window=1)))
    e.add_request(RequestInput("a", tuple(range(8))))
    e.allocate_slots("a", 8, 0, e.get_computed_blocks("a"))
    e.set_num_computed_tokens("a", 8)
    e.free("a")
    e.add_request(RequestInput("b", tuple(range(8)) + (50, 51, 52)))
    print("1. SWA w=1: cached blocks", e.cached_blocks(), "hit", e.get_computed_blocks("b"))
    print("   free queue after free", e.free_queue()[:6])


def chunked_free_hit() -> None:
    e = make_engine(layout(ChunkedLocalAttentionSpec(block_size=2, attention_chunk_size=4)))
    e.add_request(RequestInput("a", tuple(range(100, 109))))
    print("2. chunked C=4, fresh prompt of 9:", e.get_computed_blocks("a"))


def mamba_null_padding() -> None:
    e = make_engine(layout(FullAttentionSpec(block_size=4), MambaSpec(block_size=4)))
    e.add_request(RequestInput("a", tuple(range(8))))
    hit = e.get_computed_blocks("a")
    e.new_step()
    raw = e.manager.allocate_slots(e.requests["a"], 8, 0, e._hits.pop("a")[1])
    print("3. Mamba first chunk of 8: raw vLLM", raw.get_block_ids(), "hit was", hit)


if __name__ == "__main__":
    swa_w1()
    chunked_free_hit()
    mamba_null_padding()
