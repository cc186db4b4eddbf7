"""Hand-written scenarios for the Aphrodite 0.24.1 adapter (``properties/engines/aphrodite.py``).

Run with ``.engines/aphrodite/bin/python -m pytest
tests/properties/engines/test_aphrodite_adapter.py``; ``conftest.py`` skips the module
when Aphrodite is not installed or importable. Every expected value is derived by hand:
the shared rules from ``docs/vllm-behaviour.md`` (the fork keeps them), the fork's own
from ``docs/aphrodite-behaviour.md`` and ``findings/aphrodite/``. The scenarios that pin a
finding fail once Aphrodite fixes it: then its known divergence should go.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from properties.core.engine import (
    CacheHit,
    EngineError,
    ExposesCachedBlocks,
    ExposesFreeQueue,
    ExposesRefCounts,
    KVCacheEngine,
    RequestInput,
    SupportsServingModes,
    UnsupportedLayoutError,
)
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec

pytestmark = pytest.mark.engine

_ROOT = Path(__file__).resolve().parents[3]


def make(groups: tuple, num_blocks: int, max_model_len: int = 64, **layout):
    from properties.engines.aphrodite import make_engine

    return make_engine(
        KVCacheLayout(
            groups=tuple(KVCacheGroup((f"l{i}",), spec) for i, spec in enumerate(groups)),
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            **layout,
        )
    )


def run_prompt(engine, request_id: str, tokens: tuple[int, ...], **request) -> None:
    """Add a request and compute its whole prompt in one step, from its hit."""
    engine.add_request(RequestInput(request_id, tokens, **request))
    hit = engine.get_computed_blocks(request_id)
    assert engine.allocate_slots(request_id, len(tokens) - hit.num_tokens, hit.num_tokens, hit)
    engine.set_num_computed_tokens(request_id, len(tokens))
    engine.new_step()


def resend_hit(groups: tuple, prompt_len: int, **layout) -> int:
    """Compute a ``prompt_len`` prompt, free it, look the same prompt up again: the hit."""
    engine = make(groups, 24, 32, **layout)
    prompt = tuple(range(1, prompt_len + 1))
    run_prompt(engine, "a", prompt)
    engine.free("a")
    engine.remove_request("a")
    engine.add_request(RequestInput("b", prompt))
    return engine.get_computed_blocks("b").num_tokens


FULL4 = FullAttentionSpec(block_size=4)
WINDOW8 = SlidingWindowSpec(block_size=4, sliding_window=8)


def test_capabilities_13_token_rows_then_the_window_frees():
    """Full + SWA (w 4), bs 2, 20 blocks: the vLLM adapter's scenario, same answers
    (the fork keeps these rules). cdiv(13, 2) = 7 blocks per group from the queue 1..19;
    at the decode, 13 - 4 + 1 = 10 tokens are skipped: SWA columns 0..4 become null."""
    engine = make(
        (FullAttentionSpec(block_size=2), SlidingWindowSpec(block_size=2, sliding_window=4)), 20
    )
    for capability in (
        KVCacheEngine,
        ExposesRefCounts,
        ExposesFreeQueue,
        ExposesCachedBlocks,
        SupportsServingModes,
    ):
        assert isinstance(engine, capability)
    assert engine.name == "aphrodite"
    engine.add_request(RequestInput("a", tuple(range(13))))
    hit = engine.get_computed_blocks("a")
    assert hit == CacheHit(((), ()), 0)
    new = engine.allocate_slots("a", 13, 0, hit)
    assert new == ((1, 2, 3, 4, 5, 6, 7), (8, 9, 10, 11, 12, 13, 14))
    engine.set_num_computed_tokens("a", 13)
    engine.append_output_tokens("a", [99])
    assert engine.allocate_slots("a", 1) == ((), ())
    assert engine.get_block_ids("a") == ((1, 2, 3, 4, 5, 6, 7), (0, 0, 0, 0, 0, 13, 14))
    assert engine.num_free_blocks() == 5 + 5
    assert engine.ref_counts()[8] == 0 and engine.ref_counts()[13] == 1


def test_lookup_without_a_bound_and_errors_named_aphrodite():
    """Aphrodite's ``get_computed_blocks`` takes no bound: the second request (the
    adapter's "full" report mode, where the vLLM adapter passes ``num_tokens - 1``)
    looks up with Aphrodite's fixed one. A 9-token prompt cached in full, resent: at most
    8 tokens, two blocks of 4. Aphrodite's exceptions come back as engine errors naming
    the engine and the call."""
    engine = make((FULL4,), 16)
    run_prompt(engine, "a", tuple(range(9)))
    engine.add_request(RequestInput("b", tuple(range(9))))
    hit = engine.get_computed_blocks("b")
    assert hit == CacheHit(((1, 2),), 8)
    with pytest.raises(EngineError, match=r"^aphrodite: allocate_slots\('b', 0, 0, 0\) raised"):
        engine.allocate_slots("b", 0)


def test_a_layout_with_lookahead_hashes_is_unsupported():
    """Aphrodite has no ``num_hash_lookahead_tokens``: building such a layout raises
    UnsupportedLayoutError (the divergence keeps them from the draw)."""
    with pytest.raises(UnsupportedLayoutError, match="has no lookahead hashes"):
        make((FULL4,), 16, use_eagle=True, num_hash_lookahead_tokens=1)


def test_eagle_sparse_retention_resend_never_hits():
    """Finding eagle-sparse-retention-no-hit: full + SWA (w 8), bs 4, EAGLE. Sparse
    retention keeps only the window tail ending on (16 - 1) // 4 * 4 = 12, i.e. blocks
    [4, 12); the EAGLE drop lands at 8, whose window [0, 8) is not kept: hit 0 (vLLM 0.33:
    12). With dense retention a 17-token prompt hits 12 (full: 16 matched, EAGLE drops a
    block)."""
    eagle = dict(use_eagle=True)
    assert resend_hit((FULL4, WINDOW8), 16, prefix_cache_retention_interval=0, **eagle) == 0
    assert resend_hit((FULL4, WINDOW8), 17, prefix_cache_retention_interval=0, **eagle) == 0
    assert resend_hit((FULL4, WINDOW8), 17, **eagle) == 12


def test_eagle_extra_block_bounded_by_the_lookup_bound_in_hybrids():
    """Divergence aphrodite-eagle-hybrid-bounded-margin: a block-aligned 16-token prompt
    resent in a hybrid with EAGLE (dense retention). The EAGLE group may look one block
    past the candidate 15, but Aphrodite caps it at 15 (vLLM 0.33: at the 16 hashed
    tokens): 3 blocks match, one is dropped: 8 (vLLM 0.33: 12). Full attention alone (the
    unitary coordinator) gives 8 as vLLM does."""
    assert resend_hit((FULL4, WINDOW8), 16, use_eagle=True) == 8
    assert resend_hit((FULL4,), 16, use_eagle=True) == 8


def test_mamba_states_of_chunks_in_flight_stay_held():
    """Finding mamba-async-state-leak: one Mamba group (align), bs 4, a 32-token prompt in
    four 8-token chunks, each allocated while the previous one is in flight (the
    asynchronous scheduler's one-step lag). Chunk k's state goes at column 2k + 1. At the
    fourth allocation 16 tokens are processed: 15 skipped, columns 0..2, so state 1
    (column 1) is no longer read; vLLM 0.33 frees it ([0, 0, 0, 2, 0, 3, 0, 4]), Aphrodite's
    walk stops at the null column 2 and its last-state rule already points at column 3:
    [0, 1, 0, 2, 0, 3, 0, 4]. Synchronous chunks free each state one chunk later through
    the last-state rule: [0, 0, 0, 0, 0, 3, 0, 4]."""
    spec = MambaSpec(block_size=4, shapes=((4, 8),), dtype_bytes=2)
    for asynchronous, row in ((True, (0, 1, 0, 2, 0, 3, 0, 4)), (False, (0, 0, 0, 0, 0, 3, 0, 4))):
        engine = make((spec,), 16)
        engine.add_request(RequestInput("r", tuple(range(1, 33))))
        hit = engine.get_computed_blocks("r")
        for chunk in range(4):
            engine.new_step()
            engine.allocate_slots("r", 8, 0, hit if chunk == 0 else None)
            if asynchronous:
                engine.set_in_flight("r", 16 if chunk else 8, 0)
            engine.set_num_computed_tokens("r", 8 * (chunk + 1))
            if asynchronous:
                engine.set_in_flight("r", 8, 0)  # the previous chunk's output processed
        assert engine.get_block_ids("r") == (row,), asynchronous


def test_a_lora_name_and_an_equal_cache_salt_share_the_first_block():
    """Finding lora-name-salt-collision: full attention bs 4; "a" (LoRA "tenant-a")
    computes 9 tokens; "b" (no LoRA, salt "tenant-a", same tokens) hits the first block
    only: the salt keys the first block alone, the LoRA name every block."""
    engine = make((FULL4,), 16)
    run_prompt(engine, "a", tuple(range(9)), lora_name="tenant-a")
    engine.add_request(RequestInput("b", tuple(range(9)), cache_salt="tenant-a"))
    assert engine.get_computed_blocks("b") == CacheHit(((1,),), 4)
    engine.add_request(RequestInput("c", tuple(range(9)), cache_salt="another"))
    assert engine.get_computed_blocks("c").num_tokens == 0


def _check_mutant(name: str) -> str:
    """``kvconform check --only invariants`` at the universal level against mutant
    ``name`` of :mod:`tests.properties.engines.aphrodite_mutants` (the ci profile's small
    tier, in process, 60 examples; the run stops at the first failure): its output."""
    command = [
        sys.executable, "-W", "ignore", "-m", "properties.tools.cli", "check",
        "--engine", f"tests.properties.engines.aphrodite_mutants:make_{name}",
        "--isolation", "none", "--level", "universal", "--profile", "ci",
        "--only", "invariants", "--max-examples", "60", "--tiers", "none",
        "--workers", "1", "--shrink-seconds", "5",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(_ROOT)}
    done = subprocess.run(command, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_the_gate_catches_a_lookup_bounded_by_the_whole_prompt():
    """``lookup_whole_prompt``: a fully cached prompt hits all its tokens (H1)."""
    assert "first failure [hit_bounds]" in _check_mutant("lookup_whole_prompt")


def test_the_gate_catches_a_window_that_skips_one_token_more():
    """``window_skips_one_more``: the skipped count also feeds the block estimate, so in
    drawn traces the first sign is an allocation that pulls a block its estimate did not
    count (A4), before any query reads the block freed too early; the reach corpus,
    replayed first, has a window trace where the early free is read (W3)."""
    out = _check_mutant("window_skips_one_more")
    assert "FAILED in invariants" in out
    assert "[estimate_matches_pulls]" in out or "[window_liveness]" in out, out[-2000:]
