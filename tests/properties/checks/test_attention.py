"""AttentionChecker on hand-written block tables: correct tables pass, wrong ones are caught."""

from __future__ import annotations

import pytest

from properties.checks.attention import (
    AttentionChecker,
    AttentionInputError,
    AttentionMismatch,
    ScheduledChunk,
)
from properties.core.engine import RequestInput
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

LAYOUT = KVCacheLayout(
    groups=(
        KVCacheGroup(("full",), FullAttentionSpec(block_size=4)),
        KVCacheGroup(("swa",), SlidingWindowSpec(block_size=4, sliding_window=5)),
        KVCacheGroup(("chunk",), ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8)),
        KVCacheGroup(("mamba",), MambaSpec(block_size=4)),
    ),
    num_blocks=64,
    max_model_len=64,
)
TOKENS = tuple(range(100, 124))
A = RequestInput("a", TOKENS[:16])


def chunk(req, tokens, before, n, ids) -> ScheduledChunk:
    return ScheduledChunk(req, tokens, before, n, ids)


def prefill_a(checker: AttentionChecker) -> None:
    # a: 16 tokens in two chunks, rows of 4 blocks (ids 1-4, 11-14, 21-24; Mamba 31-34).
    ids = ((1, 2, 3, 4), (11, 12, 13, 14), (21, 22, 23, 24), (0, 32))
    checker.check_step([chunk(A, TOKENS[:16], 0, 6, ids)])
    ids = ((1, 2, 3, 4), (11, 12, 13, 14), (21, 22, 23, 24), (0, 32, 0, 34))
    checker.check_step([chunk(A, TOKENS[:16], 6, 10, ids)])


def test_correct_tables_pass_across_steps() -> None:
    checker = AttentionChecker(LAYOUT)
    prefill_a(checker)
    # decode position 16: SWA nulls (16 - 4) // 4 = 3 blocks, chunked (16 // 8 * 8) // 4 = 4
    ids = ((1, 2, 3, 4, 5), (0, 0, 0, 14, 15), (0, 0, 0, 0, 25), (0, 0, 0, 34, 35))
    checker.check_step([chunk(A, TOKENS[:17], 16, 1, ids)])


def test_prefix_hit_reads_blocks_another_request_wrote() -> None:
    checker = AttentionChecker(LAYOUT)
    prefill_a(checker)
    # b shares a's first 12 tokens: a hit at 12 on a's blocks, then computes 12..15.
    b_tokens = TOKENS[:12] + (7, 7, 7, 7)
    b = RequestInput("b", b_tokens)
    ids = ((1, 2, 3, 6), (0, 12, 13, 16), (0, 0, 23, 26), (0, 0, 0, 36))
    # Mamba hit at 12 must read the state of tokens[0:12]: a wrote the state at 16 in 34,
    # so give b a state block written at 12 by a third request first.
    c = RequestInput("c", TOKENS[:12])
    checker.check_step(
        [chunk(c, TOKENS[:12], 0, 12, ((1, 2, 3), (11, 12, 13), (21, 22, 23), (0, 0, 33)))]
    )
    ids = ((1, 2, 3, 6), (0, 12, 13, 16), (0, 0, 23, 26), (0, 0, 33, 36))
    checker.check_step([chunk(b, b_tokens, 12, 4, ids)])


def test_hit_on_same_tokens_other_prefix_is_caught() -> None:
    checker = AttentionChecker(LAYOUT)
    prefill_a(checker)
    other = (1,) + TOKENS[1:16]
    b = RequestInput("b", other)
    ids = ((1, 2, 3, 6), (0, 12, 13, 16), (0, 0, 23, 26), (0, 0, 0, 36))
    with pytest.raises(AttentionMismatch, match=r"request 'b', group 0 \(full\), position 12"):
        checker.check_step([chunk(b, other, 12, 4, ids)])


def test_salt_is_part_of_the_content() -> None:
    checker = AttentionChecker(LAYOUT)
    prefill_a(checker)
    b = RequestInput("b", TOKENS[:16], cache_salt="s")
    ids = ((1, 2, 3, 6), (0, 12, 13, 16), (0, 0, 23, 26), (0, 0, 0, 36))
    with pytest.raises(AttentionMismatch, match="max abs error"):
        checker.check_step([chunk(b, TOKENS[:16], 12, 4, ids)])


def test_scheduled_token_in_null_block_is_caught() -> None:
    checker = AttentionChecker(LAYOUT)
    ids = ((1, 2), (11, 0), (21, 22), (0, 32))
    with pytest.raises(AttentionMismatch, match=r"group 1, position 4: .*null block 0"):
        checker.check_step([chunk(A, TOKENS[:16], 0, 8, ids)])


def test_row_too_short_is_caught() -> None:
    checker = AttentionChecker(LAYOUT)
    ids = ((1,), (11, 12), (21, 22), (0, 32))
    with pytest.raises(AttentionMismatch, match="group 0, position 4: .*needs column 1"):
        checker.check_step([chunk(A, TOKENS[:16], 0, 8, ids)])


def test_sliding_window_block_nulled_one_token_early_is_caught() -> None:
    checker = AttentionChecker(LAYOUT)
    prefill_a(checker)
    # Decode position 16 sees SWA keys [12, 16]; block column 3 (12..15) is needed.
    ids = ((1, 2, 3, 4, 5), (0, 0, 0, 0, 15), (0, 0, 0, 0, 25), (0, 0, 0, 34, 35))
    with pytest.raises(AttentionMismatch, match=r"group 1 \(sliding_window\), position 16.*nan"):
        checker.check_step([chunk(A, TOKENS[:17], 16, 1, ids)])


def test_stale_block_overwritten_by_another_request_is_caught() -> None:
    checker = AttentionChecker(LAYOUT)
    prefill_a(checker)
    # Block 2 went to request d, which wrote its own tokens 4..7 into it.
    d = RequestInput("d", (9,) * 8)
    checker.check_step([chunk(d, (9,) * 8, 0, 8, ((7, 2), (17, 18), (27, 28), (0, 38)))])
    ids = ((1, 2, 3, 4, 5), (0, 0, 0, 14, 15), (0, 0, 0, 0, 25), (0, 0, 0, 34, 35))
    with pytest.raises(AttentionMismatch, match=r"request 'a', group 0 \(full\), position 16"):
        checker.check_step([chunk(A, TOKENS[:17], 16, 1, ids)])


def test_mamba_state_from_wrong_block_is_caught() -> None:
    checker = AttentionChecker(LAYOUT)
    prefill_a(checker)
    ids = ((1, 2, 3, 4, 5), (0, 0, 0, 14, 15), (0, 0, 0, 0, 25), (0, 0, 0, 32, 35))
    with pytest.raises(AttentionMismatch, match=r"group 3 \(mamba\), position 16: state"):
        checker.check_step([chunk(A, TOKENS[:17], 16, 1, ids)])


def test_mamba_state_written_to_null_is_caught() -> None:
    checker = AttentionChecker(LAYOUT)
    ids = ((1, 2), (11, 12), (21, 22), (0, 0))
    with pytest.raises(AttentionMismatch, match=r"group 3 \(mamba\), position 8: .*null block"):
        checker.check_step([chunk(A, TOKENS[:16], 0, 8, ids)])


def test_bad_input_names_the_field() -> None:
    checker = AttentionChecker(LAYOUT)
    with pytest.raises(AttentionInputError, match="block_ids has 1 groups, the layout 4"):
        checker.check_step([chunk(A, TOKENS[:16], 0, 4, ((1,),))])
    with pytest.raises(AttentionInputError, match="only 16 tokens"):
        checker.check_step([chunk(A, TOKENS[:16], 12, 8, ((1,),) * 4)])
    with pytest.raises(AttentionInputError, match="must be >= 0"):
        checker.check_step([chunk(A, TOKENS[:16], -1, 2, ((1,),) * 4)])


def test_float64_cache_with_tight_tolerance() -> None:
    import torch

    checker = AttentionChecker(
        LAYOUT,
        dtype=torch.float64,
        atol=1e-12,
        rtol=1e-12,
        num_kv_heads=2,
        head_size=4,
        backend="sdpa",
    )
    prefill_a(checker)
