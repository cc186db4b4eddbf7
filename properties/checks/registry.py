"""Every check of kvconform, registered once with its name.

A failure always carries the name of the check that found it
(:class:`PropertyViolation`), and that name is one of :data:`CHECKS`. Each entry says
when the check runs (``on``: the event of :mod:`properties.checks.state`, or
``boundary``/``lockstep``/``attention``/``determinism`` for the checks that are not
invariants; ``answers`` is :mod:`properties.checks.answers` at the engine boundary), the
label of the rule it guards in ``docs/spec.md``, and the optional engine capabilities it
needs (``ref_counts``, ``free_queue``, ``cached_blocks``, ``allocation_estimate``,
``pools``: the engine reports its separate block pools;
``shared_pool``: the groups share one block pool; ``host_tier``: the engine has its own
host tier and reports its copies, :mod:`properties.checks.host_invariants`). A check
whose capabilities the engine lacks does not run.

Worked example: ``CHECKS["hit_bounds"]`` runs on every lookup (``on="lookup"``), guards
H1 and needs nothing; ``CHECKS["hit_maximality"]`` runs on every lookup only for engines
that expose their cached blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from properties.checks import host_invariants as hinv
from properties.checks import invariants as inv

#: The events an invariant can run on, in the order :class:`Checker` raises them.
EVENTS = (
    "host_transfer",
    "lookup",
    "table",
    "external_load",
    "group_write",
    "allocate",
    "failed_allocation",
    "commit",
    "free",
    "reset",
    "pool",
)


class PropertyViolation(AssertionError):
    """An engine broke a property; ``name`` says which check found it."""

    def __init__(self, name: str, message: str) -> None:
        if name not in CHECKS:
            raise ValueError(f"PropertyViolation names unknown check {name!r}")
        super().__init__(f"[{name}] {message}")
        self.name = name
        self.message = message


@dataclass(frozen=True)
class CheckInfo:
    """One registered check (see the module docstring)."""

    name: str
    on: str
    label: str
    guards: str
    needs: frozenset[str] = frozenset()
    fn: Callable | None = None

    @property
    def is_invariant(self) -> bool:
        """Run by the checker after engine calls (and can be disabled one by one)."""
        return self.fn is not None

    def runs_with(self, capabilities: Iterable[str]) -> bool:
        return self.needs <= set(capabilities)


def _check(
    fn: Callable | None, on: str, label: str, guards: str, needs: Iterable[str] = (), name=""
) -> CheckInfo:
    return CheckInfo(name or fn.__name__, on, label, guards, frozenset(needs), fn)


_REGISTRY: tuple[CheckInfo, ...] = (
    # lookups, in the order they run
    _check(inv.lookup_no_side_effects, "lookup", "H5", "a lookup changes nothing"),
    _check(inv.hit_bounds, "lookup", "H1", "0 <= hit <= num_tokens - 1, aligned"),
    _check(inv.hit_soundness, "lookup", "H2", "the hit's blocks hold the request's prefix"),
    _check(
        inv.hit_maximality, "lookup", "H3", "no longer hit is servable", needs=["cached_blocks"]
    ),
    # successful allocations
    _check(inv.window_liveness, "group_write", "W3", "every key a token reads is live"),
    _check(inv.exclusive_write, "group_write", "I6", "a written block has one owner"),
    _check(inv.no_block_shared, "allocate", "I5", "no block twice in a request's table"),
    _check(
        inv.table_covers_slots,
        "allocate",
        "A5",
        "a table holds exactly the blocks of the slots asked for (no stray blocks)",
    ),
    _check(
        inv.estimate_matches_pulls,
        "allocate",
        "A4",
        "the blocks an allocation estimates equal the blocks it pulls",
        ["allocation_estimate", "shared_pool"],
    ),
    _check(inv.external_hit_bounds, "external_load", "X1", "an external hit ends where a hit may"),
    _check(inv.external_load_exclusive, "external_load", "X2", "a loaded block has one owner"),
    _check(
        hinv.host_hit_content,
        "external_load",
        "X3",
        "a hit served from the host tier holds the request's own computed prefix",
        ["host_tier"],
    ),
    _check(
        hinv.host_transfers_pinned,
        "allocate",
        "X5",
        "a block a backup in flight reads is not handed out",
        ["host_tier"],
    ),
    _check(
        hinv.host_load_source,
        "host_transfer",
        "X6",
        "a load or store reads a host block a write or fetch filled",
        ["host_tier"],
    ),
    _check(
        hinv.storage_fetch_source,
        "host_transfer",
        "X7",
        "a fetch from the storage tier reads a key a store filled",
        ["host_tier"],
    ),
    _check(inv.failed_allocation, "failed_allocation", "A1", "None changes nothing"),
    _check(
        inv.allocation_fits,
        "failed_allocation",
        "A2",
        "an allocation that fits the free count does not fail",
        ["shared_pool"],
    ),
    _check(
        inv.allocation_fits_per_pool,
        "failed_allocation",
        "S3",
        "per pool: an allocation that fits every pool's free count does not fail",
        ["pools"],
    ),
    _check(
        inv.committed_blocks_verified,
        "commit",
        "C1",
        "a committed block holds only the request's verified tokens (no rejected draft)",
        ["cached_blocks"],
    ),
    _check(inv.freed_on_free, "free", "F1", "free() leaves no block behind"),
    _check(
        inv.reset_prefix_cache,
        "reset",
        "R1",
        "reset succeeds iff no blocks are held",
        needs=["shared_pool"],
    ),
    _check(
        inv.in_flight_reads_held,
        "pool",
        "W3",
        "no block an in-flight token reads is released before its step is processed",
    ),
    _check(inv.pool_accounting, "pool", "I1", "free + in use == num_blocks - 1", ["shared_pool"]),
    _check(inv.idle_pool_free, "pool", "I7", "nothing held: every block free or reclaimable"),
    _check(
        inv.pool_accounting_per_pool,
        "pool",
        "S1",
        "per pool: free + held <= capacity",
        ["pools"],
    ),
    _check(
        inv.idle_pool_free_per_pool,
        "pool",
        "S2",
        "per pool: nothing held, every block free or reclaimable",
        ["pools"],
    ),
    _check(
        hinv.backed_up_blocks_not_free,
        "pool",
        "X5",
        "per pool: a block a backup in flight reads is neither free nor reclaimable",
        ["host_tier", "pools"],
    ),
    _check(
        hinv.host_pool_accounting,
        "pool",
        "X4",
        "per host pool: free + held == capacity, every held block written (none lost)",
        ["host_tier"],
    ),
    _check(
        inv.ref_counts_match_owners,
        "pool",
        "I3",
        "ref count == owners",
        ["shared_pool", "ref_counts"],
    ),
    _check(
        inv.free_queue_contents,
        "pool",
        "I2",
        "free queue == blocks with ref count 0",
        ["shared_pool", "ref_counts", "free_queue"],
    ),
    # the checks that are not invariants
    _check(
        None,
        "boundary",
        "P1",
        "every answer of the engine is well formed (a protocol error: exit code 3)",
        name="answers",
    ),
    _check(
        None,
        "lockstep",
        "E1",
        "same hits, block ids, free counts and queue as the reference (exact level)",
        name="exact_match",
    ),
    _check(None, "attention", "T1", "attention outputs equal dense attention", name="attention"),
    _check(
        None, "determinism", "H6", "the same trace twice gives the same calls", name="determinism"
    ),
)

#: name -> check, in registration order (the order checks run within one event).
CHECKS: dict[str, CheckInfo] = {c.name: c for c in _REGISTRY}
#: The names of the invariants (the checks the checker runs; each can be disabled).
INVARIANTS: tuple[str, ...] = tuple(c.name for c in _REGISTRY if c.is_invariant)


def checks_on(event: str) -> tuple[CheckInfo, ...]:
    """The invariants that run on ``event``, in registration order."""
    if event not in EVENTS:
        raise ValueError(f"unknown event {event!r}; known: {', '.join(EVENTS)}")
    return tuple(c for c in _REGISTRY if c.on == event and c.is_invariant)


def disabled_all_but(keep: Iterable[str]) -> frozenset[str]:
    """The invariants to disable so that only ``keep`` run."""
    return frozenset(set(INVARIANTS) - set(keep))


def validate_disabled(disabled: Iterable[str]) -> None:
    unknown = set(disabled) - set(INVARIANTS)
    if unknown:
        raise ValueError(
            f"unknown checks to disable: {sorted(unknown)}; known: {', '.join(INVARIANTS)}"
        )
