"""Mutants of the request-level manager and the requests: the reference with ONE bug in
:class:`reference.kv_cache_manager.KVCacheManager` or :class:`reference.request.Request`
(block hashes, the lookup cap, the order of frees, failed allocations).

Worked example, ``no_hit_cap``: an 8-token prompt whose two blocks (bs 4) are cached is
looked up again; the reference caps the lookup at ``8 - 1`` tokens (hit 4, one block),
so one token is left to compute the logits; the mutant hits all 8: ``hit_bounds``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from properties.core.modes import PRODUCTION_SETTINGS
from properties.mutants.assembly import MutantEngine, mutant_engine
from properties.mutants.registry import REFERENCE_CATALOGUE, Registry
from reference.block_pool import KVCacheBlock
from reference.hashing import block_extra_keys, extend_block_hashes, hash_block_tokens
from reference.kv_cache_manager import ComputedBlocks, KVCacheManager
from reference.layout import KVCacheLayout
from reference.request import Request

REGISTRY = Registry(REFERENCE_CATALOGUE, production_settings=PRODUCTION_SETTINGS)


class UncappedLookupManager(KVCacheManager):
    """Looks up ``num_tokens`` tokens instead of ``num_tokens - 1``: a whole cached prompt
    hits, leaving no token to compute for the logits."""

    def get_computed_blocks(self, request: Request) -> tuple[ComputedBlocks, int]:
        if not self.enable_caching:
            return self.empty_computed_blocks(), 0
        blocks, hit, uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens
        )  # BUG: no -1
        request.shared_prefix_boundary = hit + uncached if uncached else 0
        return ComputedBlocks(tuple(tuple(b) for b in blocks)), hit


@REGISTRY.mutant(
    "universal",
    ["hit_bounds"],
    "prefix lookup not capped at num_tokens - 1 (a whole prompt can hit)",
)
def make_no_hit_cap(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("no_hit_cap", layout, manager_cls=UncappedLookupManager)


class HeadFirstFreeManager(KVCacheManager):
    """Frees a request's blocks head first: the chain's head reaches the eviction end of
    the free queue before its tail."""

    def free(self, request: Request) -> None:
        held = [m.pop_blocks_for_free(request.request_id) for m in self.coordinator.managers]
        super().free(request)  # the tables are already empty: frees nothing
        for blocks in held:
            self.block_pool.free_blocks(blocks)  # BUG: not reversed


@REGISTRY.mutant(
    "exact",
    ["exact_match"],
    "a request's blocks are freed head first instead of tail first",
)
def make_free_head_first(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("free_head_first", layout, manager_cls=HeadFirstFreeManager)


def extend_hashes_without_parent(
    hashes: list[bytes],
    token_ids: Sequence[int],
    hash_block_size: int,
    cache_salt: str | None,
    lora_name: str | None,
) -> None:
    """Like :func:`reference.hashing.extend_block_hashes` but every link hashes only its
    own tokens: equal blocks behind different prefixes get equal hashes."""
    h = hash_block_size
    while (len(hashes) + 1) * h <= len(token_ids):
        j = len(hashes)
        hashes.append(
            hash_block_tokens(
                None,
                token_ids[j * h : (j + 1) * h],  # BUG: None
                block_extra_keys(j, cache_salt, lora_name),
            )
        )


class ParentlessHashRequest(Request):
    """A request whose block hashes ignore the parent hash."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        hash_block_size: int,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        super().__init__(request_id, prompt_token_ids, hash_block_size, cache_salt, lora_name)
        self.block_hashes = []
        self._extend_hashes()

    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        self.output_token_ids.extend(int(t) for t in token_ids)
        self._extend_hashes()

    def _extend_hashes(self) -> None:
        extend_hashes_without_parent(
            self.block_hashes,
            self.all_token_ids,
            self.hash_block_size,
            self.cache_salt,
            self.lora_name,
        )


class ParentlessHashManager(KVCacheManager):
    def make_request(
        self,
        request_id: str,
        prompt_token_ids,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> Request:
        super().make_request(request_id, prompt_token_ids, cache_salt, lora_name)  # validation
        return ParentlessHashRequest(
            request_id, prompt_token_ids, self.layout.hash_block_size, cache_salt, lora_name
        )


@REGISTRY.mutant(
    "universal",
    ["hit_soundness"],
    "block hashes ignore the parent hash (equal blocks behind other prefixes hit)",
)
def make_hash_no_parent(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("hash_no_parent", layout, manager_cls=ParentlessHashManager)


class LeakyFailedAllocationManager(KVCacheManager):
    """Takes references on the hit blocks before the capacity check and, when the check
    fails and ``None`` is returned, does not give them back (observably the same as
    touching on the failure path, which is how it is written here)."""

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[list[KVCacheBlock]] | None:
        new = super().allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
        )
        if new is None and new_computed_blocks is not None:
            hit = [b for group in new_computed_blocks.blocks for b in group]
            self.block_pool.touch(hit)  # BUG: the hit's references leak
        return new


@REGISTRY.mutant(
    "universal",
    ["failed_allocation"],
    "a failed allocation keeps the references it took on its hit blocks",
)
def make_leaky_failed_allocation(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "leaky_failed_allocation", layout, manager_cls=LeakyFailedAllocationManager
    )


class SaltIgnoredManager(KVCacheManager):
    """Builds every request's hashes without its cache salt."""

    def make_request(
        self,
        request_id: str,
        prompt_token_ids,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> Request:
        return super().make_request(request_id, prompt_token_ids, None, lora_name)  # BUG


@REGISTRY.mutant(
    "universal",
    ["hit_soundness"],
    "the cache salt is left out of block hashes (salted prefixes hit each other)",
)
def make_salt_ignored(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("salt_ignored", layout, manager_cls=SaltIgnoredManager)


class LookaheadIgnoredRequest(Request):
    """Hashes blocks as if there were no lookahead tokens (the next tokens are not keyed)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_hash_lookahead_tokens = 0  # BUG: lookahead hashes dropped
        self.block_hashes.clear()
        extend_block_hashes(
            self.block_hashes,
            self.prompt_token_ids,
            self.hash_block_size,
            self.cache_salt,
            self.lora_name,
        )


class LookaheadIgnoredManager(KVCacheManager):
    def make_request(self, request_id, prompt_token_ids, cache_salt=None, lora_name=None):
        base = super().make_request(request_id, prompt_token_ids, cache_salt, lora_name)
        return LookaheadIgnoredRequest(
            request_id,
            prompt_token_ids,
            base.hash_block_size,
            cache_salt,
            lora_name,
            base.num_hash_lookahead_tokens,
        )


@REGISTRY.mutant(
    "exact",
    ["exact_match"],
    "lookahead hashes left out: a block is keyed without the tokens after it",
    "production",
)
def make_lookahead_hashes_ignored(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("lookahead_hashes_ignored", layout, manager_cls=LookaheadIgnoredManager)


class CachingAlwaysManager(KVCacheManager):
    """Ignores ``enable_caching``: builds its pool and managers as if prefix caching were
    on, so a layout that turns caching off still registers blocks and answers hits."""

    def __init__(self, layout: KVCacheLayout) -> None:
        super().__init__(replace(layout, enable_caching=True))  # BUG: the flag is dropped


@REGISTRY.mutant(
    "universal",
    ["hit_bounds"],
    "prefix caching stays on when the layout turns it off (an engine of full attention only)",
)
def make_ignores_enable_caching(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine("ignores_enable_caching", layout, manager_cls=CachingAlwaysManager)


# (a full-attention-only engine: the blind spot was engines whose declarations left the
# targeted layouts, which alone turned caching off, out of their draws)
make_ignores_enable_caching.spec_types = ("full",)  # type: ignore[attr-defined]
