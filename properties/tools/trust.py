"""Which engine a command may run when the name comes from a file.

Traces, corpora and example databases travel between people (bug reports, CI
artifacts, shared Redis campaigns) and are untrusted data (``docs/threat-model.md``):
an engine name inside one is a request, never an instruction. A built-in engine
(:data:`properties.core.engine.BUILTIN_ENGINES`: kvconform's own adapters, chosen by
kvconform) runs without asking; any other name (``exec:COMMAND`` runs a shell command,
``module:factory`` imports and calls code) runs only when the user names it on the
command line (``--engine``) or says so (``--trust-recorded-engine``).

Worked example: a trace whose ``failure.engine`` is ``"exec:sh -c 'touch X'"``, replayed
with ``kvconform replay T.json`` and neither option, raises :class:`UntrustedEngineError`
(exit 2) whose line names the engine and the command that would run it; with
``failure.engine == "vllm"`` the replay uses vLLM, said so.
"""

from __future__ import annotations

import shlex

from properties.core.engine import BUILTIN_ENGINES
from reference.errors import KVConformError

#: The option that runs a non-built-in engine a file names.
TRUST_OPTION = "--trust-recorded-engine"


class UntrustedEngineError(KVConformError):
    """A file names an engine kvconform does not run without being told (exit 2)."""


def is_builtin(name: str) -> bool:
    """``name`` is one of kvconform's own adapters."""
    return name in BUILTIN_ENGINES


def engine_named_in_file(recorded: object, source: str, command: str, trusted: bool) -> str:
    """The engine to run for a file ``source`` that names ``recorded``: a built-in name,
    or any name when ``trusted``; else :class:`UntrustedEngineError`, whose line shows
    ``command`` (e.g. ``"kvconform replay T.json"``) with the ``--engine`` that runs it."""
    if not isinstance(recorded, str) or not recorded.strip():
        raise UntrustedEngineError(f"{source} records no engine: give --engine")
    if is_builtin(recorded) or trusted:
        return recorded
    raise UntrustedEngineError(
        f"{source} names the engine {recorded!r}, which kvconform does not run from a file "
        f"(a trace is data: docs/threat-model.md); to run it, name it yourself: "
        f"{command} --engine {shlex.quote(recorded)} (or add {TRUST_OPTION})"
    )
