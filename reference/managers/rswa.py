"""Reference sliding-window attention (R-SWA): full attention whose decode window frees
the gap behind it.

The prompt's ``P`` tokens stay visible to every query; a generated position is visible
only to the ``W = rswa_window`` queries that follow it (:class:`reference.specs.RSWASpec`).
So, with ``n`` tokens processed (the next query at ``n``), the blocks wholly between the
prompt's last block and ``max(P, n - W)`` are dead: ``remove_skipped_blocks`` frees blocks
``[cdiv(P, bs), floor(max(P, n - W) / bs))``, walking back from the last and stopping at
the first null (those before were freed earlier), tail first. The block holding the
prompt's last tokens is never freed. Everything else (hits, caching, allocation, memory)
is full attention's: a hit scans whole cached blocks from block 0, whatever the gap.

Example (vLLM's own check values): bs 4, ``W`` 8, ``P`` 16: 28 processed tokens free
block 4 (``[16, 20)``); 36 free blocks 6 and 5 (``[20, 28)``), block 4 already null.
"""

from __future__ import annotations

from reference.managers.full import FullAttentionManager
from reference.specs import RSWASpec, cdiv


class RSWAManager(FullAttentionManager):
    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free the gap between the prompt and the window (module docstring); without the
        prompt length, full attention's rule (nothing)."""
        if num_prompt_tokens is None:  # pragma: no cover - allocate_slots always passes it
            return
        spec = self.spec
        assert isinstance(spec, RSWASpec)
        first = cdiv(num_prompt_tokens, self.block_size)
        start = max(num_prompt_tokens, num_computed_tokens - spec.rswa_window)
        self._remove_blocks_in_range(request_id, first, start // self.block_size)
