"""Torch implementations checked against the stdlib reference: paged KV caches
(:mod:`optimized.paged_cache`) and attention through block tables
(:mod:`optimized.paged_attention`). Device-agnostic: CPU, or CUDA when present."""
