"""A forked child starts clean of what it inherited and cannot use.

Two things a forked child of kvconform inherits do not work in it:

* the parent's call-deadline timer (:mod:`properties.core.deadline`): the flag is copied,
  the timer is not, so the child stops ticking;
* torch's CPU thread pool (GNU OpenMP): a parent that ran a parallel region leaves the
  pool's bookkeeping in the child without its threads, and the child's first parallel
  region waits for them forever. A child whose parent had imported torch therefore runs
  torch on one thread (no parallel region, no hang).

Worked example: the parent ran ``torch.zeros(10**7)``; a forked child that calls
``settle_forked_child()`` and then ``torch.zeros(10**7)`` returns at once, while one that
does not hangs (``tests/properties/core/test_forked.py``).
"""

from __future__ import annotations

from properties.core.deadline import stop_ticking
from properties.core.torch_threads import torch_on_one_thread


def settle_forked_child() -> None:
    """Stop the inherited deadline timer; torch (if the parent imported it) on one thread."""
    stop_ticking()
    torch_on_one_thread()
