"""LMDeploy 0.18.0: the sliding-window block manager frees blocks inside the window.

``window_block_manager._num_blocks_to_drop`` computes the blocks to drop as
``len(seq.logical_blocks) - num_win_blocks``, where ``num_win_blocks`` counts the blocks
from the one holding ``history - window`` to the one holding ``history - 1``. It takes
every block the sequence holds to lie in that range, but a sequence also holds blocks
past its history: the ``prealloc_size`` tokens its last allocation reserved (16 for a
prefill, ``prefill_interval``). Each such block makes the manager drop one block more
from the front, inside the window the next forward reads (``kv_min_loc = history -
window_size`` in the paged attention kernels); the freed block goes back to the pool
(or straight to the sequence's new tail).

A multi-turn session reaches it: the engine appends the next turn's prompt to the
stopped sequence (``Engine._on_add_message``: ``update_token_ids(..., INPUTS)``,
``activate``), which still holds its preallocated blocks, and the prefill admission
allocates.

Run with LMDeploy 0.18.0 installed (``.engines/lmdeploy/bin/python`` here)::

    .engines/lmdeploy/bin/python findings/lmdeploy/window_overdrop.py

Window 8, block size 4, prefill prealloc 16 (the AR strategy's default): turn 1 is a
12-token prompt and one output token; turn 2 appends 4 tokens. Turn 2's forward reads
keys 4..16 (history 12, window 8), but the manager keeps only positions 16 on.
"""

import numpy as np
from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig
from lmdeploy.pytorch.messages import SequenceMeta, UpdateTokenMode
from lmdeploy.pytorch.paging.scheduler import Scheduler
from lmdeploy.pytorch.strategies.ar.sequence import ARSequenceStrategy

BLOCK, WINDOW, PREALLOC = 4, 8, 16
cache_config = CacheConfig(
    max_batches=8,
    block_size=BLOCK,
    num_cpu_blocks=0,
    num_gpu_blocks=32,
    window_size=WINDOW,
    num_reserved_gpu_blocks=1,
)
scheduler = Scheduler(
    SchedulerConfig(max_batches=8, max_session_len=256),
    cache_config,
    seq_meta=SequenceMeta(BLOCK, strategy=ARSequenceStrategy()),
)
print("block manager:", type(scheduler.block_manager).__name__)

# turn 1: 12-token prompt, prefill with the default prealloc, one output token, finished
seq = scheduler.add_session(0).add_sequence(np.arange(12))
assert scheduler.schedule(is_prefill=True, prealloc_size=PREALLOC).running == [seq]
scheduler.activate_seqs([seq])
seq.update_token_ids(np.array([100]), mode=UpdateTokenMode.PREFILL)
seq.state.finish()  # the request stopped; the session keeps the sequence and its blocks
print(
    "after turn 1: history",
    seq.num_history_ids,
    "blocks",
    seq.num_blocks,
    "(positions 0 ..",
    seq.num_blocks * BLOCK - 1,
    ")",
)

# turn 2: the engine appends the new prompt to the session's sequence and activates it
seq.update_token_ids(np.array([7, 7, 7, 7]), mode=UpdateTokenMode.INPUTS)
seq.activate()
assert scheduler.schedule(is_prefill=True, prealloc_size=PREALLOC).running == [seq]
history = seq.num_history_ids
first_kept = seq.num_ignored_history
print("turn 2: history", history, "-> its forward reads keys from", history - WINDOW)
print(
    "turn 2: the manager dropped positions 0 ..",
    first_kept - 1,
    "and keeps positions",
    first_kept,
    "on",
)
assert first_kept > history - WINDOW, "no over-drop"
print(f"positions {history - WINDOW}..{first_kept - 1} lie in the window and were freed")
