"""LMDeploy 0.18.0: a sequence's forward writes its KV into a block the prefix trie shares.

``BlockTrie.allocate`` (``_extend_trie_path``) attaches every full block of the tokens
the coming forward computes, and on an identity collision substitutes the trie's block
for the sequence's fresh one. The match stops before the last token (``prefix_len +
block_size < num_valid_ids``), so a block the match refused, because this very forward
computes it, is then substituted: the forward writes positions of that block into a
block the trie and the sequence that inserted it own. The block_trie README states the
invariant this breaks: "Never write new KV into a shared trie block".

Run with LMDeploy 0.18.0 installed (``.engines/lmdeploy/bin/python`` here)::

    .engines/lmdeploy/bin/python findings/lmdeploy/trie_dedup_writes_shared_block.py

It schedules A (8 tokens, block size 4) and runs its prefill, then schedules B with the
same 8 tokens while A decodes: B's match accepts block 0 only (B computes tokens 4..7),
yet B's block table holds A's block for positions 4..7, with three owners.
"""

import numpy as np
from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig
from lmdeploy.pytorch.messages import SequenceMeta, UpdateTokenMode
from lmdeploy.pytorch.paging.scheduler import Scheduler
from lmdeploy.pytorch.strategies.ar.sequence import ARSequenceStrategy

BLOCK = 4
cache_config = CacheConfig(
    max_batches=8,
    block_size=BLOCK,
    num_cpu_blocks=0,
    num_gpu_blocks=16,
    enable_prefix_caching=True,
    num_reserved_gpu_blocks=1,
)
scheduler = Scheduler(
    SchedulerConfig(max_batches=8, max_session_len=64),
    cache_config,
    seq_meta=SequenceMeta(BLOCK, strategy=ARSequenceStrategy()),
)
prompt = np.arange(8)

a = scheduler.add_session(0).add_sequence(prompt)
assert scheduler.schedule(is_prefill=True).running == [a]
scheduler.activate_seqs([a])
a.update_token_ids(np.array([100]), mode=UpdateTokenMode.PREFILL)  # A's prefill ran

b = scheduler.add_session(1).add_sequence(prompt)
assert scheduler.schedule(is_prefill=True).running == [b]
table_a, table_b = scheduler.get_block_tables([a, b])
refs = scheduler.block_manager.allocator.get_ref_count(b.logical_blocks.get_real_blocks())
print("A's table:", table_a.tolist())
print("B's table:", table_b.tolist(), "ref counts", refs.tolist())
print("B's forward computes positions", b.num_history_ids, "to", b.num_all_ids - 1)
written = b.num_history_ids // BLOCK
assert table_b[written] == table_a[written], "no substitution"
print(
    f"B writes positions {b.num_history_ids}..{b.num_all_ids - 1} into block "
    f"{table_b[written]}, which A holds and the trie owns (ref count {refs[written]})"
)
