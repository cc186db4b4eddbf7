"""Prompts, outputs and the arrivals made of them: shared prefix pools, prompts made
of a prefix (possibly cut short) plus a random suffix, and the arrivals that send an
earlier prompt again (resends, bursts, reloads).

Example: :func:`boundaries` of a layout with block sizes 2 and 4 and length 9 is
``(1, 2, 3, 4, 5, 6, 7, 8, 9)``: a resend cuts the prompt at or next to a block boundary.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hypothesis import strategies as st

from properties.core.trace import Arrive
from properties.generate.strategies.reuse import _reused, _sampled_list
from properties.generate.strategies.vocabulary import _seeds, cache_salts, lora_names, random_tokens
from reference.layout import KVCacheLayout


def prompt_lengths(layout: KVCacheLayout, max_len: int) -> st.SearchStrategy[int]:
    """A length in ``1..max_len``: short, near a multiple of the scheduler block size
    (``k * lcm - 1``, ``k * lcm``, ``k * lcm + 1``), near ``max_len``, or anything.

    One strategy object per ``(scheduler block size, max_len)``: the stateful machine
    draws thousands of prompts, and a strategy built anew is validated anew."""
    return _prompt_lengths(layout.scheduler_block_size, max_len)


@functools.lru_cache(maxsize=4096)
def _prompt_lengths(unit: int, max_len: int) -> st.SearchStrategy[int]:
    if max_len < 1:
        raise ValueError(f"prompt_lengths(max_len=...) must be >= 1, got {max_len}")
    near_multiple = st.builds(
        lambda k, d: min(max_len, max(1, k * unit + d)),
        st.integers(1, max(1, max_len // unit)),
        st.integers(-1, 1),
    )
    return st.one_of(
        st.integers(1, min(max_len, 3 * unit)),
        near_multiple,
        st.integers(max(1, max_len - unit), max_len),
        st.integers(1, max_len),
    )


@_reused
@st.composite
def prefix_pools(draw, layout: KVCacheLayout, max_prefixes: int = 3) -> tuple[tuple[int, ...], ...]:
    """1..``max_prefixes`` shared prefixes; later ones may fork an earlier one.

    A fork keeps ``base[:cut]`` and continues differently, so two prompts share a
    prefix and then diverge (possibly inside a block; with lookahead hashes, also inside
    a block's lookahead: :func:`_cuts`).
    """
    limit = layout.max_model_len
    pool: list[tuple[int, ...]] = []
    for _ in range(draw(st.integers(1, max_prefixes))):
        length = draw(prompt_lengths(layout, limit))
        head: tuple[int, ...] = ()
        if pool and draw(st.booleans()):
            base = draw(_sampled_list(tuple(pool)))
            if layout.num_hash_lookahead_tokens:
                unit, lookahead = layout.hash_block_size, layout.num_hash_lookahead_tokens
                cut = draw(_cuts(min(len(base), length), unit, lookahead))
            else:
                cut = draw(st.integers(0, min(len(base), length)))
            head = base[:cut]
        pool.append(head + random_tokens(draw(_seeds), length - len(head)))
    return tuple(pool)


@_reused
@st.composite
def prompts(
    draw,
    layout: KVCacheLayout,
    prefix_pool: Sequence[tuple[int, ...]] = (),
    max_len: int | None = None,
) -> tuple[int, ...]:
    """A prompt of ``1..max_len`` tokens (default ``max_model_len``): half the time a
    pool prefix (whole, or cut anywhere) followed by random tokens."""
    limit = layout.max_model_len if max_len is None else max_len
    length = draw(prompt_lengths(layout, limit))
    head: tuple[int, ...] = ()
    if prefix_pool and draw(st.booleans()):
        prefix = prefix_pool[draw(st.integers(0, len(prefix_pool) - 1))]
        lookahead = layout.num_hash_lookahead_tokens
        cut = draw(_cuts(len(prefix), layout.hash_block_size if lookahead else 0, lookahead))
        head = prefix[: min(cut, length)]
    return head + random_tokens(draw(_seeds), length - len(head))


@functools.lru_cache(maxsize=4096)
def _cuts(length: int, unit: int = 0, lookahead: int = 0) -> st.SearchStrategy[int]:
    """Where to cut a pool prefix: the whole prefix, or anywhere; with ``lookahead``
    hashes (``L`` tokens after a block of ``unit`` tokens are part of its hash) also
    inside a block's lookahead: ``k * unit + d`` with ``0 <= d < L``, so the two
    prompts share block ``k - 1`` but not its whole hash (a hit there is wrong).
    Example: ``unit`` 4, ``L`` 2, a 12-token prefix: 4, 5, 8 or 9 among the cuts."""
    whole_or_any = (st.just(length), st.integers(0, length))
    if not lookahead or length < unit:
        return st.one_of(*whole_or_any)
    edge = st.builds(
        lambda k, d: min(length, k * unit + d),
        st.integers(1, length // unit),
        st.integers(0, lookahead - 1),
    )
    return st.one_of(*whole_or_any, edge)


@functools.lru_cache(maxsize=4096)
def _output_lengths(longest: int, long_cap: int) -> st.SearchStrategy[int]:
    short = st.integers(0, longest)
    return st.one_of(short, short, short, st.integers(0, long_cap))


@_reused
@st.composite
def outputs(draw, layout: KVCacheLayout, max_len: int) -> tuple[int, ...]:
    """The tokens a request will decode: ``0..min(max_len, 2 * lcm + 4)`` tokens, or a
    quarter of the time a long decode of up to ``min(max_len, 24)`` tokens (it crosses
    windows, chunks and Mamba state blocks one token per step)."""
    longest = max(0, min(max_len, 2 * layout.scheduler_block_size + 4))
    length = draw(_output_lengths(longest, max(0, min(max_len, 24))))
    return random_tokens(draw(_seeds), length)


@st.composite
def request_inputs(
    draw, layout: KVCacheLayout, prefix_pool: Sequence[tuple[int, ...]], request_id: str
) -> Arrive:
    """An arrival with ``len(prompt) >= 1`` and ``len(prompt) + len(output) <= max_model_len``."""
    output = draw(outputs(layout, layout.max_model_len - 1))
    prompt = draw(prompts(layout, prefix_pool, layout.max_model_len - len(output)))
    return Arrive(
        request_id=request_id,
        prompt=prompt,
        output=output,
        cache_salt=draw(cache_salts()),
        lora_name=draw(lora_names()),
    )


_RESEND_KINDS = st.sampled_from(("same", "turn", "turn+", "cut"))


@functools.lru_cache(maxsize=4096)
def boundaries(layout: KVCacheLayout, length: int) -> tuple[int, ...]:
    """Cut points ``1..length`` at and next to every group's block boundary and the hit
    alignment. Example: block sizes 2 and 4, length 9 -> 1, 2, 3, 4, 5, 6, 7, 8, 9."""
    sizes = {g.spec.block_size for g in layout.groups} | {layout.cache_hit_alignment}
    cuts = {
        k * bs + d
        for bs in sizes
        for k in range(1, length // bs + 1)
        for d in (-1, 0, 1)
        if 1 <= k * bs + d <= length
    }
    return tuple(sorted(cuts)) or (length,)


@st.composite
def resend_ops(draw, layout: KVCacheLayout, old: Arrive, request_id: str) -> Arrive:
    """An earlier prompt again: a retry (the same prompt), the next turn of a chat (the
    prompt, its output and a few new tokens), or the prompt cut at or next to a block
    boundary (:func:`boundaries`), with the same or another salt."""
    room = layout.max_model_len - len(old.prompt)
    kind = draw(_RESEND_KINDS)
    if kind == "cut" and len(old.prompt) > 1:
        cuts = boundaries(layout, len(old.prompt))
        prompt = old.prompt[: cuts[draw(st.integers(0, len(cuts) - 1))]]
    else:
        extension = {"turn": old.output, "turn+": old.output + (1, 2, 3)}.get(kind, ())
        prompt = old.prompt + extension[: max(0, room - 1)]
    room = layout.max_model_len - len(prompt)
    return Arrive(
        request_id,
        prompt,
        old.output[: max(0, min(room, 4))],
        (old.cache_salt, None, "s2")[draw(st.integers(0, 2))],
        old.lora_name,
    )


def burst_ops(layout: KVCacheLayout, old: Arrive, first_id: int) -> tuple[Arrive, ...]:
    """Two arrivals from ``old``: its prompt cut at the largest multiple of the hit
    alignment below its length, then that cut plus 3 new tokens (the next chat turn).
    Example: alignment 8, a 21-token prompt -> 16 tokens, then those 16 and 3 more.
    Nothing when the prompt is not longer than the alignment."""
    unit = layout.cache_hit_alignment
    cut = (len(old.prompt) - 1) // unit * unit
    if cut < unit or cut + 3 > layout.max_model_len:
        return ()
    first = Arrive(f"r{first_id}", old.prompt[:cut], (), old.cache_salt, old.lora_name)
    turn = old.prompt[:cut] + (1, 2, 3)
    return (first, Arrive(f"r{first_id + 1}", turn, (), old.cache_salt, old.lora_name))


def reload_ops(layout: KVCacheLayout, old: Arrive, first_id: int) -> tuple[Arrive, ...]:
    """Two arrivals from ``old`` for a KV connector (external hits): the first half of
    the aligned blocks of its prompt and output, then its prompt, output and 3 new
    tokens (the next chat turn). Scheduled in one step after the device cache was reset,
    the first computes the head on the device and the second's hit combines that head
    with the rest of ``old``'s computed tokens from the host tier. Example: alignment 4,
    a 17-token prompt and 4 output tokens (5 aligned blocks) -> 8 tokens, then 24.
    Nothing when there are fewer than two aligned blocks."""
    unit = layout.cache_hit_alignment
    seen = old.prompt + old.output
    blocks = (len(seen) - 1) // unit
    if blocks < 2 or len(seen) + 3 > layout.max_model_len:
        return ()
    head = Arrive(f"r{first_id}", seen[: blocks // 2 * unit], (), old.cache_salt, old.lora_name)
    turn = seen + (1, 2, 3)
    return (head, Arrive(f"r{first_id + 1}", turn, (), old.cache_salt, old.lora_name))
