"""Helpers of the scheduler tests: a reference engine that records the calls it gets."""

from __future__ import annotations

from properties.engines.reference import make_engine
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec


def full_layout(block_size: int, num_blocks: int, max_model_len: int = 32) -> KVCacheLayout:
    """One full-attention group (block 0 is the null block: ``num_blocks - 1`` usable)."""
    spec = FullAttentionSpec(block_size=block_size)
    return KVCacheLayout(
        (KVCacheGroup(("l0",), spec),), num_blocks=num_blocks, max_model_len=max_model_len
    )


class Recording:
    """The reference engine, recording ``(method, args)`` of the calls that change or read
    request state (``calls``); every other attribute is the engine's own."""

    RECORDED = (
        "new_step",
        "add_request",
        "get_computed_blocks",
        "allocate_slots",
        "set_num_computed_tokens",
        "append_output_tokens",
        "set_in_flight",
        "cache_blocks",
        "get_block_ids",
        "free",
        "remove_request",
    )

    def __init__(self, layout: KVCacheLayout) -> None:
        self.engine = make_engine(layout)
        self.calls: list[tuple] = []
        for name in self.RECORDED:
            setattr(self, name, self._recorder(name, getattr(self.engine, name)))

    def _recorder(self, name: str, method):
        def call(*args, **kwargs):
            shown = tuple(a.num_tokens if hasattr(a, "num_tokens") else a for a in args)
            self.calls.append((name, *shown, *sorted(kwargs.items())))
            return method(*args, **kwargs)

        return call

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def take(self) -> list[tuple]:
        """The calls recorded since the last ``take``."""
        calls, self.calls = self.calls, []
        return calls
