"""Paged KV / state caches (:mod:`.paged_cache`) and paged attention through block tables
(:mod:`.paged_attention`), in torch.

Neutral ground between the harness and the implementations: the attention oracle
(:mod:`properties.checks.attention`) and the optimized engine's data plane
(:mod:`optimized.device`) both import it, so the oracle depends on no engine it judges.
It imports only :mod:`reference` (layer 0.5 in ``tests/test_architecture.py``).
"""
