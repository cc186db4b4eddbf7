"""Mutants of the Mamba modes (:mod:`reference.managers.mamba`): mode "none", speculative
blocks and their relocation, the estimate after a draft rollback, prefill checkpoints.
Each is the reference with ONE bug in :class:`reference.managers.mamba.MambaManager`.

Worked example, ``mamba_negative_estimate`` (vLLM 0.33's rule): bs 4, 4 speculative
blocks, a decode with 4 drafts grows the row to ``cdiv(11, 4) + 4 = 7`` columns; all are
rejected and the next step schedules one token: ``cdiv(8, 4) + 4 = 6 < 7``. The
reference estimates 0 blocks and takes none; the mutant estimates -1 and takes none:
``estimate_matches_pulls`` (or the estimate's answer check, below zero) reports it. The
ci streams rarely draw that rollback (``CI_ESCAPES``); a hand-written trace catches it.
"""

from __future__ import annotations

from collections.abc import Sequence

from properties.core.modes import PRODUCTION_SETTINGS
from properties.mutants.assembly import MutantEngine, mutant_engine
from properties.mutants.registry import REFERENCE_CATALOGUE, Registry
from reference.block_pool import KVCacheBlock
from reference.layout import KVCacheLayout
from reference.managers import MambaManager
from reference.managers.base import BlockList
from reference.request import Request
from reference.specs import cdiv

REGISTRY = Registry(REFERENCE_CATALOGUE, production_settings=PRODUCTION_SETTINGS)


class MambaNegativeEstimate(MambaManager):
    """vLLM 0.33's align-mode estimate: a running request's row longer than the step
    needs (a draft step's columns after a rollback) gives a negative count."""

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        need = super().get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            num_tokens_main,
            apply_admission_cap,
            prefill_end,
        )
        if self.align and not new_computed_blocks:
            required = cdiv(num_tokens_main, self.block_size) + self.num_speculative_blocks
            short = required - len(self.req_to_blocks.get(request_id, ()))
            if short < 0:
                return short  # BUG: not floored at 0
        return need


@REGISTRY.mutant(
    "universal",
    ["estimate_matches_pulls", "not a block count >= 0"],
    "a Mamba group's estimate goes below zero after a draft rollback (vLLM 0.33's rule)",
    "production",
)
def make_mamba_negative_estimate(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "mamba_negative_estimate", layout, managers={MambaManager: MambaNegativeEstimate}
    )


class MambaSpeculativeNotRelocated(MambaManager):
    """Leaves the speculative blocks a step passes where they are (fresh blocks are taken
    for the new speculative columns instead of moving them)."""

    def _relocate(self, blocks: BlockList, column: int) -> None:
        return  # BUG: the old speculative blocks stay, new ones are taken


@REGISTRY.mutant(
    "universal",
    ["estimate_matches_pulls", "cannot get"],
    "Mamba speculative blocks are not relocated when the running state passes them",
    "production",
)
def make_mamba_not_relocated(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "mamba_not_relocated", layout, managers={MambaManager: MambaSpeculativeNotRelocated}
    )


class MambaNoneWithoutDraftSlots(MambaManager):
    """Mode "none" forgets the speculative blocks: a row holds the state block only."""

    def _draft_slots(self) -> int:
        return 0  # BUG: k * bs slots dropped


@REGISTRY.mutant(
    "universal",
    ["table_covers_slots"],
    'Mamba mode "none" takes no speculative blocks',
    "production",
)
def make_mamba_none_without_draft_slots(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "mamba_none_without_draft_slots",
        layout,
        managers={MambaManager: MambaNoneWithoutDraftSlots},
    )


class MambaCheckpointUnkeyed(MambaManager):
    """Reserves the prefill checkpoint's block but never keys it at the checkpoint."""

    def _cache_checkpoint(self, request: Request) -> bytes | None:
        return None  # BUG: the checkpoint's state is never registered


@REGISTRY.mutant(
    "exact",
    ["exact_match"],
    "a Mamba prefill checkpoint block is never keyed at its checkpoint",
    "production",
)
def make_mamba_checkpoint_unkeyed(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "mamba_checkpoint_unkeyed", layout, managers={MambaManager: MambaCheckpointUnkeyed}
    )


class MambaEagleLookPast(MambaManager):
    """Under EAGLE, a Mamba lookup looks one block past the candidate, as the attention
    groups do before their drop (but a Mamba hit never drops): the hit outgrows the
    other groups' agreed length."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        group_ids: Sequence[int],
        pool,
        spec,
        alignment: int,
        drop_eagle: bool = False,
    ) -> tuple[list[BlockList], int]:
        if drop_eagle:
            hashed = len(block_hashes) * pool.hash_block_size
            max_length = min(max_length + spec.block_size, hashed)  # BUG: looks past
        return super().find_longest_cache_hit(
            block_hashes, max_length, group_ids, pool, spec, alignment, drop_eagle
        )


@REGISTRY.mutant(
    "exact",
    ["exact_match"],
    "under EAGLE a Mamba lookup looks one block past the candidate (it never drops)",
    "production",
)
def make_mamba_eagle_look_past(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "mamba_eagle_look_past", layout, managers={MambaManager: MambaEagleLookPast}
    )


class MambaPromptTailUnkeyed(MambaManager):
    """Never keys the prompt's own checkpoint on the hash grid when the retention mask
    left its state out."""

    def _cache_prompt_tail(self, request: Request, num_tokens: int) -> bytes | None:
        return None  # BUG: the prompt tail's state is never registered


@REGISTRY.mutant(
    "exact",
    ["exact_match"],
    "a Mamba prompt tail on the hash grid that retention left out is never keyed",
    "production",
)
def make_mamba_prompt_tail_unkeyed(layout: KVCacheLayout) -> MutantEngine:
    return mutant_engine(
        "mamba_prompt_tail_unkeyed", layout, managers={MambaManager: MambaPromptTailUnkeyed}
    )
