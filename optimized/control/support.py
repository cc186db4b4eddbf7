"""Which layouts the optimized engine serves exactly.

Rule: it serves every layout of the reference except those needing a feature it does not
model: a Mamba group in another mode than plain ``"align"`` (mode ``"none"``, speculative
or prefill checkpoint blocks), partial (sub-block) prefix hits (copy-on-write of a Mamba
block, fine-grained lookups), R-SWA's gap or a circular buffer's ring. Example: full bs 4 +
Mamba bs 4 is served; full bs 4 + Mamba bs 8 is not (its hits may end inside a Mamba
block: ``KVCacheLayout.partial_hits_enabled``).
"""

from __future__ import annotations

from reference.layout import KVCacheLayout
from reference.specs import CircularBufferSpec, MambaSpec, RSWASpec


def unsupported_reason(layout: KVCacheLayout) -> str | None:
    """Why the optimized engine refuses ``layout`` (one line), or None if it serves it."""
    for spec in layout.specs:
        if isinstance(spec, MambaSpec) and (
            not spec.is_align or spec.num_speculative_blocks or spec.num_prefill_checkpoint_blocks
        ):
            return (
                "Mamba groups run in plain 'align' mode only (no mode 'none', speculative "
                f"or prefill checkpoint blocks), got layout {layout.describe()}"
            )
    if layout.partial_hits_enabled:
        return (
            "partial (sub-block) prefix hits are not implemented (a Mamba group coarser "
            "than the hash block size)"
        )
    if any(isinstance(s, (RSWASpec, CircularBufferSpec)) for s in layout.specs):
        return "R-SWA and circular buffer groups are not implemented"
    return None
