"""The optimized implementation of the reference's contract (vLLM 0.33 policy, exact).

Control plane (numpy): :mod:`optimized.hashing`, :mod:`optimized.request`,
:mod:`optimized.block_pool`, :mod:`optimized.managers`, :mod:`optimized.coordinator`,
:mod:`optimized.kv_cache_manager` (request-level API and the batched ``schedule_step``,
with :mod:`optimized.batched_decode`). Data plane (torch; CUDA when present):
:mod:`optimized.device_tables`, :mod:`optimized.slot_mapping`, :mod:`optimized.paged_cache`,
:mod:`optimized.paged_attention`, :mod:`optimized.data_plane`, :mod:`optimized.nvrtc_kernels`.
Exposed as the ``optimized`` engine by :mod:`properties.engines.optimized`.
"""
