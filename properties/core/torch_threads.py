"""kvconform runs torch on one thread.

The tensors of a check are small: the attention oracle's (a step's queries over a few
blocks of keys), and those of an engine driven in the same process (an engine's data
plane on the CPU, SGLang's free page lists). torch's CPU thread pool (GNU OpenMP) costs
more than it saves on them: each operation hands its few elements to the pool's
threads, which spin while they wait for work, so on two busy cores the reference's
attention property took four times the CPU time with torch's default two threads (19.9 s
against 4.8 s, same 69 examples). A run of the engine
(:class:`properties.runner.run.TraceRun`) and a forked worker
(:mod:`properties.core.forked`, where the inherited pool would hang) therefore put torch
on one thread; a process that has not imported torch is left alone (importing it costs
seconds), and the benches set their own thread counts.

Worked example: in a process that imported torch, ``torch_on_one_thread()`` leaves
``torch.get_num_threads() == 1``.
"""

from __future__ import annotations

import sys


def torch_on_one_thread() -> None:
    """torch (when this process imported it) on one thread."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
