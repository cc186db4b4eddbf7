"""The request as the optimized manager sees it (:mod:`reference.request`, array backed).

Tokens live in a growable int64 array; ``block_hashes`` grows as outputs complete blocks.
Example: a prompt of 10 tokens with ``H = 4`` has 2 hashes; 2 more outputs make 3.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from optimized.control.hashing import TOKEN_DTYPE, extend_block_hashes
from reference.errors import InvalidRequestError
from reference.request import RequestStatus


class Request:
    """Prompt and outputs in one array, computed tokens, salt, LoRA, block hashes."""

    __slots__ = (
        "request_id",
        "num_prompt_tokens",
        "num_tokens",
        "num_computed_tokens",
        "cache_salt",
        "lora_name",
        "hash_block_size",
        "status",
        "block_hashes",
        "shared_prefix_boundary",
        "_tokens",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        hash_block_size: int,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        tokens = np.asarray(prompt_token_ids, dtype=TOKEN_DTYPE)
        if tokens.ndim != 1 or tokens.size == 0:
            raise InvalidRequestError(
                f"Request.prompt_token_ids of {request_id!r} must be a non-empty 1-d "
                f"sequence, got shape {tokens.shape}"
            )
        self.request_id = request_id
        self._tokens = tokens.copy()
        self.num_prompt_tokens = int(tokens.size)
        self.num_tokens = int(tokens.size)
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.hash_block_size = hash_block_size
        self.status = RequestStatus.WAITING
        self.block_hashes: list[bytes] = []
        #: the junction the last prefix lookup found (:mod:`reference.retention`; 0: none)
        self.shared_prefix_boundary = 0
        extend_block_hashes(
            self.block_hashes, self._tokens, self.num_tokens, hash_block_size, cache_salt, lora_name
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self._tokens[: self.num_tokens].tolist()

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token: int) -> None:
        """Append one decoded token (a decode step's commit); hash the block it completes.

        Example: ``H = 4``, 7 tokens, 1 hash: appending a token makes 8 tokens, 2 hashes.
        """
        n = self.num_tokens
        if n >= self._tokens.size:
            self.append_output_token_ids((token,))
            return
        self._tokens[n] = token
        n += 1
        self.num_tokens = n
        if n % self.hash_block_size == 0:
            extend_block_hashes(
                self.block_hashes,
                self._tokens,
                n,
                self.hash_block_size,
                self.cache_salt,
                self.lora_name,
            )

    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        """Append decoded tokens and hash every block they complete."""
        if len(token_ids) == 1 and self.num_tokens < self._tokens.size:
            self.append_token(token_ids[0])
            return
        new = np.asarray(token_ids, dtype=TOKEN_DTYPE).reshape(-1)
        end = self.num_tokens + new.size
        if end > self._tokens.size:
            # headroom of an eighth (at least 64 tokens): amortised O(1) appends without
            # doubling a long prompt's array on its first output token
            size = self._tokens.size
            grown = np.empty(max(end, size + max(64, size // 8)), dtype=TOKEN_DTYPE)
            grown[: self.num_tokens] = self._tokens[: self.num_tokens]
            self._tokens = grown
        self._tokens[self.num_tokens : end] = new
        self.num_tokens = end
        extend_block_hashes(
            self.block_hashes,
            self._tokens,
            end,
            self.hash_block_size,
            self.cache_salt,
            self.lora_name,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )


def commit_updates(
    requests: Mapping[str, Request], updates: Iterable[tuple[str, int, int | None]]
) -> str | None:
    """The end of a step for every ``(request_id, num_computed_tokens, token)`` in order:
    set the computed tokens (0 marks the request preempted), then append ``token`` unless
    it is None. A token that completes no hash block and fits the array is written in
    place (no call); one completing a block goes through :meth:`Request.append_token`,
    which hashes it. Returns the first unknown id (the updates before it are applied,
    none after), else None. The requests are looked up together first (a map over the ids).

    Example: ``H = 4``, a request of 5 tokens, update ``("a", 5, 9)``: computed 5, tokens
    6, still 1 hash; a second ``("a", 6, 3)`` and ``("a", 7, 3)`` make 8 tokens, 2 hashes.
    """
    updates = updates if isinstance(updates, (list, tuple)) else list(updates)
    if not updates:
        return None
    ids, computed, tokens = zip(*updates)
    found = list(map(requests.get, ids))  # the requests looked up in one pass
    if None in found:
        k = found.index(None)
        commit_updates(requests, updates[:k])
        return ids[k]
    preempted = RequestStatus.PREEMPTED
    for req, num_computed_tokens, token in zip(found, computed, tokens):
        req.num_computed_tokens = num_computed_tokens
        if num_computed_tokens == 0:
            req.status = preempted
        if token is None:
            continue
        n = req.num_tokens
        array = req._tokens
        if n < array.size and (n + 1) % req.hash_block_size:
            array[n] = token
            req.num_tokens = n + 1
        else:
            req.append_token(token)
    return None
