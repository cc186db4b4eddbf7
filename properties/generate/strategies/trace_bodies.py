"""Single operations and whole traces of the small tier: token budgets, lookaheads,
steps, aborts, preemptions, resets (for the stateful machine's rules), a whole trace
body (:func:`operations`) and a whole ``Trace`` (:func:`traces`).

Example: a trace body starts with ``Arrive("r0", ...)``; later arrivals are ``r1``,
``r2``, ... in order, and an ``Abort`` names an arrived, not yet aborted request.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from properties.core.trace import (
    Abort,
    Operation,
    Preempt,
    ResetPrefixCache,
    Step,
    Trace,
)
from properties.generate.strategies.arrivals import prefix_pools, request_inputs
from properties.generate.strategies.reuse import _reused
from properties.generate.strategies.scenario_mix import any_layouts
from reference.layout import KVCacheLayout
from reference.specs import MambaSpec


@_reused
def token_budgets(layout: KVCacheLayout) -> st.SearchStrategy[int]:
    """A step's token budget: ``max_model_len`` (the shrink target), 1 to a few
    scheduler blocks (chunked prefill, drawn twice as often), or anything up to
    ``2 * max_model_len``."""
    small = st.integers(1, 3 * layout.scheduler_block_size)
    return st.one_of(
        st.just(layout.max_model_len),
        small,
        small,
        st.integers(1, 2 * layout.max_model_len),
    )


@_reused
def lookaheads(layout: KVCacheLayout) -> st.SearchStrategy[int]:
    """Speculative lookahead slots: 0 mostly, 1..4 sometimes; always 0 with a Mamba
    group (its spec has no speculative blocks)."""
    if any(isinstance(s, MambaSpec) for s in layout.specs):
        return st.just(0)
    return st.sampled_from((0, 0, 0, 0, 1, 2, 3, 4))


@_reused
def step_ops(layout: KVCacheLayout) -> st.SearchStrategy[Step]:
    return st.builds(Step, token_budgets(layout), lookaheads(layout))


def abort_ops(request_ids: Sequence[str]) -> st.SearchStrategy[Abort]:
    """Abort one of ``request_ids`` (must be non-empty)."""
    return st.sampled_from(tuple(request_ids)).map(Abort)


def preempt_ops(request_ids: Sequence[str]) -> st.SearchStrategy[Preempt]:
    """Preempt one of ``request_ids`` (must be non-empty)."""
    return st.sampled_from(tuple(request_ids)).map(Preempt)


def reset_ops() -> st.SearchStrategy[ResetPrefixCache]:
    return st.just(ResetPrefixCache())


_OP_CHOICES = (
    "step",
    "arrive",
    "step",
    "step",
    "arrive",
    "step",
    "preempt",
    "abort",
    "reset_prefix_cache",
)


@st.composite
def operations(
    draw, layout: KVCacheLayout, max_ops: int = 40, max_requests: int = 8
) -> tuple[Operation, ...]:
    """A whole trace body: ``Arrive("r0", ...)`` first, then ``1..max_ops`` ops in all.

    Arrivals are named ``r0, r1, ...`` in order (at most ``max_requests``);
    ``Abort``/``Preempt`` name an arrived, not yet aborted id (it may have finished
    or be waiting). Steps outnumber the other operations. The result always passes
    :func:`properties.core.trace.validate_references`.
    """
    if max_ops < 1 or max_requests < 1:
        raise ValueError(
            f"operations(max_ops={max_ops}, max_requests={max_requests}) must both be >= 1"
        )
    pool = draw(prefix_pools(layout))
    count = draw(st.integers(1, max_ops))
    ops: list[Operation] = [draw(request_inputs(layout, pool, "r0"))]
    num_arrived = 1
    live = ["r0"]  # arrived and not aborted
    for _ in range(count - 1):
        kind = draw(st.sampled_from(_OP_CHOICES))
        if kind == "arrive" and num_arrived < max_requests:
            request_id = f"r{num_arrived}"
            ops.append(draw(request_inputs(layout, pool, request_id)))
            num_arrived += 1
            live.append(request_id)
        elif kind == "preempt" and live:
            ops.append(draw(preempt_ops(live)))
        elif kind == "abort" and live:
            op = draw(abort_ops(live))
            live.remove(op.request_id)
            ops.append(op)
        elif kind == "reset_prefix_cache":
            ops.append(ResetPrefixCache())
        else:
            ops.append(draw(step_ops(layout)))
    return tuple(ops)


@st.composite
def traces(
    draw, layout_strategy: st.SearchStrategy[KVCacheLayout] | None = None, max_ops: int = 40
) -> Trace:
    """A ``Trace`` (no seed, nothing observed) over generated or preset layouts."""
    layout = draw(any_layouts() if layout_strategy is None else layout_strategy)
    return Trace(layout=layout, operations=draw(operations(layout, max_ops=max_ops)))
