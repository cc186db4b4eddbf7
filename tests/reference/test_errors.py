"""Every invalid input raises a KVConformError subclass naming the field and value."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from reference.errors import (
    InvalidLayoutError,
    InvalidRequestError,
    InvalidSpecError,
    KVConformError,
)
from reference.kv_cache_manager import KVCacheManager
from reference.layout import KVCacheGroup, KVCacheLayout, group_layers, unify_page_sizes
from reference.request import Request, RequestStatus
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def _manager(max_model_len: int = 16) -> KVCacheManager:
    layout = KVCacheLayout(
        (KVCacheGroup(("l0",), FullAttentionSpec(block_size=2)),),
        num_blocks=16,
        max_model_len=max_model_len,
    )
    return KVCacheManager(layout)


def test_errors_are_value_errors() -> None:
    for cls in (InvalidSpecError, InvalidLayoutError, InvalidRequestError):
        assert issubclass(cls, KVConformError)
    assert issubclass(KVConformError, ValueError)


@pytest.mark.parametrize(
    ("build", "field", "value"),
    [
        (lambda: SlidingWindowSpec(block_size=2, sliding_window=0), "sliding_window", "0"),
        (lambda: SlidingWindowSpec(block_size=2, sliding_window=-3), "sliding_window", "-3"),
        (
            lambda: ChunkedLocalAttentionSpec(block_size=2, attention_chunk_size=0),
            "attention_chunk_size",
            "0",
        ),
        (lambda: FullAttentionSpec(block_size=0), "block_size", "0"),
        (lambda: SlidingWindowSpec(block_size=-1, sliding_window=4), "block_size", "-1"),
        (lambda: MambaSpec(block_size=0), "block_size", "0"),
        (lambda: FullAttentionSpec(block_size=2, num_kv_heads=0), "num_kv_heads", "0"),
        (lambda: FullAttentionSpec(block_size=2, head_size=0), "head_size", "0"),
        (lambda: FullAttentionSpec(block_size=True), "block_size", "True"),
        (lambda: FullAttentionSpec(block_size=2.0), "block_size", "2.0"),
        (lambda: FullAttentionSpec(block_size=2, page_size_padded=1), "page_size_padded", "1"),
        (lambda: MambaSpec(block_size=2, shapes=()), "shapes", "()"),
        (lambda: MambaSpec(block_size=2, shapes=((0, 4),)), "shapes", "(0, 4)"),
    ],
)
def test_invalid_spec(build, field: str, value: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        build()
    assert field in str(info.value)
    assert value in str(info.value)


def test_lcm_larger_than_max_model_len() -> None:
    groups = (
        KVCacheGroup(("a",), FullAttentionSpec(block_size=4)),
        KVCacheGroup(("b",), SlidingWindowSpec(block_size=6, sliding_window=4)),
    )
    with pytest.raises(InvalidLayoutError) as info:
        KVCacheLayout(groups, num_blocks=10, max_model_len=8)
    message = str(info.value)
    assert "max_model_len" in message and "8" in message and "12" in message


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"num_blocks": 1}, "num_blocks", "1"),
        ({"max_model_len": 0}, "max_model_len", "0"),
        ({"groups": ()}, "groups", "()"),
    ],
)
def test_invalid_layout_fields(kwargs, field: str, value: str) -> None:
    args = {
        "groups": (KVCacheGroup(("a",), FullAttentionSpec(block_size=1)),),
        "num_blocks": 8,
        "max_model_len": 8,
        **kwargs,
    }
    with pytest.raises(InvalidLayoutError) as info:
        KVCacheLayout(**args)
    assert field in str(info.value) and value in str(info.value)


@dataclass(frozen=True)
class _OpaqueSpec(KVCacheSpec):
    """A user spec that is neither attention nor Mamba: its page cannot be changed."""

    page: int = 100

    @property
    def page_size_bytes(self) -> int:
        return self.page


def test_page_sizes_that_cannot_be_unified() -> None:
    with pytest.raises(InvalidLayoutError) as info:
        unify_page_sizes([FullAttentionSpec(block_size=16), _OpaqueSpec(block_size=16)])
    assert "100" in str(info.value) and "_OpaqueSpec" in str(info.value)


def test_group_layers_needs_layers() -> None:
    with pytest.raises(InvalidLayoutError) as info:
        group_layers({})
    assert "layer_specs" in str(info.value)


def test_request_longer_than_max_model_len() -> None:
    manager = _manager(max_model_len=16)
    with pytest.raises(InvalidRequestError) as info:
        manager.make_request("long", list(range(17)))
    message = str(info.value)
    assert "'long'" in message and "17" in message and "max_model_len 16" in message


def test_empty_prompt() -> None:
    with pytest.raises(InvalidRequestError) as info:
        Request("e", [], 2)
    assert "prompt_token_ids" in str(info.value) and "'e'" in str(info.value)


def test_nothing_to_do() -> None:
    manager = _manager()
    req = manager.make_request("r", [1, 2, 3])
    with pytest.raises(InvalidRequestError) as info:
        manager.allocate_slots(req, 0)
    assert "num_new_tokens" in str(info.value) and "got 0" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        manager.allocate_slots(req, -1)
    assert "num_new_tokens=-1" in str(info.value)
    assert manager.get_num_free_blocks() == 15


def test_more_tokens_than_the_request_has() -> None:
    manager = _manager()
    req = manager.make_request("r", [1, 2, 3])
    with pytest.raises(InvalidRequestError) as info:
        manager.allocate_slots(req, 4)
    assert "new 4" in str(info.value) and "3 tokens" in str(info.value)


def test_free_unknown_request() -> None:
    manager = _manager()
    req = manager.make_request("ghost", [1, 2, 3])
    with pytest.raises(InvalidRequestError) as info:
        manager.free(req)
    assert "'ghost'" in str(info.value)


def test_free_twice() -> None:
    manager = _manager()
    req = manager.make_request("r", [1, 2, 3])
    manager.allocate_slots(req, 3)
    manager.free(req)
    with pytest.raises(InvalidRequestError) as info:
        manager.free(req)
    assert "'r'" in str(info.value)


def test_allocate_for_finished_request() -> None:
    manager = _manager()
    req = manager.make_request("done", [1, 2, 3])
    req.status = RequestStatus.FINISHED
    with pytest.raises(InvalidRequestError) as info:
        manager.allocate_slots(req, 3)
    assert "'done'" in str(info.value) and "finished" in str(info.value)
    assert manager.get_num_free_blocks() == 15
