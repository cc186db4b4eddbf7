"""Names and defaults that every part of kvconform shares, defined once.

* :data:`PROPERTIES`: ``invariants``, ``attention``, ``determinism``, ``production``.
* :data:`LEVELS`: ``universal`` (holds for any correct engine, whatever its allocation
  policy) and ``exact`` (the same hits, block ids and free counts as the reference:
  engines that claim vLLM's policy). :data:`DEFAULT_LEVEL` is the CLI's and the pytest
  plugin's default.
* :data:`PROFILES`: the Hypothesis profiles of :mod:`properties.runner.profiles`.
* :data:`DEFAULT_FAILURE_DIR`, :data:`DEFAULT_DATABASE_DIR`, :data:`DEFAULT_BENCH_DIR`:
  where failures, the fuzz example database and bench traces go (relative to the
  working directory).
* :data:`DEFAULT_CALL_TIMEOUT_S`: seconds one call of the engine under test may take
  (``--call-timeout``; 0 turns the deadline off). :data:`ISOLATION_MODES`: where the
  engine under test runs (``auto``: outside adapters in a child process, built-in
  engines in this one; ``process``; ``none``).
* :data:`DEFAULTS` (a :class:`Defaults`): the one set of defaults of ``kvconform check``
  and the pytest plugin (engine, profile, level, max examples, seed, call timeout,
  isolation); both read it, so ``kvconform check`` and ``pytest --pyargs
  kvconform.conformance`` run the same examples when given the same options.
* Exit codes of the ``kvconform`` command: :data:`EXIT_PASSED` 0, :data:`EXIT_FAILED` 1
  (a property failed), :data:`EXIT_USAGE` 2 (bad option or configuration),
  :data:`EXIT_ENGINE` 3 (the engine broke the protocol), :data:`EXIT_COVERAGE` 4 (a branch
  of the engine that ``--engine-coverage-baseline`` does not list is unreached),
  :data:`EXIT_INTERNAL` 70 (a bug of kvconform itself: ``EX_SOFTWARE`` of ``sysexits.h``),
  :data:`EXIT_HANGUP` 129 (SIGHUP: a closed terminal, a dropped SSH session, a CI runner
  cancelling the job), :data:`EXIT_INTERRUPTED` 130 (SIGINT) and :data:`EXIT_TERMINATED`
  143 (SIGTERM), when nothing failed before the signal. Which code a failure gives:
  :mod:`properties.core.outcome`.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The properties ``kvconform check`` runs (:mod:`properties.runner.check`).
PROPERTIES: tuple[str, ...] = ("invariants", "attention", "determinism", "production")

LEVELS: tuple[str, ...] = ("universal", "exact")
PROFILES: tuple[str, ...] = ("dev", "pr", "ci", "nightly", "gpu")

#: The spec types (``KVCacheSpec.type_name``) layouts are made of, in shrinking order
#: (full attention is the simplest); an engine declares a subset (``spec_types``).
SPEC_KINDS: tuple[str, ...] = ("full", "sliding_window", "chunked_local", "mamba")
#: The largest ``--call-timeout`` (a day); 0 turns the deadline off.
MAX_CALL_TIMEOUT_S = 86_400.0
ISOLATION_MODES: tuple[str, ...] = ("auto", "process", "none")


@dataclass(frozen=True)
class Defaults:
    """The defaults of a check run, shared by the CLI and the pytest plugin.

    ``max_examples`` and ``seed`` of ``None`` mean: the profile's number of examples, and
    no seed (the ``ci`` profile is derandomized: the same examples on every run; the
    others draw a seed and print it). Example: ``DEFAULTS.profile == "ci"``.
    """

    engine: str = "reference"
    profile: str = "ci"
    level: str = "universal"
    max_examples: int | None = None
    seed: int | None = None
    call_timeout: float = 5.0
    isolation: str = "auto"


DEFAULTS = Defaults()
DEFAULT_LEVEL = DEFAULTS.level
DEFAULT_PROFILE = DEFAULTS.profile
DEFAULT_CALL_TIMEOUT_S = DEFAULTS.call_timeout
DEFAULT_ISOLATION = DEFAULTS.isolation

DEFAULT_FAILURE_DIR = ".kvconform/failures"
DEFAULT_DATABASE_DIR = ".kvconform/hypothesis"
DEFAULT_BENCH_DIR = ".kvconform/bench"

EXIT_PASSED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_ENGINE = 3
EXIT_COVERAGE = 4
EXIT_INTERNAL = 70
EXIT_HANGUP = 129
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
