"""The findings of findings/aphrodite/, each reproduced with Aphrodite 0.24.1's own API only.

Run: .engines/aphrodite/bin/python -W ignore findings/aphrodite/reproduce.py [NAME ...]

Nothing here imports kvconform: every scenario builds Aphrodite's ``KVCacheManager`` (or
its request hasher) directly, drives it the way Aphrodite's scheduler does, and prints
what Aphrodite does next to what vLLM 0.33.0 does on the same calls (the expected value,
stated in each scenario's docstring and checked by hand against vLLM 0.33.0). Exit status
1 when any scenario reproduced (Aphrodite differs from the expectation), 0 otherwise.

* ``eagle-sparse-retention-no-hit``: EAGLE + sparse retention (Aphrodite's default
  ``prefix_cache_retention_interval=0``), full attention + sliding window: a resend of a
  16-token prompt hits 0 tokens (vLLM 0.33: 12).
* ``mamba-async-state-leak``: a Mamba "align" group under asynchronous scheduling
  (Aphrodite's default): a 48-token prompt prefilled in 8-token chunks holds the state
  block of every chunk (6) instead of the last ones (3).
* ``chunked-hit-in-previous-chunk``: chunked-local attention with ``C = 6``, ``bs = 4``:
  a fresh 9-token prompt "hits" 4 tokens whose block is the null block.
* ``lora-name-salt-collision``: a request with LoRA adapter ``"tenant-a"`` and one with
  ``cache_salt="tenant-a"`` (no LoRA) share the hash of their first block.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

os.environ.setdefault("APHRODITE_LOGGING_LEVEL", "ERROR")

import torch  # noqa: E402
from aphrodite.lora.request import LoRARequest  # noqa: E402
from aphrodite.sampling_params import SamplingParams  # noqa: E402
from aphrodite.utils.hashing import sha256  # noqa: E402
from aphrodite.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from aphrodite.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
)
from aphrodite.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from aphrodite.v1.request import Request  # noqa: E402

init_none_hash(sha256)


def attention(cls: type, block_size: int, **extra: int):
    return cls(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16, **extra)


def manager(specs: list, num_blocks: int, max_len: int, hash_block_size: int, **kw):
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    retention = kw.pop("retention", None)
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=retention,
    )
    return KVCacheManager(
        config,
        max_model_len=max_len,
        scheduler_block_size=hash_block_size,
        hash_block_size=hash_block_size,
        **kw,
    )


def request(rid: str, tokens: list[int], hash_block_size: int, **kw) -> Request:
    hasher = get_request_block_hasher(hash_block_size, sha256)
    params = SamplingParams(max_tokens=8)
    return Request(rid, tokens, params, None, block_hasher=hasher, **kw)


def eagle_sparse_retention_no_hit() -> tuple[object, object]:
    """Full attention (bs 4) + sliding window (bs 4, w 8), EAGLE, retention 0. Request
    ``a`` computes a 16-token prompt and is freed; ``b`` sends the same prompt.

    vLLM 0.33.0: ``b`` hits 12 tokens (the full group matches 16, EAGLE drops a block;
    the window kept the tail ending on 12 because sparse retention keeps the positions
    an EAGLE hit drops back to). Aphrodite keeps only the tail ending on
    ``(16 - 1) // 4 * 4 = 12`` and no block below it, so the EAGLE drop to 8 finds no
    window: 0."""
    specs = [
        attention(FullAttentionSpec, 4),
        attention(SlidingWindowSpec, 4, sliding_window=8),
    ]
    m = manager(specs, 24, 32, 4, retention=0, use_eagle=True)
    prompt = list(range(1, 17))
    a = request("a", prompt, 4)
    blocks, hit, _ = m.get_computed_blocks(a)
    m.allocate_slots(a, 16, hit, blocks)
    a.num_computed_tokens = 16
    m.free(a)
    b = request("b", prompt, 4)
    _, hit, _ = m.get_computed_blocks(b)
    return hit, 12


def mamba_async_state_leak() -> tuple[object, object]:
    """One Mamba group, ``mamba_cache_mode="align"``, bs 4; a 48-token prompt prefilled
    in six 8-token chunks under asynchronous scheduling: each ``allocate_slots`` runs
    while the previous chunk is still in flight (``request.num_in_flight_tokens = 8``).

    vLLM 0.33.0 holds 3 blocks afterwards (the states of the last two chunks and the one
    before, still read by the step in flight); Aphrodite 6, one per chunk: its skip walk
    (``SingleTypeKVCacheManager._remove_blocks_in_range``) stops at the first null gap
    of the row ``[null, s1, null, s2, ...]``, and ``MambaManager.remove_skipped_blocks``
    frees only ``last_state_block_idx``, which the next allocation has already moved
    past under the one-step lag."""
    spec = MambaSpec(
        block_size=4, shapes=((4, 8),), dtypes=(torch.float16,), mamba_cache_mode="align"
    )
    m = manager([spec], 24, 64, 4)
    r = request("r", list(range(1, 49)), 4)
    blocks, hit, _ = m.get_computed_blocks(r)
    for chunk in range(6):
        r.num_in_flight_tokens = 8 if chunk else 0  # the previous chunk, not processed
        m.allocate_slots(r, 8, hit if chunk == 0 else 0, blocks if chunk == 0 else None)
        r.num_computed_tokens += 8
    held = [b for b in m.get_block_ids("r")[0] if b != 0]
    return len(held), 3


def chunked_hit_in_previous_chunk() -> tuple[object, object]:
    """Chunked-local attention, ``C = 6``, bs 4, nothing cached; a 9-token prompt.

    Expected (the sound hit): 0 tokens. Aphrodite (as vLLM 0.33.0): 4 tokens with the
    null block for tokens 0..3, which tokens 4 and 5 attend to (chunk ``[0, 6)``)."""
    spec = attention(ChunkedLocalAttentionSpec, 4, attention_chunk_size=6)
    m = manager([spec], 16, 32, 4)
    r = request("r", list(range(9)), 4)
    blocks, hit, _ = m.get_computed_blocks(r)
    return (hit, blocks.get_block_ids()), (0, ([],))


def lora_name_salt_collision() -> tuple[object, object]:
    """The hashes of the first block of a request with LoRA adapter ``"tenant-a"`` and
    of one with ``cache_salt="tenant-a"`` and no adapter, same 4 tokens.

    Expected: different (vLLM 0.33.0 tags each extra key: ``("lora", name, path)``,
    ``("cache_salt", salt)``). Aphrodite: equal, both hash the extra keys
    ``("tenant-a",)``; so the salted request is served KV that the adapter computed."""
    lora = LoRARequest("tenant-a", 1, "/adapters/tenant-a")
    with_lora = request("a", [1, 2, 3, 4], 4, lora_request=lora)
    with_salt = request("b", [1, 2, 3, 4], 4, cache_salt="tenant-a")
    return with_lora.block_hashes[0] == with_salt.block_hashes[0], False


SCENARIOS: dict[str, Callable[[], tuple[object, object]]] = {
    "eagle-sparse-retention-no-hit": eagle_sparse_retention_no_hit,
    "mamba-async-state-leak": mamba_async_state_leak,
    "chunked-hit-in-previous-chunk": chunked_hit_in_previous_chunk,
    "lora-name-salt-collision": lora_name_salt_collision,
}


def main(names: list[str]) -> int:
    reproduced = 0
    for name in names or list(SCENARIOS):
        got, expected = SCENARIOS[name]()
        status = "REPRODUCED" if got != expected else "not reproduced"
        reproduced += got != expected
        print(f"{name}: Aphrodite gives {got!r}, expected {expected!r}: {status}")
    return 1 if reproduced else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
