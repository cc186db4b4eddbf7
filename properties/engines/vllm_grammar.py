"""The grammars vLLM's scheduler sees at the scheduler level (``structured_output``): a
grammar object per request and the backend that allocates the bitmask, with no tokenizer
and no grammar compiler.

vLLM's scheduler asks a request's grammar three things: to accept the sampled tokens
(``accept_tokens``; a rejection ends the request with an error), which drafts it allows
(``validate_tokens``: the longest valid prefix) and, for the engine core, to fill its
row of the token bitmask (``fill_bitmask``). :class:`PlannedGrammar` answers from the
request's :class:`properties.core.scheduler_options.GrammarPlan`: every token but the
plan's ``rejected_token`` is valid, so a request fails exactly when its trace samples that
token. :class:`GrammarBackend` is what vLLM's ``StructuredOutputManager`` uses as its
backend: a bitmask of one 32-bit word per row (no token is ever masked: there is no
sampler).

Example: ``PlannedGrammar(GrammarPlan(0, False, 3)).validate_tokens([1, 2, 3, 4]) ==
[1, 2]``; ``accept_tokens("r0", [5, 3])`` is False.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

from properties.core.scheduler_options import GrammarPlan


class PlannedGrammar(StructuredOutputGrammar):
    """A request's grammar (module docstring); it has no state, so ``rollback`` and
    ``reset`` change nothing."""

    def __init__(self, plan: GrammarPlan) -> None:
        self.plan = plan

    def _valid(self, token: int) -> bool:
        return token != self.plan.rejected_token

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return all(self._valid(t) for t in tokens)

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        valid: list[int] = []
        for token in tokens:
            if not self._valid(token):
                break
            valid.append(token)
        return valid

    def rollback(self, num_tokens: int) -> None:
        return None

    def fill_bitmask(self, bitmask: Any, batch_index: int) -> None:
        bitmask[batch_index].fill_(-1)

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        return None


class GrammarBackend:
    """The ``StructuredOutputManager.backend`` of the harness: one bitmask word per
    row."""

    def allocate_token_bitmask(self, max_num_seqs: int) -> Any:
        import torch

        return torch.full((max_num_seqs, 1), -1, dtype=torch.int32)

    def destroy(self) -> None:
        return None


__all__ = ["GrammarBackend", "PlannedGrammar"]
