"""Tokens and request extras: a small vocabulary, cache salts, LoRA names, and prompts
made compactly from one drawn seed.

The vocabulary is ``0..VOCAB_SIZE-1`` (8 ids) so that equal content behind different
prefixes happens; salts are ``None`` three times in four, else ``"s1"``; LoRA names
``None`` seven times in eight, else ``"lora-a"``. Example: ``random_tokens(0, 3)`` is
three ids in ``0..7``, the same three on every run.
"""

from __future__ import annotations

import random

from hypothesis import strategies as st

#: Token ids are drawn from ``range(VOCAB_SIZE)``.
VOCAB_SIZE = 8


def token_ids() -> st.SearchStrategy[int]:
    """A token id in ``0..VOCAB_SIZE-1``."""
    return st.integers(0, VOCAB_SIZE - 1)


def cache_salts() -> st.SearchStrategy[str | None]:
    """``None`` three times out of four, else ``"s1"``."""
    return st.sampled_from((None, None, None, "s1"))


def lora_names() -> st.SearchStrategy[str | None]:
    """``None`` seven times out of eight, else ``"lora-a"``."""
    return st.sampled_from((None,) * 7 + ("lora-a",))


def random_tokens(seed: int, length: int) -> tuple[int, ...]:
    """``length`` tokens from ``random.Random(seed)``: compact to draw, deterministic.

    Drawing one seed instead of ``length`` integers keeps long prompts within
    Hypothesis's buffer; ``seed`` shrinks to 0.
    """
    rng = random.Random(seed)
    return tuple(rng.randrange(VOCAB_SIZE) for _ in range(length))


_seeds = st.integers(0, 2**16 - 1)
