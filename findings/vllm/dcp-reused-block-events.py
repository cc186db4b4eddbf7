"""vLLM 0.33.0 alone: decode context parallelism crashes get_computed_blocks in the "full"
KV event report mode.

Run with the vLLM environment: ``.engines/vllm/bin/python
findings/vllm/dcp-reused-block-events.py`` (findings/vllm/dcp-reused-block-events.md):
the last line raises ``AssertionError`` in ``resolve_block_hashes`` (called by
``BlockPool.emit_cached_block_events``).
"""

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

init_none_hash(sha256)
# one full-attention group of 4 tokens per rank, DCP 2: the manager's blocks hold 8 tokens,
# and so do the hash blocks (resolve_kv_cache_block_sizes: 4 * 2)
full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16)
config = KVCacheConfig(
    num_blocks=9, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["full"], full)]
)
manager = KVCacheManager(
    config,
    max_model_len=64,
    scheduler_block_size=8,
    hash_block_size=8,
    enable_caching=True,
    enable_kv_cache_events=True,
    dcp_world_size=2,
)
hasher = get_request_block_hasher(8, sha256)
prompt = list(range(1, 18))


def request(request_id: str, report_mode: str) -> Request:
    params = SamplingParams(max_tokens=8, extra_args={"kv_cache_report_mode": report_mode})
    return Request(request_id, prompt, params, None, block_hasher=hasher)


a = request("a", "incremental")
manager.allocate_slots(a, len(prompt))  # caches 2 blocks of 8 tokens
manager.new_step_starts()
print(manager.get_computed_blocks(request("b", "full")))  # AssertionError
