"""The request as the KV cache manager sees it: tokens, progress and block hashes.

Its multimodal items and prompt embeddings (:mod:`reference.media`) enter its hashes.

``num_tokens = len(prompt) + len(outputs)``; ``num_computed_tokens`` is set by the
caller after each step (0 again after a preemption). ``block_hashes`` holds the
chained hash of every full ``hash_block_size`` block of all tokens and grows as
outputs are appended: a prompt of 10 tokens with H=4 has 2 hashes; appending 2
outputs makes 12 tokens and 3 hashes. ``shared_prefix_boundary`` is the junction
the last prefix lookup found (see :mod:`reference.retention`; 0 when none).

Asynchronous scheduling and drafts (set by the scheduler, read by the manager):
``num_in_flight_tokens`` counts tokens scheduled in steps whose output has not been
processed yet (``num_computed_tokens`` already includes them; out-of-window blocks
are freed on ``num_computed_tokens - num_in_flight_tokens``);
``num_output_placeholders`` counts sampled tokens not appended yet, and
``spec_token_ids`` the draft tokens proposed for the next step. A step may compute
up to ``num_tokens_with_pending = num_tokens + placeholders + drafts`` tokens.
Example: prompt 8, async: after the prefill step is planned, computed 8, in flight
8, one placeholder; the next step schedules the placeholder's position 8.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from reference.errors import InvalidRequestError
from reference.hashing import extend_block_hashes
from reference.media import validate_media
from reference.validation import require_int, require_str, require_token_ids


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """A request: prompt, outputs so far, computed tokens, salt, LoRA, block hashes."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        hash_block_size: int,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        num_hash_lookahead_tokens: int = 0,
        mm_items: Sequence[Sequence] = (),
        prompt_embeds: Sequence[int] | None = None,
    ) -> None:
        err = InvalidRequestError
        require_str(err, "Request", "request_id", request_id)
        require_token_ids(err, "Request", "prompt_token_ids", prompt_token_ids)
        require_int(err, "Request", "hash_block_size", hash_block_size, lowest=1)
        require_str(err, "Request", "cache_salt", cache_salt, optional=True)
        require_str(err, "Request", "lora_name", lora_name, optional=True)
        if not prompt_token_ids:
            raise InvalidRequestError(
                f"Request.prompt_token_ids of {request_id!r} must not be empty, got []"
            )
        self.mm_items, self.prompt_embeds = validate_media(
            err, "Request", len(prompt_token_ids), mm_items, prompt_embeds
        )
        self.request_id = request_id
        self.prompt_token_ids: tuple[int, ...] = tuple(map(int, prompt_token_ids))
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.hash_block_size = hash_block_size
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.status = RequestStatus.WAITING
        self.shared_prefix_boundary = 0
        self.num_in_flight_tokens = 0
        self.num_output_placeholders = 0
        self.spec_token_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        extend_block_hashes(
            self.block_hashes,
            self.prompt_token_ids,
            hash_block_size,
            cache_salt,
            lora_name,
            num_hash_lookahead_tokens,
            self.mm_items,
            self.prompt_embeds,
        )

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens a step may reach: known tokens, in-flight outputs and drafts."""
        return self.num_tokens + self.num_output_placeholders + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        """Append decoded tokens and extend the block hashes over every new full block."""
        require_token_ids(InvalidRequestError, "append_output_token_ids", "token_ids", token_ids)
        self.output_token_ids.extend(int(t) for t in token_ids)
        extend_block_hashes(
            self.block_hashes,
            self.all_token_ids,
            self.hash_block_size,
            self.cache_salt,
            self.lora_name,
            self.num_hash_lookahead_tokens,
            self.mm_items,
            self.prompt_embeds,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
