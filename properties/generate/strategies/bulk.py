"""Bulk arrivals of the large tiers: many requests made from one seed
(:func:`bulk_arrivals`), and batches of requests alike (:func:`batch_arrivals`), as an
offline batch or an evaluation set sends them.

Example: ``bulk_arrivals(layout, (), 0, 2, 7)`` -> ``Arrive("r0", ...), Arrive("r1",
...)``, the same two on every run.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from properties.core.trace import Arrive
from properties.generate.strategies.vocabulary import VOCAB_SIZE
from reference.layout import KVCacheLayout
from reference.specs import ChunkedLocalAttentionSpec, SlidingWindowSpec

#: Outputs of a bulk arrival: up to this many tokens (an online tier's chat turns).
BULK_OUTPUT = 16


#: Outputs of an offline batch: up to this many tokens, so that its requests decode
#: across several block boundaries after the batch's first decode step.
OFFLINE_OUTPUT = 64


def bulk_arrivals(
    layout: KVCacheLayout,
    prefix_pool: Sequence[tuple[int, ...]],
    first_id: int,
    count: int,
    seed: int,
    batch: bool = False,
    documents: bool | None = None,
    max_output: int = BULK_OUTPUT,
) -> tuple[Arrive, ...]:
    """``count`` arrivals ``r<first_id>..`` made from one seed (drawing thousands of
    requests one by one would overrun Hypothesis's buffer): a prompt's length is
    log-uniform in ``1..min(room, BULK_SHORT)`` (a chat turn), or one time in
    ``BULK_LONG_ONE_IN`` in ``1..room`` (up to ``max_model_len``: a long document);
    half of them start with a cut of a pool prefix; outputs of ``0..max_output`` tokens
    (16 by default); one in eight has salt ``"s1"``. Always ``len(prompt) + len(output)
    <= max_model_len``. With ``batch``, :func:`batch_arrivals` instead (``documents`` and
    ``max_output`` passed on).
    Example: ``bulk_arrivals(layout, (), 0, 2, 7)`` -> ``Arrive("r0", ...), Arrive("r1", ...)``.
    """
    rng = random.Random(seed)
    if batch:
        return batch_arrivals(layout, prefix_pool, first_id, count, rng, documents, max_output)
    limit = layout.max_model_len
    out = []
    for i in range(count):
        output_len, length = _bulk_lengths(rng, limit, max_output)
        head = _pool_head(rng, prefix_pool, length)
        prompt = head + _bulk_tokens(rng, length - len(head))
        output = _bulk_tokens(rng, output_len)
        salt = "s1" if rng.randrange(8) == 0 else None
        out.append(Arrive(f"r{first_id + i}", prompt, output, salt, None))
    return tuple(out)


def batch_arrivals(
    layout: KVCacheLayout,
    prefix_pool: Sequence[tuple[int, ...]],
    first_id: int,
    count: int,
    rng: random.Random,
    documents: bool | None = None,
    max_output: int = BULK_OUTPUT,
) -> tuple[Arrive, ...]:
    """``count`` arrivals alike, as an offline batch or an evaluation set sends them: one
    prompt length (drawn as :func:`bulk_arrivals` draws one) and one output length for
    all; the prompts distinct, or one time in two all starting with the same cut of a
    pool prefix (a shared system prompt, so its blocks are held by every request; the
    whole prompt when the cut covers it: one prompt sampled many times). A
    batch prefilled in one step decodes in lock step: every request crosses its block
    boundaries and drops its window blocks in the same steps (the engine's uniform,
    many-item paths). On a layout with windows or chunks, one batch in two is a batch of
    distinct documents longer than the widest of them (:func:`_past_the_window`): its
    first decode step drops blocks held once in every row at once; ``documents`` True
    makes every batch on such a layout one of documents, False none (None: one in two).
    Example: ``count`` 3 -> three prompts of one length, each with the same number of
    output tokens."""
    output_len, length = _bulk_lengths(rng, layout.max_model_len, max_output)
    widest = _widest_reach(layout)
    if widest > 0:  # the coin is tossed whatever ``documents`` says: one stream
        coin = rng.randrange(2) == 0
        documents = coin if documents is None else documents
    else:
        documents = False
    if documents:
        length = _past_the_window(rng, layout, widest, output_len, length)
    head = () if documents else _pool_head(rng, prefix_pool, length)
    return tuple(
        Arrive(
            f"r{first_id + i}",
            head + _bulk_tokens(rng, length - len(head)),
            _bulk_tokens(rng, output_len),
            None,
            None,
        )
        for i in range(count)
    )


def _widest_reach(layout: KVCacheLayout) -> int:
    """The widest sliding window or attention chunk of ``layout`` (0: none). Example:
    full + SWA 32 + SWA 128 -> 128."""
    reach = 0
    for group in layout.groups:
        spec = group.spec
        if isinstance(spec, SlidingWindowSpec):
            reach = max(reach, spec.sliding_window)
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            reach = max(reach, spec.attention_chunk_size or 0)
    return reach


def _past_the_window(
    rng: random.Random, layout: KVCacheLayout, widest: int, output_len: int, length: int
) -> int:
    """A prompt length past ``widest`` and within 8 of the layout's largest blocks after
    the block it ends in, so every windowed group has blocks to drop at the first
    decode step: one time in two a whole number of blocks (that step also starts a new
    block in every group, so it pops too), else cut inside a block; ``length``
    unchanged when that does not fit ``max_model_len`` with the output. Example: w 40,
    blocks of 16, room 512 -> one of ``48, 64, ..., 160`` or a length in ``41..159``."""
    block = max(g.spec.block_size for g in layout.groups)
    aligned = (widest // block + rng.randint(1, 8)) * block
    past = aligned if rng.randrange(2) else max(widest + 1, aligned - rng.randrange(block))
    return past if past + output_len <= layout.max_model_len else length


def _bulk_lengths(rng: random.Random, limit: int, max_output: int = BULK_OUTPUT) -> tuple[int, int]:
    """``(output length, prompt length)`` of a bulk arrival: ``0..max_output`` output
    tokens; the prompt log-uniform in ``1..min(room, BULK_SHORT)``, or one time in
    ``BULK_LONG_ONE_IN`` in ``1..room`` (``room``: ``limit`` less the output)."""
    output_len = min(rng.randrange(max_output + 1), limit - 1)
    room = limit - output_len
    top = room if rng.randrange(BULK_LONG_ONE_IN) == 0 else min(room, BULK_SHORT)
    return output_len, max(1, min(top, int(math.exp(rng.uniform(0, math.log(top))))))


def _pool_head(
    rng: random.Random, prefix_pool: Sequence[tuple[int, ...]], length: int
) -> tuple[int, ...]:
    """One time in two (with a pool), a cut of a pool prefix of at most ``length``
    tokens to start a prompt with; else nothing."""
    if prefix_pool and rng.randrange(2) == 0:
        prefix = prefix_pool[rng.randrange(len(prefix_pool))]
        return prefix[: min(length, rng.randrange(len(prefix) + 1))]
    return ()


#: One bulk arrival of a large tier in this many is a batch of requests alike
#: (:func:`batch_arrivals`).
BATCH_ONE_IN = 4


#: Prompts of a bulk arrival: log-uniform up to this many tokens, or one in
#: ``BULK_LONG_ONE_IN`` up to ``max_model_len``.
BULK_SHORT = 2**11  # 2048


BULK_LONG_ONE_IN = 32


#: ``bytes.translate`` table of a byte to a token id (``VOCAB_SIZE`` divides 256).
_BYTE_TO_TOKEN = bytes(b % VOCAB_SIZE for b in range(256))


def _bulk_tokens(rng: random.Random, length: int) -> tuple[int, ...]:
    """``length`` token ids from ``rng``'s bytes (uniform: ``VOCAB_SIZE`` divides 256);
    a hundred times faster than :func:`random_tokens` for the large tiers' millions of
    tokens (the small tier keeps :func:`random_tokens`, so its stream does not move)."""
    return tuple(rng.randbytes(length).translate(_BYTE_TO_TOKEN))
