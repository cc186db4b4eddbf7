"""Hand scenarios for the allocation side of the SGLang adapter (issue 19): SGLang's own
allocator answers an extend (its ``None`` is the protocol's refusal), a decode goes
through SGLang's ``check_decode_capacity`` first, and an SWA pool smaller than the full
one (SGLang's ``swa_full_tokens_ratio``, by layout) refuses on its own.

Expected ids and sizes follow from SGLang's allocators on a fresh pool: pages are handed
out in ascending order from 1 (page 0 is the padding page). Run with
``.engines/sglang/bin/python -W ignore -m pytest`` and this file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from properties.core.engine import RequestInput
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, SlidingWindowSpec

pytestmark = pytest.mark.engine

_ROOT = Path(__file__).resolve().parents[3]
if not (_ROOT / ".engines" / "sglang" / ".kvconform-complete").exists():
    pytest.skip("SGLang is not installed (.engines/sglang)", allow_module_level=True)
pytest.importorskip("sglang.srt.mem_cache.unified_radix_cache")

from properties.engines.sglang import SGLangEngine, make_engine  # noqa: E402


def layout(
    page: int, *, window: int = 4, pool_pages: int = 32, max_len: int = 160, caching=True
) -> KVCacheLayout:
    return KVCacheLayout(
        groups=(
            KVCacheGroup(("full",), FullAttentionSpec(block_size=page)),
            KVCacheGroup(("swa",), SlidingWindowSpec(block_size=page, sliding_window=window)),
        ),
        num_blocks=pool_pages + 1,
        max_model_len=max_len,
        enable_caching=caching,
    )


def free_pages(engine: SGLangEngine) -> tuple[int, int]:
    """(full, SWA) pages the allocator has free now (no tree entry to evict here)."""
    a, page = engine.allocator, engine.config.page_size
    return a.full_available_size() // page, a.swa_available_size() // page


def admit(engine: SGLangEngine, rid: str, prompt: tuple[int, ...], computed: bool = True):
    """Admit ``rid`` (no hit) with its whole prompt in one step: the new ids or None."""
    engine.add_request(RequestInput(rid, prompt))
    new = engine.allocate_slots(rid, len(prompt))
    if new is not None and computed:
        engine.set_num_computed_tokens(rid, len(prompt))
    return new


def test_a_layout_of_ratio_4_5_reports_the_smaller_swa_pool():
    """``num_blocks`` 34 deploys SGLang with ``--swa-full-tokens-ratio`` 0.8
    (:func:`~properties.engines.sglang.swa_full_tokens_ratio`): 33 full pages, SWA
    ``int(33 * 0.8) = 26`` pages at bs 1; the protocol's free count is the smaller pool's."""
    engine = make_engine(layout(1, max_len=16, pool_pages=33))
    assert [(p.name, p.num_blocks, p.num_free) for p in engine.pool_usage()] == [
        ("full", 33, 33),
        ("swa", 26, 26),
    ]
    assert engine.num_free_blocks() == 26


def test_bs1_extend_refused_by_the_full_pool():
    """bs 1, both pools 32 pages: H holds 30 slots; B's 3 tokens need 3 full slots, 2 are
    free: SGLang's ``alloc`` returns None (its full-pool check). Nothing is taken, B holds
    no row; once H is freed B fits."""
    engine = make_engine(layout(1))
    assert admit(engine, "H", tuple(range(100, 130))) is not None
    assert free_pages(engine) == (2, 2)
    assert admit(engine, "B", (1, 2, 3)) is None
    assert free_pages(engine) == (2, 2)
    assert engine.get_block_ids("B") == ((), ())
    engine.free("H")
    assert engine.allocate_slots("B", 3) is not None


def test_bs1_extend_refused_by_the_smaller_swa_pool_only():
    """bs 1, full pool 33 pages, SWA pool 26 (ratio 0.8): H1 and H2 hold 12 slots each,
    leaving 9 full slots and 2 SWA slots. B's 3 tokens fit the full pool but not the SWA
    pool: SGLang's ``alloc`` returns None from its SWA check, taking nothing from either
    pool."""
    engine = make_engine(layout(1, max_len=16, pool_pages=33))
    assert admit(engine, "H1", tuple(range(100, 112))) is not None
    # H2 is not computed yet: it publishes nothing, so the tree has nothing to evict
    assert admit(engine, "H2", tuple(range(200, 212)), computed=False) is not None
    assert free_pages(engine) == (9, 2)
    assert admit(engine, "B", (1, 2, 3)) is None
    assert free_pages(engine) == (9, 2)
    assert [p.num_free for p in engine.pool_usage()] == [9, 2]
    assert admit(engine, "C", (3,)) == ((25,), (25,))  # one slot fits both pools


def test_bs2_extend_refused_by_alloc_extend():
    """bs 2, 32 pages: H holds 30 pages (60 tokens); B's 6 tokens need 3 pages, 2 are
    free: ``alloc_extend``'s page check returns None and nothing is taken."""
    engine = make_engine(layout(2))
    assert admit(engine, "H", tuple(range(100, 160))) is not None
    assert free_pages(engine) == (2, 2)
    assert admit(engine, "B", tuple(range(6))) is None
    assert free_pages(engine) == (2, 2)
    assert admit(engine, "C", tuple(range(4))) == ((31, 32), (31, 32))


@pytest.mark.parametrize("page", [1, 2])
def test_decode_is_gated_by_check_decode_capacity_with_caching_off(page):
    """Prefix caching off (SGLang's ``disable``: no prefix sharing, so the decode check's
    eviction returns at once). bs 2: H takes 30 pages, D's 3-token prompt the last 2; D's
    decode at p = 3 stays in its second page (growth 0: allowed, the slot after slot
    2's); at p = 4 it needs a page and none is free: ``check_decode_capacity`` says no, the
    allocation is refused and D's row is unchanged. bs 1: H takes 28 slots, D 3; every
    decode slot is a page: the last free one (32) goes to p = 3, none is left for p = 4."""
    engine = make_engine(layout(page, caching=False))
    assert not engine.cache.supports_prefix_sharing()
    held = {1: 28, 2: 30}[page] * page
    assert admit(engine, "H", tuple(range(100, 100 + held))) is not None
    assert admit(engine, "D", (1, 2, 3)) is not None
    assert free_pages(engine) == {1: (1, 1), 2: (0, 0)}[page]
    engine.append_output_tokens("D", [7])
    new = engine.allocate_slots("D", 1)  # p = 3
    assert new == {1: ((32,), (32,)), 2: ((), ())}[page]
    engine.set_num_computed_tokens("D", 4)
    engine.append_output_tokens("D", [8])
    full_row = engine.get_block_ids("D")[0]
    assert engine.allocate_slots("D", 1) is None  # p = 4: no page left in the full pool
    # nothing taken (the decode-time window slide before the check may free SWA pages)
    assert engine.get_block_ids("D")[0] == full_row
    engine.free("H")
    assert engine.allocate_slots("D", 1) is not None


def test_extend_page_slack_mutant_refuses_an_exact_fit(monkeypatch):
    """bs 2, 32 pages: H holds 30, C's 4 tokens need the 2 pages left. SGLang hands out
    pages 31 and 32; the ``extend_page_slack`` mutant asks ``alloc_extend`` for 3 pages
    and refuses, and S3 (``allocation_fits_per_pool``) reports it: each pool needed 2 of
    its 2 free pages."""
    from properties.checks.invariants import allocation_fits_per_pool
    from properties.checks.state import CheckState, FailedAllocationEvent
    from tests.properties.engines.sglang_mutants import mutated

    for mutant in (False, True):
        with monkeypatch.context() as patch:
            if mutant:
                owner, method, function = mutated("extend_page_slack")
                patch.setattr(owner, method, function)
            engine = make_engine(layout(2))
            state = CheckState(engine, layout(2))
            assert admit(engine, "H", tuple(range(100, 160))) is not None
            state.invalidate()
            before = state.snapshot()
            new = admit(engine, "C", tuple(range(4)), computed=False)
            if not mutant:
                assert new == ((31, 32), (31, 32))
                continue
            assert new is None
            event = FailedAllocationEvent("C", None, before, ((), ()), num_slots=4)
            message = allocation_fits_per_pool(state, event)
            assert message is not None and "full: 2 of 2 free; swa: 2 of 2 free" in message


def test_ungated_alloc_decode_refusal_leaks_a_full_page():
    """Why decodes go through ``check_decode_capacity`` first, as in SGLang's scheduler
    (``check_decode_mem`` before ``alloc_for_decode``): SGLang 0.5.23's ``alloc_decode``
    takes the full pool's page before it asks the SWA pool, and returns None without
    giving it back. bs 2, full pool 33 pages, SWA pool ``int(66 * 0.8) // 2 = 26`` (window
    4, max_model_len 44): 51 tokens fill the SWA pool but half a page; slot 51 stays in
    that page; slot 52 needs
    a page in both pools: the SWA pool has none, None, and the full pool is one page (2
    slots) short with nothing holding it. Behind the gate the adapter never reaches this
    refusal (SGLang's own flow does not either)."""
    import torch

    engine = make_engine(layout(2, max_len=44, pool_pages=33))
    assert engine.config.swa_pool_pages == 26
    allocator = engine.allocator

    def t(v: int):
        return torch.tensor([v], dtype=torch.int64)

    out = allocator.alloc_extend(t(0), t(0), t(51), t(51), t(-1), 51)
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (14, 0)
    last = allocator.alloc_decode(t(52), t(52), t(int(out[-1])))
    assert last is not None and int(last) == int(out[-1]) + 1
    assert allocator.alloc_decode(t(53), t(53), t(int(last))) is None
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (12, 0)
