"""The engine under test in a child process, so that no call can hang the harness.

:func:`isolated_factory` wraps a factory named ``module:factory`` (or a built-in name)
into an :class:`IsolatedFactory`: each engine is built and driven in a child process,
``python -m properties.engines.serve TARGET`` (:mod:`properties.engines.serve`), through
the exec protocol client (:mod:`properties.engines.exec_engine`). A call that runs past
the call timeout kills the child and is reported as a
:class:`properties.core.engine.CallTimeoutError` naming the call, whatever the engine
was doing, C code holding the GIL included; a child that crashes is an engine error
with its exit status and the tail of its stderr.

The factory's own attributes (``layout_strategy``, ``known_divergences``,
``spec_types``, ``production_settings``, ``version``, ``coverage_modules``) are read from
the factory imported in this process, so layouts are drawn exactly as without isolation;
the serving modes travel too (the child announces ``serving_modes`` for an engine that offers
:class:`properties.core.engine.SupportsServingModes`, and the client engine then offers
it), so the ``production`` property drives an isolated adapter in every mode it would
drive it in process.

When isolation applies (:func:`wants_isolation`): ``--isolation process`` always;
``none`` never; ``auto`` (the default) for adapters named ``module:factory`` (code
kvconform does not know) when a call timeout is set, never for the built-in engines
(``reference``, ``vllm``, ``sglang``, ``lmdeploy``: their calls are Python, which the in-process
deadline of :mod:`properties.core.deadline` interrupts, and they run faster in
process), nor for ``exec:`` engines (already a child process).

Worked example: ``isolated_factory("my_pkg.adapter:make_engine", factory, 5.0)(layout)``
returns an engine whose calls each travel to a child; a call still running after 5 s
kills the child and raises ``CallTimeoutError``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from properties.core.engine import BUILTIN_ENGINES, EngineError
from properties.engines.exec_engine import ExecEngineFactory
from reference.layout import KVCacheLayout

#: The timeout of an isolated engine when ``--call-timeout 0`` asks for none (a year).
NO_TIMEOUT_S = 365 * 24 * 3600.0
#: The attributes of the wrapped factory an :class:`IsolatedFactory` carries.
FACTORY_ATTRIBUTES = (
    "layout_strategy",
    "known_divergences",
    "spec_types",
    "production_settings",
    "version",
    "coverage_modules",
)


def wants_isolation(name: str, isolation: str, call_timeout: float) -> bool:
    """Whether engine ``name`` runs in a child process (see the module docstring)."""
    if name.startswith("exec:") or isolation == "none":
        return False
    if isolation == "process":
        return True
    return name not in BUILTIN_ENGINES and call_timeout > 0


class IsolatedFactory:
    """``factory(layout)`` built and driven in a child process (see the module docstring)."""

    #: The child's deadline replaces the in-process one (EngineUnderTest.call_timeout).
    enforces_call_timeout = True

    def __init__(self, name: str, factory: Callable, call_timeout: float) -> None:
        self.name = name
        self.factory = factory
        self.__name__ = getattr(factory, "__name__", name)
        timeout = call_timeout if call_timeout > 0 else NO_TIMEOUT_S
        command = [sys.executable, "-m", "properties.engines.serve", name]
        self.exec_factory = ExecEngineFactory(command, timeout)

    def __getattr__(self, attribute: str) -> Any:
        # the factory's own (see the module docstring)
        if attribute in FACTORY_ATTRIBUTES:
            return getattr(self.factory, attribute)
        raise AttributeError(attribute)

    def __call__(self, layout: KVCacheLayout) -> Any:
        return self.exec_factory(layout)

    def close(self) -> None:
        self.exec_factory.close()


def isolated_factory(name: str, factory: Callable, call_timeout: float) -> IsolatedFactory:
    if not callable(factory):
        raise EngineError(f"--engine {name!r}: the factory is not callable")
    return IsolatedFactory(name, factory, call_timeout)
