"""R1 (reset succeeds iff no request holds blocks) counts only real blocks.

Regression found while the ci streams moved (issue 19): a request whose allocations gave
it only null blocks holds none, so a reset then succeeds on every engine, the reference
included, and the check must accept it.
"""

from __future__ import annotations

from properties.core.modes import ServingMode
from properties.core.trace import Arrive, ResetPrefixCache, Step, Trace
from properties.runner.config import CheckConfig
from properties.runner.run import engine_of, replay_trace
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import SlidingWindowSpec


def test_reset_succeeds_beside_a_request_whose_table_is_all_null() -> None:
    # A window of 1 token (bs 1): the asynchronous load of the one token the host tier
    # holds beyond the device hit of a 2-token prompt lies below the window's skip
    # boundary at once, so the admission allocates nothing (table ((),)) and the pool
    # of 1 usable block stays free: the reset succeeds.
    window = SlidingWindowSpec(
        block_size=1, num_kv_heads=1, head_size=16, dtype_bytes=2, sliding_window=1
    )
    layout = KVCacheLayout(
        groups=(KVCacheGroup(("layer.0",), window),),
        num_blocks=2,
        max_model_len=18,
        max_in_flight_tokens=1,
        use_eagle=True,
    )
    mode = ServingMode(external_hits=True, async_loads=True)
    trace = Trace(
        layout,
        (Arrive("r0", (6, 6), ()), Step(18), ResetPrefixCache()),
        mode=mode,
    )
    config = CheckConfig(engine="reference", level="exact")
    _run, exc = replay_trace(trace, config, engine_of(config, None))
    assert exc is None, exc
