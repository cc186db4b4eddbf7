"""A forked child of a parent that ran torch in parallel does not hang (properties.core.forked)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

torch = pytest.importorskip("torch")


def _child(out) -> None:
    from properties.core.forked import settle_forked_child

    settle_forked_child()
    x = torch.zeros(10**7)
    x.add_(1)
    out.put((float(x.sum()), torch.get_num_threads()))


def test_a_forked_child_runs_torch_after_the_parent_ran_a_parallel_region():
    """The parent runs a 10^7-element fill on torch's thread pool, then forks; the child
    settles and fills 10^7 ones: it answers 10^7 on 1 thread within the minute (without
    settling, GNU OpenMP's child waits forever for the parent's pool threads)."""
    torch.zeros(10**7).add_(1).sum()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(out,))
    proc.start()
    proc.join(60)
    alive = proc.is_alive()
    if alive:
        proc.kill()
        proc.join()
    assert not alive, "the forked child hung in torch"
    assert out.get(timeout=5) == (1e7, 1)
