"""How the scheduler drives an engine: :class:`ServingMode` (one per trace).

The layout says how the KV cache is built (groups, pool, retention interval, EAGLE);
the serving mode says how requests are scheduled against it, as a deployed vLLM
does:

* ``async_scheduling``: step ``N + 1`` is planned before step ``N``'s output is
  processed. A request's ``num_computed_tokens`` advances when a step is *planned*;
  the tokens of steps not processed yet are *in flight*, and the sampled tokens not
  appended yet are *pending* (placeholders). Out-of-window blocks are freed on the
  processed basis ``num_computed_tokens - num_in_flight_tokens``; a finished or
  aborted request's blocks are freed only once none of its tokens is in flight; a
  request with tokens in flight is never preempted.
* ``admission_gate``: a waiting request is admitted only if its whole sequence fits
  (``allocate_slots(..., full_sequence_must_fit=True)``, vLLM's
  ``scheduler_reserve_full_isl`` default), sliding-window and chunked groups capped at
  their per-request admission bound.

* ``num_draft_tokens = k`` (speculative decoding, synchronous scheduling only): a
  decode step schedules its next token plus up to ``k`` draft tokens as new tokens
  (``set_in_flight(id, 0, drafts)`` first: they are pending tokens). After the step,
  ``a`` of them are accepted (a deterministic function of the request and position,
  so traces replay), ``num_computed_tokens`` goes *down* to ``start + 1 + a`` (the
  rejected drafts roll back), the ``a`` accepted tokens and one bonus token are
  appended, and the processed tokens are committed (``cache_blocks``). Not drawn
  with Mamba groups (no speculative Mamba blocks are modelled).

Engines opt in through the optional calls of
:class:`properties.core.engine.SupportsServingModes`; the default mode
(synchronous, no gate) needs none of them.

Worked example (async, a 6-token prompt with one output token, budget 8): step 1
plans the prefill (computed 6, in flight 6, one pending token); step 2 plans
position 6 (computed 7, in flight 7), then step 1's output is processed (in flight
1, the token is appended, pending 0 + 1 for step 2's own sample).
"""

from __future__ import annotations

from dataclasses import dataclass

from reference.errors import KVConformError

#: Most draft tokens a decode step proposes.
MAX_DRAFT_TOKENS = 4


@dataclass(frozen=True)
class ServingMode:
    """See the module docstring. ``ServingMode()`` is the textbook synchronous mode."""

    async_scheduling: bool = False
    admission_gate: bool = False
    num_draft_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("async_scheduling", "admission_gate"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise KVConformError(f"ServingMode.{name} must be a boolean, got {value!r}")
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_DRAFT_TOKENS:
            raise KVConformError(
                f"ServingMode.num_draft_tokens must be an integer in [0, {MAX_DRAFT_TOKENS}], "
                f"got {k!r}"
            )
        if k and self.async_scheduling:
            raise KVConformError(
                "ServingMode: drafts with asynchronous scheduling are not modelled; set "
                "num_draft_tokens=0 or async_scheduling=False"
            )

    @property
    def is_default(self) -> bool:
        return self == ServingMode()

    def describe(self) -> str:
        parts = [name for name in ("async_scheduling", "admission_gate") if getattr(self, name)]
        if self.num_draft_tokens:
            parts.append(f"drafts={self.num_draft_tokens}")
        return " ".join(parts) or "sync"


#: The default mode (synchronous, ungated), for argument defaults.
SYNC = ServingMode()


#: The layout settings the ``production`` property can draw, which an engine factory
#: opts into with a ``production_settings`` attribute (a subset; none by default, so an
#: engine that does not implement them is never given them): ``retention``
#: (``prefix_cache_retention_interval``), ``eagle`` (``use_eagle``, ``is_eagle_group``,
#: ``num_hash_lookahead_tokens``) and ``admission_cap`` (``max_in_flight_tokens`` and a
#: pool sized with the admission caps).
PRODUCTION_SETTINGS: frozenset[str] = frozenset({"retention", "eagle", "admission_cap"})


def production_settings(factory: object) -> frozenset[str]:
    """The production layout settings ``factory`` declares (``factory.production_settings``),
    checked against :data:`PRODUCTION_SETTINGS`; empty when it declares none."""
    declared = frozenset(getattr(factory, "production_settings", ()) or ())
    unknown = declared - PRODUCTION_SETTINGS
    if unknown:
        raise KVConformError(
            f"production_settings names unknown settings {sorted(unknown)}; known: "
            f"{', '.join(sorted(PRODUCTION_SETTINGS))}"
        )
    return declared
