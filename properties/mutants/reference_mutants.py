"""The address of the reference's mutants on ``--engine``:
``properties.mutants.reference_mutants:make_<name>`` (every factory registered in
:mod:`properties.mutants` is an attribute of this module), and the catalogue
(:data:`MUTANT_INFO`, :data:`MUTANTS`). The mutants themselves live by what they break
(see :mod:`properties.mutants`).

Example: ``load_engine_factory("properties.mutants.reference_mutants:make_swa_off_by_one")``
is :func:`properties.mutants.managers.make_swa_off_by_one`.
"""

from __future__ import annotations

# the names other modules import from here (re-exported)
from properties.mutants import MUTANT_INFO as MUTANT_INFO
from properties.mutants import MUTANTS as MUTANTS
from properties.mutants.assembly import MutantEngine as MutantEngine
from properties.mutants.assembly import mutated_manager as mutated_manager
from properties.mutants.pool import BareEngine as BareEngine
from properties.mutants.registry import MutantInfo as MutantInfo

# every factory under its own name, as ``--engine module:make_<name>`` looks it up
globals().update({info.factory.__name__: info.factory for info in MUTANT_INFO.values()})
