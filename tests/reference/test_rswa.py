"""Reference sliding-window attention (vLLM 0.33 ``RSWAManager``): the gap between the
prompt and the decode window is freed; everything else is full attention. Check values:
vLLM's own (bs 4, ``W`` 8, ``P`` 16: 28 processed tokens free block index 4, 36 free 5 and
6), the tables and free queues worked out by hand and also run on vLLM 0.33.0."""

from __future__ import annotations

import pytest

from properties.core.engine import RequestInput
from properties.engines.reference import ReferenceEngine
from reference.errors import InvalidSpecError
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import RSWASpec


def test_visible_ranges() -> None:
    spec = RSWASpec(block_size=4, rswa_window=8)
    assert spec.visible_ranges(30, 16) == (range(0, 16), range(23, 31))
    assert spec.visible_ranges(10, 16) == (range(0, 11), range(16, 11))  # inside the prompt
    assert spec.type_name == "rswa"
    with pytest.raises(InvalidSpecError):
        RSWASpec(block_size=4)


def test_gap_behind_the_window_is_freed() -> None:
    spec = RSWASpec(block_size=4, rswa_window=8)
    layout = KVCacheLayout((KVCacheGroup(("l0",), spec),), num_blocks=12, max_model_len=64)
    eng = ReferenceEngine(layout)
    eng.add_request(RequestInput("r", tuple(range(16))))
    assert eng.allocate_slots("r", 16) == ((1, 2, 3, 4),)
    eng.set_num_computed_tokens("r", 16)
    eng.append_output_tokens("r", list(range(100, 112)))  # 28 tokens
    # processed 16: the window starts at max(16, 16 - 8) = 16: no gap yet
    assert eng.allocate_slots("r", 12) == ((5, 6, 7),)
    eng.set_num_computed_tokens("r", 28)
    eng.append_output_tokens("r", list(range(112, 120)))  # 36 tokens
    # processed 28: the gap is blocks [cdiv(16, 4), 20 // 4) = [4, 5): block 5 (cached,
    # to the back of the queue), then 2 new blocks from the front
    assert eng.allocate_slots("r", 8) == ((8, 9),)
    assert eng.get_block_ids("r") == ((1, 2, 3, 4, 0, 6, 7, 8, 9),)
    assert eng.free_queue() == [10, 11, 5]
    eng.set_num_computed_tokens("r", 36)
    eng.append_output_tokens("r", [120])
    # processed 36: [4, 28 // 4) = [4, 7): blocks 7, 6 (index 4 is already null), then
    # the 37th slot's block 10
    assert eng.allocate_slots("r", 1) == ((10,),)
    assert eng.get_block_ids("r") == ((1, 2, 3, 4, 0, 0, 0, 8, 9, 10),)
    assert eng.free_queue() == [11, 5, 7, 6]
    # the prompt's blocks stay: a resend of the prompt hits them (and the gap's, cached)
    eng.add_request(RequestInput("s", tuple(range(16)) + tuple(range(100, 112))))
    hit = eng.get_computed_blocks("s")
    assert (hit.block_ids, hit.num_tokens) == (((1, 2, 3, 4, 5, 6),), 24)
