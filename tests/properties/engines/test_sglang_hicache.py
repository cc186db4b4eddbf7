"""Hand-written scenarios for SGLang's host tier (HiCache) and storage tier (L3) behind
the SGLang adapter (``properties/engines/sglang_hicache.py``, ``docs/sglang-on-cpu.md``).

Layout: one full group and one SWA group (w 4, SGLang's window 3) of bs 2, 16 device
pages per pool. Expected values follow from SGLang's allocators on a fresh pool (device
pages from 1 upwards, host slots from 0 upwards: host block ``slot // 2 + 1``).
Run with ``.engines/sglang/bin/python -W ignore -m pytest
tests/properties/engines/test_sglang_hicache.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from properties.core.engine import (
    HOST_FETCH,
    HOST_LOAD,
    HOST_STORE,
    HOST_WRITE,
    OwnsHostTier,
    RequestInput,
)
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, SlidingWindowSpec

pytestmark = pytest.mark.engine

_ROOT = Path(__file__).resolve().parents[3]
if not (_ROOT / ".engines" / "sglang" / ".kvconform-complete").exists():
    pytest.skip("SGLang is not installed (.engines/sglang)", allow_module_level=True)
pytest.importorskip("sglang.srt.mem_cache.unified_radix_cache")

from properties.engines.sglang import (  # noqa: E402
    HICACHE_DEPLOYMENTS,
    SGLangEngine,
    hicache_deployment,
)
from properties.engines.sglang_cpu import transfer_kv_direct  # noqa: E402
from properties.engines.sglang_hicache import HiCacheConfig  # noqa: E402

PROMPT = tuple(range(100, 124))  # 24 tokens: 12 pages of 2


def _layout(max_len: int = 48) -> KVCacheLayout:
    return KVCacheLayout(
        groups=(
            KVCacheGroup(("full",), FullAttentionSpec(block_size=2)),
            KVCacheGroup(("swa",), SlidingWindowSpec(block_size=2, sliding_window=4)),
        ),
        num_blocks=17,
        max_model_len=max_len,
    )


def _engine(config: HiCacheConfig | None) -> SGLangEngine:
    return SGLangEngine(_layout(), hicache=config)


def _run(engine: SGLangEngine, rid: str, prompt: tuple[int, ...], external: int = 0) -> tuple:
    """Admit ``rid`` (its device hit, ``external`` tokens from the host tier), compute the
    prompt in one step, free it; the hit's length and the allocation's answer."""
    engine.add_request(RequestInput(rid, prompt))
    engine.new_step()
    hit = engine.get_computed_blocks(rid)
    new = engine.allocate_slots(
        rid,
        len(prompt) - hit.num_tokens - external,
        hit.num_tokens,
        hit if hit.num_tokens else None,
        num_external_computed_tokens=external,
    )
    assert new is not None
    table = engine.get_block_ids(rid)
    engine.set_num_computed_tokens(rid, len(prompt))
    engine.free(rid)
    engine.remove_request(rid)
    return hit.num_tokens, table


def _evict_everything(engine: SGLangEngine) -> None:
    """A request of 30 fresh tokens (15 pages of the 16): the device pools keep none of
    what came before, the host pool (32 pages at ratio 2) has room for both."""
    _run(engine, "x", tuple(range(1000, 1030)))
    engine.new_step()


def test_the_cpu_copy_moves_rows_between_layers() -> None:
    import torch

    src = [torch.arange(12.0).view(6, 2), torch.arange(12.0, 24.0).view(6, 2)]
    dst = [torch.zeros(6, 2), torch.zeros(6, 2)]
    transfer_kv_direct(src, dst, torch.tensor([4, 5]), torch.tensor([0, 3]), page_size=2)
    assert dst[0].tolist() == [[8, 9], [0, 0], [0, 0], [10, 11], [0, 0], [0, 0]]
    assert dst[1][3].tolist() == [22, 23]
    with pytest.raises(ValueError, match="2 source rows, 1 destination rows"):
        transfer_kv_direct(src, dst, torch.tensor([4, 5]), torch.tensor([0]), page_size=2)


def test_deployments_follow_the_layout_and_five_in_six_have_a_host_tier() -> None:
    assert sum(d is not None for d in HICACHE_DEPLOYMENTS) == 5
    assert sum(d is not None and d.storage == "file" for d in HICACHE_DEPLOYMENTS) == 3
    layout = _layout()
    assert hicache_deployment(layout) == hicache_deployment(_layout())
    without = SGLangEngine(layout, hicache=None)
    assert isinstance(without, OwnsHostTier) and without.host_pools() == ()


def test_write_through_backs_a_request_up_at_its_insert() -> None:
    """Write-through: A's 12 pages are inserted at its free and backed up at the next
    step's poll, page by page into host blocks 1..12 (host slots 0..23); its SWA window
    pages too. The host pool of ratio 2 (64 slots, 32 pages) then holds 12 full pages."""
    engine = _engine(HiCacheConfig("write_through", 2.0))
    _, table = _run(engine, "a", PROMPT)
    assert engine.take_host_transfers() == []  # queued, not copied yet
    queued = engine.host_pools()[0]
    assert len(queued.held) == 12 and queued.in_flight == tuple(range(1, 13))
    engine.new_step()
    writes = [t for t in engine.take_host_transfers() if t.group_id == 0]
    assert [(t.kind, t.device_block, t.host_block) for t in writes] == [
        (HOST_WRITE, block, i + 1) for i, block in enumerate(table[0])
    ]
    full = engine.host_pools()[0]
    assert (full.name, full.num_blocks, full.num_free) == ("full", 33, 21)
    assert sorted(full.held) == list(range(1, 13)) and full.in_flight == ()
    # SGLang's own counter (--enable-metrics, recorded) agrees: 12 pages of 2 tokens
    recorded = engine.cache.metrics_collector.recorded
    assert recorded.total("backup_num_tokens", pool="kv") == 24
    assert recorded.total("load_back_num_tokens", pool="kv") == 0


def test_the_metrics_audit_catches_a_counter_that_disagrees_with_the_copies() -> None:
    from properties.core.engine import EngineError

    engine = _engine(HiCacheConfig("write_through", 2.0))
    _run(engine, "a", PROMPT)
    engine.new_step()
    engine.cache.metrics_collector.backup_num_tokens.labels(pool="kv").inc(2)
    with pytest.raises(EngineError, match=r"backup_num_tokens\[pool=kv\] says 26 tokens"):
        engine.host.audit_metrics()


def test_an_evicted_prefix_is_a_host_hit_and_loads_back() -> None:
    """After A's device pages are evicted, B (A + 2 tokens) hits nothing on the device and
    24 tokens on the host; admitted with them as external tokens, its first 12 full
    blocks are the pages the load filled, and the host pages they came from are A's."""
    engine = _engine(HiCacheConfig("write_through", 2.0))
    _run(engine, "a", PROMPT)
    engine.new_step()
    written = {
        t.host_block: t.device_block for t in engine.take_host_transfers() if t.group_id == 0
    }
    _evict_everything(engine)
    engine.take_host_transfers()
    engine.add_request(RequestInput("b", PROMPT + (5, 6)))
    hit = engine.get_computed_blocks("b")
    assert (hit.num_tokens, engine.host_hit("b")) == (0, 24)
    new = engine.allocate_slots("b", 2, 0, None, num_external_computed_tokens=24)
    assert new is not None
    loads = [t for t in engine.take_host_transfers() if t.kind == HOST_LOAD and t.group_id == 0]
    table = engine.get_block_ids("b")
    assert [t.device_block for t in loads] == list(table[0][:12])
    assert sorted(t.host_block for t in loads) == sorted(written)
    # the load is acknowledged at the next poll: its pages then pin nothing
    engine.new_step()
    assert engine.host_pools()[0].in_flight == ()


def test_write_back_backs_up_only_when_the_device_evicts() -> None:
    engine = _engine(HiCacheConfig("write_back", 2.0))
    _run(engine, "a", PROMPT)
    engine.new_step()
    assert engine.take_host_transfers() == [] and engine.host_pools()[0].held == ()
    _evict_everything(engine)
    writes = [t for t in engine.take_host_transfers() if t.kind == HOST_WRITE]
    assert writes and engine.host_pools()[0].held
    engine.add_request(RequestInput("b", PROMPT + (5, 6)))
    assert engine.get_computed_blocks("b").num_tokens == 0 and engine.host_hit("b") == 24


def test_the_storage_tier_serves_a_prefix_after_a_reset() -> None:
    """With the file-backed storage tier, A's pages reach storage one poll after their
    host backup; a reset drops the device and host tiers, and B fetches A's 12 full pages
    (and its SWA window) back from storage at arrival: a host hit of 24 tokens."""
    engine = _engine(HiCacheConfig("write_through", 2.0, storage="file"))
    _run(engine, "a", PROMPT)
    engine.new_step()
    engine.new_step()
    stores = [t for t in engine.take_host_transfers() if t.kind == HOST_STORE]
    assert len([t for t in stores if t.group_id == 0]) == 12
    assert len(os.listdir(engine.host.storage_dir)) == len(stores)
    assert engine.reset_prefix_cache()
    engine.add_request(RequestInput("b", PROMPT + (5, 6)))
    fetches = [t for t in engine.take_host_transfers() if t.kind == HOST_FETCH]
    assert {t.storage_key for t in fetches if t.group_id == 0} == {
        t.storage_key for t in stores if t.group_id == 0
    }
    assert engine.get_computed_blocks("b").num_tokens == 0 and engine.host_hit("b") == 24


def test_a_short_host_hit_loads_when_its_window_is_on_the_host() -> None:
    """SGLang's load-back declines fewer than ``load_back_threshold`` (10) Full-KV tokens
    only when no other component has state to load. A 5-token prompt publishes 4 tokens
    (2 pages); once evicted, its SWA window is on the host too, so the 4 tokens load
    (``host_hit`` 4) although 4 < 10: the tier's own rule, read through
    ``build_load_back_spec``, not restated by the adapter."""
    engine = _engine(HiCacheConfig("write_through", 2.0))
    short = tuple(range(200, 205))
    _run(engine, "a", short)
    engine.new_step()
    _evict_everything(engine)
    engine.add_request(RequestInput("b", short))
    assert engine.get_computed_blocks("b").num_tokens == 0
    assert engine.cache.load_back_threshold == 10
    assert engine.host_hit("b") == 4
    assert engine.allocate_slots("b", 1, 0, None, num_external_computed_tokens=4) is not None


STAGED = HiCacheConfig(
    "write_through", 2.0, storage="file", prefetch_policy="best_effort", staged_storage=True
)


def _stored_then_reset(engine: SGLangEngine) -> None:
    """A's pages reach storage (its host backup at the first poll, the storage write at
    the next), then a reset drops the device and host tiers."""
    _run(engine, "a", PROMPT)
    engine.new_step()
    engine.new_step()
    engine.take_host_transfers()
    assert engine.reset_prefix_cache()


def test_a_staged_storage_fetches_over_two_polls() -> None:
    """A staged storage queries B's prompt at the first poll after B arrived (12 full
    pages hit, the host pages allocated and staging), reads them at the next: then B's
    24 tokens are a host hit."""
    engine = _engine(STAGED)
    _stored_then_reset(engine)
    engine.add_request(RequestInput("b", PROMPT + (5, 6)))
    engine.new_step()
    full = next(p for p in engine.host_pools() if p.name == "full")
    assert len(full.staging) == 12 and full.num_free == full.num_blocks - 12
    assert not [t for t in engine.take_host_transfers() if t.kind == HOST_FETCH]
    engine.new_step()
    fetched = [t for t in engine.take_host_transfers() if t.kind == HOST_FETCH]
    assert len([t for t in fetched if t.group_id == 0]) == 12
    full = next(p for p in engine.host_pools() if p.name == "full")
    assert full.staging == () and len(full.held) == 12
    assert engine.get_computed_blocks("b").num_tokens == 0 and engine.host_hit("b") == 24


def test_an_admission_before_the_read_takes_nothing_and_the_read_releases_the_pages() -> None:
    """best_effort: B admitted between the two polls ends its prefetch with nothing
    read (host hit 0); the 12 host pages stay staging until the next poll, when the
    read, finding the prefetch terminated, acknowledges and SGLang releases them."""
    engine = _engine(STAGED)
    _stored_then_reset(engine)
    engine.add_request(RequestInput("b", PROMPT + (5, 6)))
    engine.new_step()
    assert engine.get_computed_blocks("b").num_tokens == 0 and engine.host_hit("b") == 0
    full = next(p for p in engine.host_pools() if p.name == "full")
    assert len(full.staging) == 12 and full.held == ()
    engine.new_step()
    assert not [t for t in engine.take_host_transfers() if t.kind == HOST_FETCH]
    for pool in engine.host_pools():
        assert pool.staging == () and pool.num_free == pool.num_blocks


def test_staged_storage_needs_the_best_effort_policy() -> None:
    with pytest.raises(ValueError, match="best_effort"):
        HiCacheConfig("write_through", 2.0, storage="file", staged_storage=True)


REACH_CASE = "sglang-staged-storage-prefetch"


def test_the_staged_storage_case_runs_its_checks_under_the_call_deadline(monkeypatch) -> None:
    """The scenario that timed out (CallTimeoutError at add_request / new_step, 0 s of
    CPU): a storage deployment's first page hash ran SGLang's JIT build of its C++ hash
    inside the call. With the Python hasher installed the reach case of the staged
    storage (a prefix stored, then a prefetch the admission terminates before its read
    and one read over two polls and loaded back) replays with every check and the 5 s
    call deadline, and torch's extension builder is never called (it fails the test if
    it is). The scenario itself is asserted: staging pages at an admission, storage
    fetches, a load-back."""
    import torch.utils.cpp_extension as cpp_extension

    from properties.engines import sglang_hicache
    from properties.engines.under_test import resolve_engine
    from properties.runner.config import CheckConfig
    from properties.runner.reach import load_reach_corpus
    from properties.runner.run import replay_trace

    def no_build(*args, **kwargs):
        raise AssertionError("SGLang's native hash was JIT-built inside an engine call")

    monkeypatch.setattr(cpp_extension, "load", no_build)
    seen: dict[str, int] = {"staging_at_admission": 0, "fetch": 0, "load": 0}
    prefetch_done, record = sglang_hicache.HostTier.prefetch_done, sglang_hicache.HostTier._record

    def counted_prefetch_done(self, req):
        seen["staging_at_admission"] += sum(len(p.staging) for p in self.pools(False))
        return prefetch_done(self, req)

    def counted_record(self, kind, transfers, done):
        seen["load"] += kind == HOST_LOAD
        return record(self, kind, transfers, done)

    record_storage = sglang_hicache.HostTier._record_storage

    def counted_storage(self, kind, role, keys, host):
        seen["fetch"] += len(keys) if kind == HOST_FETCH else 0
        return record_storage(self, kind, role, keys, host)

    monkeypatch.setattr(sglang_hicache.HostTier, "prefetch_done", counted_prefetch_done)
    monkeypatch.setattr(sglang_hicache.HostTier, "_record", counted_record)
    monkeypatch.setattr(sglang_hicache.HostTier, "_record_storage", counted_storage)
    case = next(c for c in load_reach_corpus() if c.name == REACH_CASE)
    assert hicache_deployment(case.trace.layout) == HICACHE_DEPLOYMENTS[4]
    assert HICACHE_DEPLOYMENTS[4].staged_storage
    config = CheckConfig(engine="sglang", level="universal")
    assert config.call_timeout == 5
    run, failure = replay_trace(case.trace, config, resolve_engine("sglang", call_timeout=5))
    assert failure is None and run is not None
    assert seen["staging_at_admission"] > 0 and seen["fetch"] > 0 and seen["load"] > 0


# -- HiCache on the Mamba layouts: what SGLang's build needs (issue 39) -----------------
#
# The adapter deploys no host tier on Mamba layouts yet. These scenarios pin down, in
# SGLang's own terms, what ``init_hicache`` requires there and that it builds on CPU: the
# hybrid host stack is chosen by the device KV pool's class (``HybridLinearKVPool`` for
# full + Mamba, as SGLang's pool configurator builds it for a hybrid model; ``SWAKVPool``
# for full + SWA + Mamba), and ``MambaPoolHost`` accepts only the ``page_first`` and
# ``page_first_direct`` host layouts (the adapter's host tier uses ``layer_first``).


def _mamba_hicache(with_swa: bool, mem_layout: str, linear_pool: bool):
    """SGLang's cache for the adapter's Mamba layout (41 pages, 5 state slots) with the
    host tier attached by ``init_hicache`` (write-through, ratio 2, direct copies in
    ``mem_layout``); ``linear_pool``: full + Mamba over ``HybridLinearKVPool`` (else the
    adapter's ``MHATokenToKVPool``). Returns the cache."""
    import atexit
    import dataclasses

    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    from properties.engines import sglang as adapter
    from properties.engines.sglang_hicache import deployed
    from tests.properties.engines.test_sglang_adapter import mamba_layout

    layout = mamba_layout(with_swa)
    engine = SGLangEngine(layout, hicache=None)
    m, cfg = engine._m, engine.config
    allocator = engine.allocator
    if linear_pool and not with_swa:
        heads, head_dim = adapter._heads(layout)
        pool = HybridLinearKVPool(
            size=cfg.pool_tokens,
            dtype=engine.kv_pool.dtype,
            page_size=cfg.page_size,
            head_num=heads,
            head_dim=head_dim,
            full_attention_layer_ids=[1],
            device="cpu",
            mamba_pool=engine.req_to_token_pool.mamba_pool,
        )
        allocator = m["TokenToKVPoolAllocator"](
            size=cfg.pool_tokens, dtype=pool.dtype, device="cpu", kvcache=pool, need_sort=False
        )
    ct = m["ComponentType"]
    components = (ct.FULL,) + ((ct.SWA,) if with_swa else ()) + (ct.MAMBA,)
    params = m["CacheInitParams"](
        disable=False,
        req_to_token_pool=engine.req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=cfg.page_size,
        sliding_window_size=cfg.sglang_window if with_swa else None,
        tree_components=components,
        tree_core_backend="python",
    )
    hicache = dataclasses.replace(HiCacheConfig("write_through", 2.0), mem_layout=mem_layout)
    with deployed(m["get_context"], hicache.server_args()) as args:
        args._mamba_cache_chunk_size = adapter.MAMBA_CHUNK_SIZE
        cache = m["UnifiedRadixCache"](params)
        try:
            cache.init_hicache(args, params)
        finally:
            atexit.unregister(cache.shutdown)
    return cache


@pytest.mark.parametrize("with_swa", [False, True], ids=["full+mamba", "full+swa+mamba"])
def test_sglang_builds_the_mamba_host_tier_on_cpu_in_page_first_direct(with_swa):
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    cache = _mamba_hicache(with_swa, "page_first_direct", linear_pool=True)
    entries = {e.name.value: e for e in cache.host_pool_group.entries}
    assert sorted(entries) == (["kv", "mamba", "swa"] if with_swa else ["kv", "mamba"])
    mamba_host = entries["mamba"].host_pool
    assert isinstance(mamba_host, MambaPoolHost)
    assert type(cache.cache_controller).__name__ == "HybridCacheController"
    assert mamba_host.device == "cpu" and mamba_host.layout == "page_first_direct"
    # --hicache-ratio 2 over the device pools (5 state slots, 40 full-pool tokens), as
    # SGLang sizes them: twice the device slots plus one, every slot free before a backup
    assert (mamba_host.page_num, mamba_host.available_size()) == (11, 11)
    assert entries["kv"].host_pool.page_num == 81


@pytest.mark.parametrize("with_swa", [False, True], ids=["full+mamba", "full+swa+mamba"])
def test_the_mamba_host_pool_refuses_the_adapters_layer_first_host_layout(with_swa):
    with pytest.raises(AssertionError, match="Unsupported layout: layer_first"):
        _mamba_hicache(with_swa, "layer_first", linear_pool=True)


def test_full_plus_mamba_over_the_adapters_mha_pool_has_no_hicache_strategy():
    with pytest.raises(AssertionError, match="No matching HiCache strategy"):
        _mamba_hicache(False, "page_first_direct", linear_pool=False)
