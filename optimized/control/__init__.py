"""The optimized engine's control plane (numpy arrays): :mod:`.hashing`, :mod:`.request`,
:mod:`.block_pool`, :mod:`.managers`, :mod:`.coordinator`, :mod:`.kv_cache_manager` (the
request-level API and the batched ``schedule_step``), :mod:`.batched_decode` and
:mod:`.uniform_decode` (a decode step's working items together). Each
module implements the rule of its namesake in :mod:`reference`. The hybrid search is
the reference's function, with two one-pass forms in :mod:`.coordinator` (a miss settled
by one lookup; one full-attention spec group plus one other); the per-type hit scans do
their lookups in bulk. Each form is tested against the reference's rule."""
