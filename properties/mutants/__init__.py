"""Mutant engines: the reference (or the optimized engine) with ONE realistic bug each,
which the suite must catch.

The reference's mutants live by what they break: :mod:`~properties.mutants.pool` (the
block pool), :mod:`~properties.mutants.managers` (single-type managers and the hybrid
coordinator), :mod:`~properties.mutants.request_level` (the request-level manager and
the requests' hashes), :mod:`~properties.mutants.serving_modes` (asynchronous
scheduling, drafts, the admission gate, external hits) and
:mod:`~properties.mutants.mamba_modes` (Mamba mode "none", speculative blocks, prefill
checkpoints). Each subclasses one reference
class and overrides the least it can; the line carrying the bug is marked ``# BUG``.
Each factory ``make_<name>`` is registered next to its class
(:class:`properties.mutants.registry.Registry`) with what the bug is, which level of the
suite catches it and which checks fire; :data:`MUTANT_INFO` collects them here.

A mutant is addressed as ``--engine properties.mutants.reference_mutants:make_<name>``
(that module re-exports every factory). The optimized engine's mutants are in
:mod:`properties.mutants.optimized_mutants` (it imports torch, so it is not collected
here).
"""

from __future__ import annotations

from properties.mutants import mamba_modes, managers, pool, request_level, serving_modes
from properties.mutants.registry import MutantInfo, collect

#: Mutant name -> its catalogue entry, module by module in definition order.
MUTANT_INFO: dict[str, MutantInfo] = collect(
    pool.REGISTRY,
    managers.REGISTRY,
    request_level.REGISTRY,
    serving_modes.REGISTRY,
    mamba_modes.REGISTRY,
)

#: Mutant name -> ``module:factory`` (for ``--engine``).
MUTANTS: dict[str, str] = {name: info.target for name, info in MUTANT_INFO.items()}
