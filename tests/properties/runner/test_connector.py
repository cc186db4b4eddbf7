"""The scheduler's KV connector (properties/runner/connector.py): offloads to the host
tier, external hits, detach, and an asynchronous load that fails and is retried; every
expected value is worked out by hand in the comments."""

from __future__ import annotations

from properties.core.engine import RequestInput
from properties.core.modes import ServingMode, load_fails
from properties.core.trace import Arrive, ResetPrefixCache, Step
from properties.runner.connector import Connector
from properties.runner.scheduler import RequestState
from properties.runner.serving import make_scheduler
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, SlidingWindowSpec
from tests.properties.runner.scheduler_support import Recording, full_layout

EXTERNAL = ServingMode(external_hits=True)
FAILING_LOADS = ServingMode(external_hits=True, async_loads=True, load_failures=True)


def _holding(engine: Recording, request_id: str, prompt: tuple[int, ...]) -> RequestState:
    """A request whose whole prompt is allocated and computed (no hit)."""
    state = RequestState(RequestInput(request_id, prompt), ())
    engine.add_request(state.input)
    hit = engine.get_computed_blocks(request_id)
    assert engine.allocate_slots(request_id, len(prompt), 0, hit, 0) is not None
    state.num_computed_tokens = len(prompt)
    state.holds_blocks = True
    return state


def test_release_offloads_the_full_processed_blocks_and_serves_them_back() -> None:
    """Full bs 4: x computes 10 tokens in blocks 1, 2, 3. Its release offloads the blocks
    whose 4 tokens are all processed: 10 // 4 = 2 (blocks 1 and 2, indices 0 and 1).
    y shares x's 10 tokens and adds 2: the tier serves 8 tokens beyond a device hit of
    0 (the largest multiple of 4 below 12 it holds), 4 beyond a device hit of 4."""
    layout = full_layout(block_size=4, num_blocks=8)
    engine = Recording(layout)
    offloads: list[tuple] = []
    connector = Connector(
        engine,
        layout,
        EXTERNAL,
        on_offload=lambda s, g, k, b: offloads.append((s.request_id, g, k, b)),
    )
    x = _holding(engine, "x", tuple(range(10)))
    connector.release(x, 10)
    assert offloads == [("x", 0, 0, 1), ("x", 0, 1, 2)] and len(connector.host_tier) == 2
    y = RequestState(RequestInput("y", tuple(range(10)) + (20, 21)), ())
    assert connector.external_tokens(y, 0) == 8
    assert connector.external_tokens(y, 4) == 4
    # a request released with nothing processed offloads nothing
    z = _holding(engine, "z", tuple(range(30, 38)))
    connector.release(z, 0)
    assert len(offloads) == 2


def test_window_blocks_detach_once_below_the_window() -> None:
    """Full + sliding window w 4 (bs 4), 16 tokens in blocks of both groups. At 8
    processed tokens the window skips 8 - 4 + 1 = 5 tokens: block 0 detaches; again at
    8: nothing more; at 16 (skip 13): blocks 1 and 2. The full group never detaches; the
    release offloads the rest (16 // 4 = 4 blocks per group, minus the detached ones)."""
    layout = KVCacheLayout(
        (
            KVCacheGroup(("l0",), FullAttentionSpec(block_size=4)),
            KVCacheGroup(("l1",), SlidingWindowSpec(block_size=4, sliding_window=4)),
        ),
        num_blocks=40,
        max_model_len=64,
    )
    engine = Recording(layout)
    offloads: list[tuple] = []
    connector = Connector(
        engine, layout, EXTERNAL, on_offload=lambda s, g, k, b: offloads.append((g, k))
    )
    state = _holding(engine, "x", tuple(range(16)))
    connector.processed(state, 8)
    assert offloads == [(1, 0)] and connector.detached["x"] == [0, 1]
    connector.processed(state, 8)
    assert offloads == [(1, 0)]
    connector.processed(state, 16)
    assert offloads == [(1, 0), (1, 1), (1, 2)] and connector.detached["x"] == [0, 3]
    # the release then offloads the full group's 4 blocks and the window's block 3 (still
    # in the window), not the detached ones again
    connector.release(state, 16)
    assert offloads[3:] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 3)]
    assert "x" not in connector.detached


def test_a_failed_load_frees_its_blocks_and_the_retry_loads_them() -> None:
    """Full bs 4. r0 (12 tokens) finishes: its 3 blocks go to the tier; the device cache
    is reset. r2 (r0's 12 tokens, then 4 more) finds no device hit and 12 tokens in the
    tier: it is admitted loading (3 blocks, computed 12, nothing scheduled). Next step:
    its first load fails (``load_fails("r2", 0)``): computed 0, its blocks freed
    uncached (nothing offloaded: 0 tokens processed), looked up again in the same step
    (still no device hit) and loading again. Next step: the retry never fails: the 12
    positions are loaded and committed, and r2 computes 12..15."""
    assert load_fails("r2", 0) and not load_fails("r2", 1)
    layout = full_layout(block_size=4, num_blocks=32, max_model_len=64)
    engine = Recording(layout)
    loads: list[tuple] = []
    scheduler = make_scheduler(
        engine, layout, FAILING_LOADS, on_load=lambda s, a, b: loads.append((s.request_id, a, b))
    )
    connector = scheduler.connector
    assert connector is not None
    scheduler.apply(Arrive("r0", tuple(range(12)), (1,)))
    scheduler.apply(Step(64))
    scheduler.apply(ResetPrefixCache())
    assert len(connector.host_tier) == 3
    scheduler.apply(Arrive("r2", tuple(range(12)) + (50, 51, 52, 53), (2,)))
    assert scheduler.apply(Step(64)).scheduled == []
    assert connector.loading == ["r2"] and connector.loaded == {"r2": (0, 12)}
    engine.take()
    assert scheduler.apply(Step(64)).scheduled == []  # failed, then loading again
    assert engine.take() == [
        ("new_step",),
        ("set_num_computed_tokens", "r2", 0),
        ("get_block_ids", "r2"),
        ("free", "r2"),
        ("get_computed_blocks", "r2"),
        (
            "allocate_slots",
            "r2",
            0,
            0,
            0,
            0,
            ("delay_cache_blocks", True),
            ("num_external_computed_tokens", 12),
        ),
        ("set_num_computed_tokens", "r2", 12),
    ]
    assert loads == [] and connector.num_load_attempts == {"r2": 1}
    assert connector.loading == ["r2"] and scheduler.waiting == []
    retry = scheduler.apply(Step(64))
    [item] = retry.scheduled
    assert (item.hit_tokens, item.external_tokens, item.start, item.num_tokens) == (0, 12, 12, 4)
    assert loads == [("r2", 0, 12)] and retry.finished == ["r2"]
    calls = engine.take()
    assert calls[:3] == [
        ("new_step",),
        ("cache_blocks", "r2", 12),
        ("allocate_slots", "r2", 4, 0, None, 0),
    ]
    # forgotten: the connector keeps nothing of r2
    assert connector.num_load_attempts == {} and connector.loaded == {} and not connector.loading


def test_an_abort_waits_only_for_a_load_in_flight() -> None:
    layout = full_layout(block_size=4, num_blocks=8)
    connector = Connector(Recording(layout), layout, FAILING_LOADS)
    assert connector.defer_abort("x") is False and connector.aborted == set()
    connector.start_load("x", 4, 8)
    assert connector.defer_abort("x") is True and connector.aborted == {"x"}
    assert connector.take_loads() == ["x"] and connector.loading == []
    assert connector.take_loaded("x") == (4, 8) and connector.take_loaded("x") == (0, 0)
    connector.forget("x")
    assert connector.aborted == set()
