"""A run of the engine puts torch on one thread (``properties/core/torch_threads.py``): the
attention oracle's tensors are small, and torch's pool of threads spun on them."""

from __future__ import annotations

import torch

from properties.core.torch_threads import torch_on_one_thread
from properties.engines.under_test import resolve_engine
from properties.runner.config import CheckConfig
from properties.runner.run import TraceRun
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec


def test_a_run_with_the_attention_check_puts_torch_on_one_thread() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        layout = KVCacheLayout(
            groups=(KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),),
            num_blocks=8,
            max_model_len=16,
        )
        TraceRun(CheckConfig(attention=True), layout, resolve_engine("reference"))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(3)
        torch_on_one_thread()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
