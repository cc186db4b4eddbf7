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
* Exit codes of the ``kvconform`` command: :data:`EXIT_PASSED` 0, :data:`EXIT_FAILED` 1
  (a property failed), :data:`EXIT_USAGE` 2 (bad option or configuration),
  :data:`EXIT_ENGINE` 3 (the engine broke the protocol), :data:`EXIT_INTERNAL` 70 (a bug
  of kvconform itself: ``EX_SOFTWARE`` of ``sysexits.h``), :data:`EXIT_INTERRUPTED` 130
  (SIGINT) and :data:`EXIT_TERMINATED` 143 (SIGTERM), when nothing failed before the
  signal. Which code a failure gives: :mod:`properties.core.outcome`.
"""

from __future__ import annotations

#: The properties ``kvconform check`` runs (:mod:`properties.runner.check`).
PROPERTIES: tuple[str, ...] = ("invariants", "attention", "determinism", "production")

LEVELS: tuple[str, ...] = ("universal", "exact")
DEFAULT_LEVEL = "universal"

PROFILES: tuple[str, ...] = ("dev", "ci", "nightly", "gpu")
DEFAULT_PROFILE = "ci"

DEFAULT_CALL_TIMEOUT_S = 5.0
#: The largest ``--call-timeout`` (a day); 0 turns the deadline off.
MAX_CALL_TIMEOUT_S = 86_400.0
ISOLATION_MODES: tuple[str, ...] = ("auto", "process", "none")
DEFAULT_ISOLATION = "auto"

DEFAULT_FAILURE_DIR = ".kvconform/failures"
DEFAULT_DATABASE_DIR = ".kvconform/hypothesis"
DEFAULT_BENCH_DIR = ".kvconform/bench"

EXIT_PASSED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_ENGINE = 3
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
