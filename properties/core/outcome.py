"""How a run ended, in one place: the kind of a failure, its exit code, title and word.

:class:`Outcome` is the one table: every place that classifies a failure
(:func:`Outcome.of_failure` for a property run, :func:`Outcome.of_error` for an error
that ended a whole command) and every place that prints or exits on one (the
``kvconform`` command, ``check``'s table, the pytest plugin, the corpus runner) reads
it. An outcome's ``kind`` is the string saved in traces (``failure.kind``) and carried
by :class:`properties.runner.check.PropertyResult`.

====================  ====  ==============================================  =============
kind                  exit  title                                            result word
====================  ====  ==============================================  =============
``passed``            0     (none)                                           PASS
``property``          1     FAILED                                           FAIL
``usage``             2     CONFIGURATION ERROR (the engine cannot ...)      CONFIG ERROR
``no_layout``         2     NO LAYOUT                                        NO LAYOUT
``engine``            3     ENGINE ERROR (the engine broke the protocol)     ENGINE ERROR
``coverage``          4     ENGINE COVERAGE REGRESSION                       COVERAGE
``internal``          70    INTERNAL ERROR (please report it)                INTERNAL
``hangup``            129   HANGUP                                           HANGUP
``interrupted``       130   INTERRUPTED                                      INTERRUPTED
``terminated``        143   TERMINATED                                       TERMINATED
====================  ====  ==============================================  =============

Several outcomes give one exit code by :func:`combined_exit_code`: the most severe
present in the order internal, usage, engine, property, coverage (an interruption counts only
when nothing failed). Worked example: ``combined_exit_code(["property", "engine",
None])`` is 3; ``combined_exit_code([None, None])`` is 0.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from properties.core.constants import (
    EXIT_COVERAGE,
    EXIT_ENGINE,
    EXIT_FAILED,
    EXIT_HANGUP,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_PASSED,
    EXIT_TERMINATED,
    EXIT_USAGE,
)
from properties.core.engine import EngineError, EngineLoadError
from reference.errors import KVConformError


class Outcome(enum.Enum):
    """One way a run ends: ``(kind, exit code, title, result word)``."""

    PASSED = ("passed", EXIT_PASSED, "PASSED", "PASS")
    PROPERTY = ("property", EXIT_FAILED, "FAILED", "FAIL")
    USAGE = (
        "usage",
        EXIT_USAGE,
        "CONFIGURATION ERROR (the engine cannot be started)",
        "CONFIG ERROR",
    )
    NO_LAYOUT = ("no_layout", EXIT_USAGE, "NO LAYOUT", "NO LAYOUT")
    ENGINE = ("engine", EXIT_ENGINE, "ENGINE ERROR (the engine broke the protocol)", "ENGINE ERROR")
    COVERAGE = ("coverage", EXIT_COVERAGE, "ENGINE COVERAGE REGRESSION", "COVERAGE")
    INTERNAL = ("internal", EXIT_INTERNAL, "INTERNAL ERROR (please report it)", "INTERNAL")
    HANGUP = ("hangup", EXIT_HANGUP, "HANGUP", "HANGUP")
    INTERRUPTED = ("interrupted", EXIT_INTERRUPTED, "INTERRUPTED", "INTERRUPTED")
    TERMINATED = ("terminated", EXIT_TERMINATED, "TERMINATED", "TERMINATED")

    def __init__(self, kind: str, exit_code: int, title: str, word: str) -> None:
        self.kind = kind
        self.exit_code = exit_code
        self.title = title
        self.word = word

    @classmethod
    def from_kind(cls, kind: str | None) -> Outcome:
        """The outcome of a saved ``kind`` (None: passed; an unknown one: property)."""
        if kind is None:
            return cls.PASSED
        for outcome in cls:
            if outcome.kind == kind:
                return outcome
        return cls.PROPERTY

    @classmethod
    def of_failure(cls, exc: BaseException) -> Outcome:
        """The outcome of an exception that ended one property run or replay: a check
        that failed (``AssertionError``) is ``PROPERTY``; the engine breaking the
        protocol (an :class:`EngineError`: an exception, a malformed answer, a timeout)
        ``ENGINE``; an adapter that cannot be loaded ``USAGE``; anything else (a bug of
        kvconform) ``INTERNAL``. An exception carrying the engine error it stands for
        (``.error``, as the machine's ``RunStopped``) is classified by that error."""
        inner = getattr(exc, "error", None)
        if isinstance(inner, BaseException) and not isinstance(exc, Exception):
            exc = inner
        if isinstance(exc, EngineLoadError):
            return cls.USAGE
        if isinstance(exc, EngineError):
            return cls.ENGINE
        if isinstance(exc, AssertionError):
            return cls.PROPERTY
        return cls.INTERNAL

    @classmethod
    def of_error(cls, exc: BaseException) -> Outcome:
        """The outcome of an error that ended a whole command: as :meth:`of_failure`,
        but a bad value or input (``KVConformError``, ``ValueError``, ``OSError`` of a
        file named on the command line) is ``USAGE``, not a bug of kvconform."""
        outcome = cls.of_failure(exc)
        if outcome is cls.INTERNAL and isinstance(exc, (KVConformError, ValueError)):
            return cls.USAGE
        if outcome is cls.PROPERTY:  # an assertion outside a property run: our bug
            return cls.INTERNAL
        return outcome


#: The order in which several outcomes decide one exit code (most severe first).
SEVERITY: tuple[Outcome, ...] = (
    Outcome.INTERNAL,
    Outcome.USAGE,
    Outcome.NO_LAYOUT,
    Outcome.ENGINE,
    Outcome.PROPERTY,
    Outcome.COVERAGE,
)


def combined_exit_code(kinds: Iterable[str | None]) -> int:
    """The exit code of several results' kinds (see the module docstring)."""
    present = {Outcome.from_kind(k) for k in kinds if k is not None}
    for outcome in SEVERITY:
        if outcome in present:
            return outcome.exit_code
    return EXIT_PASSED
