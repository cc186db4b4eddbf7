"""The request as the optimized manager sees it (:mod:`reference.request`, split storage).

The prompt lives in an int64 array (hashed in one pass when the request is made); decoded
tokens live in a Python list, so the common end of a decode step (one token, no block
completed) is a list append and two integer stores. ``block_hashes`` grows as outputs
complete blocks. Example: a prompt of 10 tokens with ``H = 4`` has 2 hashes; 2 more
outputs make 3, the third hashing prompt tokens 8, 9 and the two outputs.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from optimized.control.hashing import (
    KEY_BYTES,
    ROOT_HASH,
    TOKEN_DTYPE,
    HashChain,
    chain_link,
    extend_block_hashes,
    extra_key_bytes,
)
from reference.errors import InvalidRequestError
from reference.request import RequestStatus

#: ``struct`` packers of ``m`` little-endian int64 tokens, by ``m`` (the bytes
#: :func:`optimized.control.hashing.extend_block_hashes` hashes for a block)
_PACKERS: dict[int, Callable[..., bytes]] = {}


def _pack(tokens: Sequence[int]) -> bytes:
    """``tokens`` as little-endian int64 bytes, the block encoding of
    :func:`optimized.control.hashing.extend_block_hashes`.

    Example: ``_pack([1, 2])`` is ``(1).to_bytes(8, "little") + (2).to_bytes(8, "little")``.
    """
    m = len(tokens)
    packer = _PACKERS.get(m)
    if packer is None:
        packer = _PACKERS[m] = struct.Struct(f"<{m}q").pack
    try:
        return packer(*tokens)
    except struct.error:
        raise InvalidRequestError(
            f"output token ids must be int64 integers, got {list(tokens)!r}"
        ) from None


#: spare hash slots given to a request's hash list when it is made (16 blocks of outputs)
_HASH_HEADROOM = 16


def _reserve(items: list, extra: int) -> None:
    """Give ``items`` room for ``extra`` more appends without a reallocation (CPython keeps
    a list's capacity when it shrinks by less than half). A prompt of 2048 tokens at
    ``H = 16`` fills a hash list grown one append at a time to its capacity, 128, exactly:
    without the room, the first decode step completing a block moves every such list.

    Example: ``_reserve(hashes, 16)`` on 128 hashes: capacity 168 (the growth rule at 144),
    still 128 hashes.
    """
    n = len(items)
    list.extend(items, [None] * extra)  # (a HashChain's own extend writes hashes)
    del items[n:]


class Request:
    """Prompt array, output list, computed tokens, salt, LoRA, block hashes.

    ``num_tokens`` is always ``num_prompt_tokens + len(outputs)``; the fields a decode
    step's commit writes come first in ``__slots__`` (adjacent in memory).
    """

    __slots__ = (
        "num_computed_tokens",
        "num_tokens",
        "hash_block_size",
        "_outputs",
        "block_hashes",
        "status",
        "request_id",
        "num_prompt_tokens",
        "cache_salt",
        "lora_name",
        "shared_prefix_boundary",
        "_prompt",
        "_extra",
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
        self._prompt = tokens.copy()
        self._outputs: list[int] = []
        self.num_prompt_tokens = int(tokens.size)
        self.num_tokens = int(tokens.size)
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.hash_block_size = hash_block_size
        self.status = RequestStatus.WAITING
        #: the chain of block hashes (its int64 words for the key index kept alongside)
        self.block_hashes = HashChain()
        #: the junction the last prefix lookup found (:mod:`reference.retention`; 0: none)
        self.shared_prefix_boundary = 0
        #: extra keys of every block but block 0 (the LoRA name)
        self._extra = extra_key_bytes(1, None, lora_name)
        extend_block_hashes(
            self.block_hashes, self._prompt, self.num_tokens, hash_block_size, cache_salt, lora_name
        )
        _reserve(self.block_hashes, _HASH_HEADROOM)

    @property
    def all_token_ids(self) -> list[int]:
        return self._prompt.tolist() + self._outputs

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token: int) -> None:
        """Append one decoded token (a decode step's commit); hash the block it completes.

        Example: ``H = 4``, 7 tokens, 1 hash: appending a token makes 8 tokens, 2 hashes.
        """
        self._outputs.append(token)
        self.num_tokens += 1
        if not self.num_tokens % self.hash_block_size:
            self._hash_new_blocks()

    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        """Append decoded tokens and hash every block they complete."""
        new = np.asarray(token_ids, dtype=TOKEN_DTYPE).reshape(-1).tolist()
        self._outputs += new
        self.num_tokens += len(new)
        self._hash_new_blocks()

    def _hash_new_blocks(self) -> None:
        """Hash every full block of the tokens not hashed yet (the chain of
        :func:`optimized.control.hashing.extend_block_hashes`, bit for bit).

        Example: ``H = 4``, prompt ``[1, 2, 3, 4, 5]`` (1 hash), outputs ``[9, 3, 3]``: block 1
        is prompt token 5 then outputs 9, 3, 3, chained on hash 0.
        """
        h = self.hash_block_size
        hashes = self.block_hashes
        j = len(hashes)
        end = self.num_tokens // h
        if j >= end:
            return
        p = self.num_prompt_tokens
        outputs = self._outputs
        parent = hashes[-1] if j else ROOT_HASH
        for k in range(j, end):
            a = k * h - p
            if a >= 0:
                raw = _pack(outputs[a : a + h])
            else:
                raw = self._prompt[a:].tobytes() + _pack(outputs[: a + h])
            extra = self._extra if k else extra_key_bytes(0, self.cache_salt, self.lora_name)
            parent = chain_link(parent, raw, extra)
            hashes.append(parent)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )


def commit_updates(
    requests: Mapping[str, Request],
    updates: Iterable[tuple[str, int, int | None]],
    unhashed: list[Request] | None = None,
) -> str | None:
    """The end of a step for every ``(request_id, num_computed_tokens, token)`` in order:
    set the computed tokens (0 marks the request preempted), then append ``token`` unless
    it is None. The common update (a token completing no block) is a list append and two
    integer stores; the blocks the step completes are hashed together after the loop
    (:func:`hash_completed_blocks`), or, given ``unhashed``, left to the caller: each
    request whose tokens completed a block is appended to it, its ``block_hashes`` lagging
    until the caller passes the list to :func:`hash_completed_blocks` (before anything
    reads them). Returns the first unknown id (the updates before it are applied, none
    after), else None.

    Example: ``H = 4``, a request of 5 tokens, update ``("a", 5, 9)``: computed 5, tokens
    6, still 1 hash; a second ``("a", 6, 3)`` and ``("a", 7, 3)`` make 8 tokens, 2 hashes.
    """
    preempted = RequestStatus.PREEMPTED
    completed: list[Request] = [] if unhashed is None else unhashed
    request_id = None
    try:
        for request_id, num_computed_tokens, token in updates:
            req = requests[request_id]
            req.num_computed_tokens = num_computed_tokens
            if not num_computed_tokens:
                req.status = preempted
            if token is not None:
                n = req.num_tokens + 1
                req.num_tokens = n
                req._outputs.append(token)
                if not n % req.hash_block_size:
                    completed.append(req)
    except KeyError:
        if request_id in requests:
            raise
        return request_id
    finally:
        if unhashed is None and completed:
            hash_completed_blocks(completed)
    return None


def hash_completed_blocks(requests: Sequence[Request]) -> None:
    """Hash the blocks the last tokens of ``requests`` completed, in one pass after a step.

    The common case, a request whose tokens complete exactly one block past its hashes,
    that block made of outputs only, is one link straight from the output list
    (:func:`optimized.control.hashing.chain_link`); any other request (a block holding
    prompt tokens, block 0, several blocks) hashes its own blocks
    (:meth:`Request._hash_new_blocks`), which leaves one already up to date as it is.
    Example: ``H = 4``, prompt ``[1, 2, 3, 4]`` (1 hash) and outputs ``[5, 6, 7, 8]``:
    block 1 is ``[5, 6, 7, 8]`` chained on hash 0 (the common case). The new hash's bytes
    go straight into the chain's buffer when it has room (no Python call of
    :meth:`~optimized.control.hashing.HashChain.append`: thousands of requests complete
    a block in the same step).
    """
    for req in requests:
        hashes = req.block_hashes
        j = len(hashes)
        h = req.hash_block_size
        a = j * h - req.num_prompt_tokens
        if a < 0 or not j or req.num_tokens // h != j + 1:
            req._hash_new_blocks()
            continue
        digest = chain_link(hashes[-1], _pack(req._outputs[a : a + h]), req._extra)
        raw = hashes.raw
        end = KEY_BYTES * (j + 1)
        if len(raw) >= end:  # (a digest is KEY_BYTES long: the buffer keeps its size)
            raw[end - KEY_BYTES : end] = digest
            list.append(hashes, digest)
        else:
            hashes.append(digest)
