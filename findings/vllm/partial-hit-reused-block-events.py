"""vLLM 0.33.0 alone: a partial hit crashes get_computed_blocks in the "full" report mode.

Run with the vLLM environment: ``.engines/vllm/bin/python
findings/vllm/partial-hit-reused-block-events.py`` (findings/vllm/
partial-hit-reused-block-events.md): the last line raises ``IndexError: list index out
of range`` in ``BlockPool.emit_cached_block_events``.
"""

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.request import Request

init_none_hash(sha256)
full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16)
mamba = MambaSpec(block_size=8, shapes=((4, 8),), dtypes=(torch.float16,), mamba_cache_mode="align")
groups = [KVCacheGroupSpec(["full"], full), KVCacheGroupSpec(["mamba"], mamba)]
config = KVCacheConfig(num_blocks=11, kv_cache_tensors=[], kv_cache_groups=groups)
manager = KVCacheManager(
    config,
    max_model_len=64,
    scheduler_block_size=8,
    hash_block_size=4,
    enable_caching=True,
    enable_kv_cache_events=True,
)
assert manager.coordinator.enable_partial_hash_hits
hasher = get_request_block_hasher(4, sha256)
prompt = list(range(1, 15))


def request(request_id: str, report_mode: str) -> Request:
    params = SamplingParams(max_tokens=8, extra_args={"kv_cache_report_mode": report_mode})
    return Request(request_id, prompt, params, None, block_hasher=hasher)


a = request("a", "incremental")
# the chunks vLLM's scheduler makes: [0, 8), [8, 12) (the prompt's partial tail), [12, 14)
for chunk in (8, 4, 2):
    manager.new_step_starts()
    manager.allocate_slots(a, chunk)
    a.num_computed_tokens += chunk
    copies, retained = manager.take_kv_cache_block_copies()
    manager.block_pool.free_blocks(retained)
manager.new_step_starts()
print(manager.get_computed_blocks(request("b", "full")))  # IndexError
