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
  appended, and the processed tokens are committed (``cache_blocks``). With Mamba
  groups a step drafts at most their ``num_speculative_blocks`` tokens (vLLM sizes
  the speculative state blocks by the speculative token count; none without them).
* ``varying_drafts`` (with ``num_draft_tokens``): the proposer offers a different number
  of drafts at each step, as vLLM's suffix and n-gram decoding do (:func:`proposed_drafts`:
  a deterministic function of the request and position, ``0..k``), instead of always
  ``k`` (MTP, EAGLE). A step then may schedule fewer tokens than the last one did: a
  Mamba group's row is longer than the step needs (vLLM issue 39271).

* ``external_hits`` (a KV connector over a host tier, :mod:`reference.host_tier`):
  the scheduler owns a host tier that receives the blocks leaving the primary pool
  (sliding-window and chunked-local blocks detached below the window, and every full
  computed block of a request it frees); a waiting request's device hit
  (``get_computed_blocks``) is extended by the tokens the tier holds beyond it (every
  group must serve the combined hit), passed
  as ``allocate_slots(..., num_external_computed_tokens=e)``; the request then starts
  computing at ``hit + e``. Not drawn with Mamba groups (loaded Mamba states are not
  modelled). Engines opt in with the ``external`` production setting.
* ``async_loads`` (with ``external_hits``): the connector loads asynchronously, as
  vLLM's ``load_kv_async``: the admission allocates only the loaded blocks
  (``allocate_slots(0, hit, ..., num_external_computed_tokens=e,
  delay_cache_blocks=True)``, no lookahead slots), the request waits for its load,
  which completes at the start of the next step (``cache_blocks(id, hit + e)``, then
  the request runs from ``hit + e``); an ``Abort`` during the load frees the blocks
  only once the load has completed.
* ``load_failures`` (with ``async_loads``): a load can fail as a whole, as vLLM 0.33
  handles a connector's failed receive with the ``recompute`` policy: at completion
  the request's computed tokens go back to 0, its blocks are freed without being
  cached (nothing of the load was written), and it waits again at the front of the
  queue, to be looked up anew (a device hit may have appeared meanwhile). Whether a
  load fails is a deterministic function of the request and its attempt
  (:func:`load_fails`): a request's first load fails one time in two, a retry never.

Engines opt in through the optional calls of
:class:`properties.core.engine.SupportsServingModes`; the default mode
(synchronous, no gate) needs none of them.

Worked example (async, a 6-token prompt with one output token, budget 8): step 1
plans the prefill (computed 6, in flight 6, one pending token); step 2 plans
position 6 (computed 7, in flight 7), then step 1's output is processed (in flight
1, the token is appended, pending 0 + 1 for step 2's own sample).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from properties.core.declarations import DeclarationError
from reference.errors import KVConformError

#: Most draft tokens a decode step proposes.
MAX_DRAFT_TOKENS = 4


@dataclass(frozen=True)
class ServingMode:
    """See the module docstring. ``ServingMode()`` is the textbook synchronous mode."""

    async_scheduling: bool = False
    admission_gate: bool = False
    num_draft_tokens: int = 0
    external_hits: bool = False
    async_loads: bool = False
    load_failures: bool = False
    varying_drafts: bool = False

    def __post_init__(self) -> None:
        for name in (
            "async_scheduling",
            "admission_gate",
            "external_hits",
            "async_loads",
            "load_failures",
            "varying_drafts",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise KVConformError(f"ServingMode.{name} must be a boolean, got {value!r}")
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_DRAFT_TOKENS:
            raise KVConformError(
                f"ServingMode.num_draft_tokens must be an integer in [0, {MAX_DRAFT_TOKENS}], "
                f"got {k!r}"
            )
        if self.async_loads and not self.external_hits:
            raise KVConformError("ServingMode.async_loads needs external_hits=True")
        if self.load_failures and not self.async_loads:
            raise KVConformError(
                "ServingMode.load_failures needs async_loads=True (only asynchronous loads "
                "can fail in this model)"
            )
        if self.varying_drafts and not k:
            raise KVConformError(
                "ServingMode.varying_drafts needs num_draft_tokens > 0 (the drafts that vary)"
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
        if self.varying_drafts:
            parts.append("varying")
        if self.external_hits:
            parts.append("external_hits")
        if self.async_loads:
            parts.append("async_loads")
        if self.load_failures:
            parts.append("load_failures")
        return " ".join(parts) or "sync"


def proposed_drafts(request_id: str, position: int, num_draft_tokens: int) -> int:
    """How many drafts a ``varying_drafts`` proposer offers for ``request_id``'s decode at
    ``position``: a ``sha256`` of the two (so traces replay), uniform over
    ``0..num_draft_tokens``. Example: ``proposed_drafts("r0", 9, 0) == 0``."""
    digest = hashlib.sha256(f"propose:{request_id}:{position}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % (num_draft_tokens + 1)


def load_fails(request_id: str, attempt: int) -> bool:
    """Whether attempt ``attempt`` (0 first) of ``request_id``'s connector load fails in
    the ``load_failures`` mode: the first one in one case out of two, by a ``sha256`` of
    the request id (so traces replay), a retry never (so every request ends)."""
    if attempt > 0:
        return False
    return hashlib.sha256(f"load:{request_id}".encode()).digest()[0] % 2 == 0


#: The default mode (synchronous, ungated), for argument defaults.
SYNC = ServingMode()


#: The layout settings the ``production`` property can draw, which an engine factory
#: opts into with a ``production_settings`` attribute (a subset; none by default, so an
#: engine that does not implement them is never given them): ``retention``
#: (``prefix_cache_retention_interval``), ``eagle`` (``use_eagle``, ``is_eagle_group``,
#: ``num_hash_lookahead_tokens``) and ``admission_cap`` (``max_in_flight_tokens`` and a
#: pool sized with the admission caps) and ``external`` (the ``external_hits`` serving
#: mode: ``allocate_slots(..., num_external_computed_tokens=...)``) and ``mamba_modes``
#: (a Mamba group's ``mamba_cache_mode``, ``num_speculative_blocks`` and prefill
#: checkpoint blocks; drafts on a Mamba layout need its speculative blocks).
PRODUCTION_SETTINGS: frozenset[str] = frozenset(
    {"retention", "eagle", "admission_cap", "external", "mamba_modes"}
)
#: The production setting of the ``external_hits`` serving mode.
EXTERNAL_SETTING = "external"


def production_settings(factory: object) -> frozenset[str]:
    """The production layout settings ``factory`` declares (``factory.production_settings``),
    checked by :func:`check_production_settings`; empty when it declares none."""
    from properties.core.declarations import read_declaration

    declared = read_declaration(factory, "production_settings", "factory attribute")
    return check_production_settings(declared, "production_settings")


def check_production_settings(declared: object, where: str) -> frozenset[str]:
    """A declaration of production settings (``where`` names it in the error): ``None``
    or a list, tuple or set of names of :data:`PRODUCTION_SETTINGS`. A bare string is
    refused (``"retention"`` would read as the letters r, e, t...). Example:
    ``check_production_settings(["eagle"], "x") == frozenset({"eagle"})``."""
    known = ", ".join(sorted(PRODUCTION_SETTINGS))
    if declared is None:
        return frozenset()
    if not isinstance(declared, (list, tuple, set, frozenset)) or not all(
        isinstance(s, str) for s in declared
    ):
        raise DeclarationError(f"{where} must be a list of names among {known}, got {declared!r}")
    unknown = frozenset(declared) - PRODUCTION_SETTINGS
    if unknown:
        raise DeclarationError(
            f"{where} must be a list of names among {known}; unknown settings {sorted(unknown)}"
        )
    return frozenset(declared)


#: The keywords of ``allocate_slots`` that belong to the ``external`` production setting.
EXTERNAL_KEYWORDS: tuple[str, ...] = ("num_external_computed_tokens", "delay_cache_blocks")
