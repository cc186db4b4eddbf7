"""The optimized engine's control plane (numpy arrays): :mod:`.hashing`, :mod:`.request`,
:mod:`.block_pool`, :mod:`.managers`, :mod:`.coordinator`, :mod:`.kv_cache_manager` (the
request-level API and the batched ``schedule_step``) and :mod:`.batched_decode`. Each
module implements the rule of its namesake in :mod:`reference`; the hit scans and the
hybrid search are the reference's own functions."""
