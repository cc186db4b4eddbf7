"""The invariants: one function per check, each named after what it guards.

Every function reads :class:`properties.checks.state.CheckState` and one event, and
returns ``None`` when the engine behaves, or a message naming the request, the group
and the block. :mod:`properties.checks.registry` registers them with their names, the
moment they run and the capabilities they need; :class:`properties.checks.checker.Checker`
calls them. Labels (I1, H2, W3, ...) are defined in ``docs/spec.md``.

Worked example (``hit_bounds``, H1): a 10-token request on a layout whose hit
alignment is 4 may hit 0, 4 or 8 tokens; a hit of 9 is reported as
``request 'r0': hit of 9 tokens is not a multiple of 4 in [0, 9]``.
"""

from __future__ import annotations

from collections.abc import Iterator

from properties.checks.oracles import (
    brute_force_longest_hit,
    content_bound_longest_hit,
    describe_content,
    missing_context,
)
from properties.checks.state import (
    AllocateEvent,
    CheckState,
    CommitEvent,
    ExternalLoadEvent,
    FailedAllocationEvent,
    FreeEvent,
    GroupWriteEvent,
    LookupEvent,
    PoolEvent,
    ResetEvent,
)
from properties.core.diff import short
from properties.core.engine import BlockIds
from reference.attention import first_visible_key
from reference.specs import KVCacheSpec, MambaSpec, RSWASpec, cdiv

# ---------------------------------------------------------------------------
# Lookups (H1-H5)


def lookup_no_side_effects(state: CheckState, event: LookupEvent) -> str | None:
    """H5: ``get_computed_blocks`` changes no free count, ref count or queue order.

    At the large tiers the snapshot before the call is light (free counts only,
    :meth:`properties.checks.checker.Checker.snapshot`): the ref counts and queue a
    lookup could disturb are then checked at the step boundary (I1, I3, and the free
    queue against the reference's at the exact level)."""
    if state.snapshot_like(event.before) != event.before:
        return (
            f"get_computed_blocks({event.request.request_id!r}) changed the free count, ref "
            f"counts or free queue: before {event.before[0]} free, after "
            f"{state.num_free()}"
        )
    return None


def hit_bounds(state: CheckState, event: LookupEvent) -> str | None:
    """H1: ``0 <= hit <= num_tokens - 1`` and a multiple of the hit alignment; with
    prefix caching off, no hit at all."""
    n = event.hit.num_tokens
    cap = len(event.request.token_ids) - 1 if state.layout.enable_caching else 0
    if n > cap or n < 0 or n % state.alignment:
        return (
            f"request {event.request.request_id!r}: hit of {n} tokens is not a "
            f"multiple of {state.alignment} in [0, {cap}]"
        )
    return None


def _state_pending(state: CheckState, gid: int, table, ids, length: int) -> bool:
    """A Mamba state cached earlier in this step, not yet written (the step runs later)."""
    spec = state.layout.groups[gid].spec
    if not isinstance(spec, MambaSpec) or length == 0:
        return False
    col = cdiv(length, spec.block_size) - 1
    if col >= len(table):
        return False
    return any(
        g == gid and b == table[col] and prefix == ids[length - 1]
        for g, b, prefix, _ in state.pending_writes()
    )


def _states_being_replaced(state: CheckState) -> set[tuple[int, int]]:
    """The ``(group, block)`` of the Mamba blocks that this step's run overwrites with
    another state than the one the shadow shows (:meth:`CheckState.pending_writes`: a
    state is written when the step runs, not at allocation). Until then the shadow still
    holds the old state, but the engine has already taken the block for its new owner
    (evicting the old key, registering the new one), so the old state is not servable.
    Example: a freed block holding the state of ``[5]`` is popped for a request whose
    prompt is ``[3]``: within the step the shadow reads ``[5]``, the block is keyed by
    ``[3]``, and it is in this set."""
    return {
        (gid, block)
        for gid, block, prefix, _ in state.pending_writes()
        if not state.shadow.holds(gid, block, -1, prefix)
    }


def hit_soundness(state: CheckState, event: LookupEvent) -> str | None:
    """H2: every group's hit blocks hold the request's own prefix over the keys the
    group needs (``[hit_context_start(L), L)``; Mamba: the state at exactly ``L``)."""
    req, hit = event.request, event.hit
    if hit.num_tokens == 0:
        return None
    for gid, table in enumerate(hit.block_ids):
        spec = state.layout.groups[gid].spec
        if not spec.prefix_cacheable:
            continue  # a circular buffer is no part of a hit
        why = missing_context(
            state.layout,
            state.shadow,
            gid,
            table,
            req.ids,
            spec.hit_context_start(hit.num_tokens),
            hit.num_tokens,
        )
        if why is not None and _state_pending(state, gid, table, req.ids, hit.num_tokens):
            # the lookup may offer a state cached earlier in this step; the engine must
            # refuse the allocation (window_liveness checks that)
            why = None
        if why is not None:
            return (
                f"request {req.request_id!r} hit {hit.num_tokens} tokens but group "
                f"{gid} ({spec.type_name}) cannot serve it: {why}"
            )
    return None


def hit_maximality(state: CheckState, event: LookupEvent) -> str | None:
    """H3: no longer aligned hit is servable by every group from the cached blocks
    (with prefix caching off there is no hit to find).

    Not asserted for EAGLE layouts (``use_eagle``): the drop needs one block past the
    hit, and lookahead hashes key a block by the tokens after it, which the cached
    contents do not show; the exact level compares those hits with the reference.

    At the large tiers the cached blocks (O(pool)) are read only when the hit is
    shorter than the longest hit the shadow's contents could serve
    (:func:`properties.checks.oracles.content_bound_longest_hit`): the same verdict,
    as no cached block serves a hit that bound excludes.

    A Mamba block whose state this step replaces (:func:`_states_being_replaced`)
    serves nothing from its old state: the shadow learns a state when the step runs, so
    before that it shows the state the block held for its previous owner.
    """
    if not state.layout.enable_caching or state.layout.use_eagle:
        return None
    req = event.request
    max_length = len(req.token_ids) - 1
    # the content bound counts whole blocks only: not used with partial hits
    shortcut = not state.per_call_reads and not state.layout.partial_hits_enabled
    if shortcut and event.hit.num_tokens >= content_bound_longest_hit(
        state.layout, state.shadow, req.ids, max_length, state.alignment
    ):
        return None  # large tiers: no longer hit could be served, cached or not
    cached = state.cached_blocks()
    replaced = _states_being_replaced(state)
    if replaced:
        cached = [cb for cb in cached if (cb.group_id, cb.block_id) not in replaced]
    best = brute_force_longest_hit(
        state.layout,
        state.shadow,
        cached,
        req.ids,
        max_length,
        state.alignment,
    )
    if best > event.hit.num_tokens:
        return (
            f"request {req.request_id!r}: engine hit {event.hit.num_tokens} tokens, but every "
            f"group can serve {best} from its cached blocks"
        )
    return None


# ---------------------------------------------------------------------------
# Allocations (W3, A1, I5)


def _write_columns(state: CheckState, event: GroupWriteEvent) -> list[int]:
    spec = state.layout.groups[event.group_id].spec
    bs = spec.block_size
    if isinstance(spec, MambaSpec):
        return [cdiv(event.end, bs) - 1] if event.end > 0 else []
    if not spec.uses_slot_mapping:
        return [0]  # the ring (a circular buffer)
    return sorted({p // bs for p in range(event.start, event.end)})


def _mamba_resume(state: CheckState, req, gid: int, row, start: int) -> str | None:
    """Why a Mamba group cannot resume ``req`` at ``start``: after a draft step its state
    is in the accepted draft's block (``req.mamba_running``), which must still be in the
    row and hold that state; otherwise the state column ``cdiv(start, bs) - 1``
    (:func:`properties.checks.oracles.missing_context`)."""
    block = req.mamba_running.get(gid)
    if block is None:
        return missing_context(state.layout, state.shadow, gid, row, req.ids, 0, start)
    if block not in row:
        return f"its state block {block} (after a draft step) left the row {short(list(row))}"
    if not state.shadow.holds(gid, block, -1, req.ids[start - 1]):
        got = describe_content(state.shadow.read(gid, block, -1), gid, req.ids)
        return f"its state block {block} (after a draft step) holds {got}"
    return None


def read_ranges(spec, start: int, num_prompt_tokens: int) -> list[tuple[int, int]]:
    """The earlier keys a step starting at ``start`` reads in an attention group, as
    ``[first, end)`` ranges: ``[first_visible_key(start), start)``; R-SWA: the prompt's
    keys and the window of ``start`` (:meth:`reference.specs.RSWASpec.visible_ranges`).
    Example: R-SWA ``W`` 8, ``P`` 16, start 30 -> ``[(0, 16), (23, 30)]``."""
    if isinstance(spec, RSWASpec):
        prompt, window = spec.visible_ranges(start, num_prompt_tokens)
        return [(prompt.start, min(prompt.stop, start)), (window.start, start)]
    return [(first_visible_key(spec, start), start)]


def window_liveness(state: CheckState, event: GroupWriteEvent) -> str | None:
    """W3: every key a scheduled token reads sits in a real block holding that very
    token (a Mamba group resumes from the state of exactly its prefix), and every
    position the step writes has a real block."""
    req, gid, row = event.request, event.group_id, event.row
    spec = state.layout.groups[gid].spec
    rid = req.request_id
    if isinstance(spec, MambaSpec):
        if event.start > 0:
            why = _mamba_resume(state, req, gid, row, event.start)
            if why is not None:
                return f"request {rid!r} resumes at {event.start} in group {gid} (mamba): {why}"
    elif spec.uses_slot_mapping:
        for first, end in read_ranges(spec, event.start, req.num_prompt_tokens):
            why = missing_context(state.layout, state.shadow, gid, row, req.ids, first, end)
            if why is not None:
                return (
                    f"request {rid!r} scheduled [{event.start}, {event.end}) reads keys "
                    f"[{first}, {end}) in group {gid} ({spec.type_name}): {why}"
                )
    for col in _write_columns(state, event):
        if col >= len(row) or row[col] == 0:
            return (
                f"request {rid!r} writes positions [{event.start}, {event.end}) but group "
                f"{gid} has no real block at index {col} (table {short(list(row))})"
            )
    return None


def exclusive_write(state: CheckState, event: GroupWriteEvent) -> str | None:
    """The blocks a step writes belong to that request only."""
    gid, row = event.group_id, event.row
    for col in _write_columns(state, event):
        if col >= len(row):
            continue  # window_liveness reports it
        block = row[col]
        other = event.others.holder(gid, block)
        if other is not None:
            return (
                f"request {event.request.request_id!r} writes block {block} (group {gid}, "
                f"index {col}) that request {other!r} also holds"
            )
    return None


def external_hit_bounds(state: CheckState, event: ExternalLoadEvent) -> str | None:
    """X1: an external hit ends where a hit may end, and never exceeds what the store
    holds.

    * ``local + external <= num_tokens - 1`` (the last token is always computed) and a
      multiple of the hit alignment (the host tier serves whole blocks of every group).
      Example (bs 4, 10 tokens): local 4 + external 4 is fine; external 8 (12 > 9) or
      external 2 (6 not aligned) is not.
    * With the machine's host tier (:mod:`reference.host_tier`): every non-null block the
      engine's table gives the external range ``[local, local + external)`` is one the
      connector loads, so the tier must hold it. Example (sliding window ``w = 4``, bs 4,
      local 0, external 8, the tier holds that group's block 1 only): a table ``[0, b]``
      is fine; ``[a, b]`` asks the connector for block 0, out of the window and not in
      the tier.
    """
    req = event.request
    bs = state.layout.cache_hit_alignment
    if event.end > len(req.token_ids) - 1 or event.end % bs:
        return (
            f"request {req.request_id!r}: local hit {event.start} + external "
            f"{event.end - event.start} = {event.end} tokens, beyond num_tokens - 1 = "
            f"{len(req.token_ids) - 1} or not a multiple of {bs}"
        )
    tier = state.host_tier
    if tier is None:
        return None
    for gid, col, block in _loaded_blocks(state, event):
        if not tier.holds(gid, req.cache_salt, req.lora_name, req.token_ids, col):
            return (
                f"request {req.request_id!r}: external tokens [{event.start}, "
                f"{event.end}) put block {block} at index {col} of group {gid}, a "
                "block the connector must load but the host tier does not hold"
            )
    return None


def _loaded_blocks(state: CheckState, event: ExternalLoadEvent) -> Iterator[tuple[int, int, int]]:
    """``(group, index, block)`` of every block a connector loads external tokens into:
    the non-null entries of the table over ``[start, end)`` (null ones, below a sliding
    window, are not loaded; nor is a circular buffer's ring, which has no slots by
    position). An engine with its own host tier says which it loaded (its ``load``
    copies of the call): a block it kept on the device, shared with others, is not
    loaded into (SGLang loads only the window's SWA pages when the full pages are still
    resident)."""
    for gid, row in enumerate(event.table):
        spec = state.layout.groups[gid].spec
        if not spec.uses_slot_mapping:
            continue
        bs = spec.block_size
        for col in range(event.start // bs, min(cdiv(event.end, bs), len(row))):
            if row[col] == 0:
                continue
            if state.has_host_tier and (gid, row[col]) not in state.loaded_now:
                continue
            yield gid, col, row[col]


def external_load_exclusive(state: CheckState, event: ExternalLoadEvent) -> str | None:
    """X2: every block a connector loads external tokens into belongs to the loading
    request only (I6 for loads: a load never overwrites a block another request holds,
    which a double allocation across groups would do). Null entries (positions below a
    sliding window) are not loaded."""
    for gid, col, block in _loaded_blocks(state, event):
        other = event.others.holder(gid, block)
        if other is not None:
            return (
                f"request {event.request.request_id!r} loads external tokens into "
                f"block {block} (group {gid}, index {col}) that request {other!r} "
                "also holds"
            )
    return None


def no_block_shared(state: CheckState, event: AllocateEvent) -> str | None:
    """I5: no id twice in one request's table (across its groups, with one shared pool)."""
    seen: dict[int, int] = {}
    for gid, row in enumerate(event.table):
        for b in row:
            if b == 0:
                continue
            if b in seen and (state.shared_pool or seen[b] == gid):
                return (
                    f"request {event.request.request_id!r} holds block {b} twice (groups "
                    f"{seen[b]} and {gid}): {short([list(r) for r in event.table])}"
                )
            seen[b] = gid
    return None


def pulled_blocks(state: CheckState, event: AllocateEvent) -> list[tuple[int, int, int]]:
    """The ``(group, index, block)`` entries a successful ``allocate_slots`` took from the
    free pool: every real entry of the new table that is not the same block at the same
    index of the table before (a new block, or an adopted hit block), unless another
    request holds that block (then the hit is shared and leaves no free-queue slot).

    A block the call freed below a window and took again at a later index counts: it
    went through the free pool. A Mamba group's speculative blocks (the last ``k`` of its
    row before) that the call relocates to the end of the row do not: they never leave
    the request (the call frees no speculative column). Example (full attention, bs 4,
    fresh request): hit ``(7,)`` on block 7 that nobody holds, table after ``(7, 3, 9)``:
    pulled ``[(0, 0, 7), (0, 1, 3), (0, 2, 9)]``; if request ``b`` holds block 7, ``(0,
    0, 7)`` is not. Mamba with ``k = 2``, row ``[0, s, x, y]`` -> ``[0, s, 0, 0, x, y,
    n]``: only ``n`` is pulled.
    """
    before = event.tables_before or ()
    candidates = []
    for gid, row in enumerate(event.table):
        old = before[gid] if gid < len(before) else ()
        spec = state.layout.groups[gid].spec
        k = spec.num_speculative_blocks if isinstance(spec, MambaSpec) else 0
        relocated = set(old[len(old) - k :]) if k else set()
        for i, b in enumerate(row):
            if b != 0 and (i >= len(old) or old[i] != b) and b not in relocated:
                candidates.append((gid, i, b))
    candidates += _copy_pulls(event, before)
    if not candidates:
        return []
    rid = event.request.request_id
    return [c for c in candidates if state.holder(c[0], c[2], rid) is None]


def _copy_pulls(event: AllocateEvent, before: BlockIds) -> list[tuple[int, int, int]]:
    """The ends of the block copies the call queued that left the free pool without
    entering the request's table at a new place: the shared block of a hit ending inside
    it (adopted, then replaced by its copy; unless an earlier pending copy held it), and
    the copy a Mamba request makes of the state block its partial tail is keyed on (held
    by no table until the copy is handed over). Index ``-1``: not in the table."""
    table_blocks = {b for row in event.table for b in row}
    before_blocks = {b for row in before for b in row}
    out = []
    for source, destination in event.copies:
        if destination not in table_blocks:
            out.append((0, -1, destination))
        if source not in before_blocks and source not in event.held_by_copies:
            out.append((0, -1, source))
    return out


def estimate_matches_pulls(state: CheckState, event: AllocateEvent) -> str | None:
    """A4: the blocks a successful ``allocate_slots`` estimated it needed (the figure it
    compared with the free count: :class:`properties.core.engine.ReportsAllocationEstimate`)
    equal the blocks it then took from the free pool (:func:`pulled_blocks`): new blocks
    (for new, lookahead, draft and external tokens) plus adopted hit blocks that nobody
    held (evictable: adopting one removes it from the free queue). The rule is equality:
    an estimate below the pulls lets an allocation through that the pool cannot serve
    (vLLM raises "Cannot get N free blocks"), one above refuses requests that fit.

    What does not count: hit blocks another request holds (no free-queue slot), hit
    blocks below a sliding window or chunk start (dropped as null, never touched),
    blocks the request already holds at the same index (rolled-back draft slots and
    unused lookahead slots are reused), null padding (Mamba). The admission gate's
    whole-sequence estimate (``full_sequence_must_fit``) is not compared: its per-group
    caps make it an admission bound, not a prediction. Blocks freed below a window in the
    same call are freed before the estimate, so a block freed and taken again counts.

    Worked example (full attention bs 4 + sliding window w 4 bs 4, fresh request, hit 8
    tokens ``((5, 6), (0, 7))``, 4 new tokens): slots 12 -> 3 blocks per group. Full:
    blocks 5, 6 adopted (5 held by another request, 6 evictable) + 1 new; SWA: index 0
    is null (skipped), block 7 evictable + 1 new. Estimate ``(1 + 1) + (1 + 1) = 4``;
    pulled: 6, the new full block, 7, the new SWA block = 4. An engine that forgets the
    evictable hits estimates 2 and is reported.

    Not drawn by the machine, where vLLM 0.33's (and the reference's) estimate is not the
    pulls: Mamba groups with external tokens (the estimate counts one new state block
    and the hit state, the call drops the hit state below the loaded tokens and takes a
    block for the external state and one for the new tokens:
    ``findings/vllm/mamba-external-estimate.md``).
    """
    if event.estimate is None:
        return None
    pulled = pulled_blocks(state, event)
    if event.estimate != len(pulled):
        rid = event.request.request_id
        return (
            f"allocate_slots({rid!r}) estimated {event.estimate} blocks but took "
            f"{len(pulled)} from the free pool ((group, index, block): {pulled[:12]}); "
            f"table before {_lists(event.tables_before)}, after {_lists(event.table)}"
        )
    return None


def _lists(table) -> object:
    return None if table is None else [list(r) for r in table]


def table_covers_slots(state: CheckState, event: AllocateEvent) -> str | None:
    """A5, no stray blocks: after a successful ``allocate_slots`` every group's row has
    exactly ``max(len(row before), cdiv(slots, bs))`` entries (an ``"align"`` Mamba group:
    ``cdiv(main, bs)``, lookahead excluded; a Mamba group's ``k`` speculative blocks are
    added in either mode), where ``slots = computed + hit + external + new + lookahead``,
    capped at ``max_model_len`` or not: vLLM caps the slots there, an engine may also give
    lookahead slots past it (SGLang does); nothing beyond the uncapped count. So a request
    never holds blocks past the highest slot it ever asked for, and the slots of rejected
    drafts (``num_computed_tokens`` rolled back) or of unused lookahead are reused by the
    next steps, never taken again.

    Worked example (full attention, bs 4): a decode at 9 computed tokens with 3 drafts
    asks for 13 slots: 4 blocks. Two drafts are rejected (computed 11); the next step
    asks for ``11 + 1 + 3 = 15`` slots: still 4 blocks, nothing new. A row of 5 blocks
    (the rejected slots' block taken again) is reported.

    An engine with ``lookahead_on_prefill_chunks = False`` (LMDeploy: no
    ``prealloc_size`` for a chunk that does not finish the prompt) may leave the
    lookahead slots of a non-final prefill chunk (``main`` slots short of the request's
    tokens) unallocated: the least is then ``cdiv(main, bs)``. Example: bs 4, a 20-token
    prompt, a first chunk of 8 with 2 lookahead slots: 2 or 3 blocks.
    """
    rid = event.request.request_id
    before = event.tables_before or ()
    for gid, row in enumerate(event.table):
        spec = state.layout.groups[gid].spec
        bs = spec.block_size
        old = len(before[gid]) if gid < len(before) else 0
        extra = 0
        if isinstance(spec, MambaSpec) and spec.is_align:
            low = high = event.num_main
            extra = spec.num_speculative_blocks
        else:
            low, high = min(event.num_slots, event.max_model_len), event.num_slots
            if isinstance(spec, MambaSpec):
                extra = spec.num_speculative_blocks
            if not state.lookahead_on_prefill_chunks and event.num_main < len(
                event.request.token_ids
            ):
                low = min(event.num_main, event.max_model_len)
        least, most = max(old, cdiv(low, bs) + extra), max(old, cdiv(high, bs) + extra)
        if not spec.uses_slot_mapping:
            least = most = 1  # a circular buffer: its one ring
        if not least <= len(row) <= most:
            want = f"{least}" if least == most else f"{least} to {most}"
            return (
                f"allocate_slots({rid!r}) for {high} slots left group {gid} "
                f"({spec.type_name}) with {len(row)} blocks, expected max({old} before, "
                f"cdiv({low}, {bs})) = {want}: {short(list(row))}"
            )
    return None


def failed_allocation(state: CheckState, event: FailedAllocationEvent) -> str | None:
    """A1: an allocation that returns ``None`` adds no block to the table and changes no
    ref count of the hit it was offered."""
    rid = event.request_id
    if event.tables_before:
        after = state.engine.get_block_ids(rid)
        for gid, (old, new) in enumerate(zip(event.tables_before, after)):
            added = {b for b in new if b != 0} - set(old)
            if added:
                return (
                    f"allocate_slots({rid!r}) returned None but group {gid} gained blocks "
                    f"{sorted(added)}"
                )
    before_refs = event.before[1]
    if event.hit is not None and state.has_ref_counts and before_refs is not None:
        refs = state.ref_counts()
        for gid, table in enumerate(event.hit.block_ids):
            for b in table:
                if b != 0 and refs.get(b) != before_refs.get(b):
                    return (
                        f"allocate_slots({rid!r}) returned None but the ref count of hit "
                        f"block {b} (group {gid}) changed {before_refs.get(b)} -> {refs.get(b)}"
                    )
    return None


def most_row_blocks(spec: KVCacheSpec, slots: int) -> int:
    """The longest row a group may need for ``slots`` slots: ``cdiv(slots, bs)``, plus a
    Mamba group's ``k`` speculative blocks. Example: Mamba bs 4 with 2 speculative
    blocks, 9 slots -> 5."""
    extra = spec.num_speculative_blocks if isinstance(spec, MambaSpec) else 0
    return cdiv(slots, spec.block_size) + extra


def _may_copy_a_tail(state: CheckState, spec) -> bool:
    """Whether an allocation of this group may need one block more than its slots: a
    Mamba group with partial hits copies the state block its prompt's partial tail is
    keyed on (:mod:`reference.managers.mamba`)."""
    return state.layout.partial_hits_enabled and isinstance(spec, MambaSpec)


def allocation_fits(state: CheckState, event: FailedAllocationEvent) -> str | None:
    """A2: an allocation without a prefix hit whose blocks fit in the free count does
    not fail. A group needs at most ``cdiv(slots, bs) - len(row)`` new blocks for
    ``slots`` slots (fewer when a window frees blocks first), plus one for a Mamba group
    with partial hits (the copy of its prompt's partial tail); with one shared pool the
    sum over groups must not exceed ``num_free_blocks()`` before the call.

    Example: one full group, bs 4, a row of 2 blocks, 3 free: 12 slots need at most
    ``3 - 2 = 1`` block, so ``None`` is a violation. Under the admission gate the slots
    are the whole sequence's (the gate's capped need is at most that).
    """
    if event.hit is not None and event.hit.num_tokens > 0:
        return None  # adopting a hit may cost more (evictable blocks; Mamba same step)
    rows = event.tables_before or tuple(() for _ in state.layout.groups)
    need = sum(
        max(0, most_row_blocks(g.spec, event.num_slots) - len(row))
        + (1 if _may_copy_a_tail(state, g.spec) else 0)
        for g, row in zip(state.layout.groups, rows)
    )
    free = event.before[0]
    if need <= free:
        return (
            f"allocate_slots({event.request_id!r}) for {event.num_slots} slots returned None, "
            f"but it needs at most {need} new blocks and {free} were free"
        )
    return None


# ---------------------------------------------------------------------------
# Commits (C1)


def committed_blocks_verified(state: CheckState, event: CommitEvent) -> str | None:
    """C1: after ``cache_blocks`` (the scheduler commits processed tokens; after a draft
    step, once the rejected drafts are rolled back), every block of the request that the
    engine registers in the prefix cache for ``T`` tokens holds the request's own tokens
    at each of its positions below ``T``: no slot a rejected draft wrote (the shadow marks
    those slots :data:`properties.checks.oracles.OVERWRITTEN`), no slot not computed yet.
    Mamba groups are left to H2 (a state is written when its step runs).

    Worked example (bs 4): a decode at position 9 with 3 drafts writes slots 9..12; one
    draft is accepted: computed 11, tokens 12 (the bonus token at 11 is computed in the
    next step; its slot still holds the second, rejected draft). ``cache_blocks(r, 11)``
    may register blocks 0 and 1 (positions 0..7), not block 2 (positions 8..11):
    registering it for 12 tokens would serve the rejected draft's KV at position 11 to
    every later hit (``tests/properties/checks/test_allocation_estimate.py``).

    At the large tiers it runs at the step boundary (one O(pool) read of the cached blocks,
    indexed by block, for every commit of the step, each commit looking up its own blocks:
    :meth:`properties.checks.checker.Checker.on_commit`),
    on the table and token count the request had at its commit: until the next step
    starts, no allocation runs, so no block is evicted (the cached blocks only grow) and
    no block the request holds is written.
    """
    req = event.request
    rid = req.request_id
    if event.table is None:
        if not req.holds_blocks:
            return None
        table = state.table_of(rid)
    else:
        table = event.table
    where: dict[tuple[int, int], int] = {}
    for gid, row in enumerate(table):
        if isinstance(state.layout.groups[gid].spec, MambaSpec):
            continue
        for i, b in enumerate(row):
            if b != 0:
                where[(gid, b)] = i
    if not where:
        return None
    req.refresh_ids()
    known = len(req.ids) if event.num_request_tokens is None else event.num_request_tokens
    cached = state.cached_by_block()
    for cb, index in ((cb, i) for key, i in where.items() for cb in cached.get(key, ())):
        bs = state.layout.groups[cb.group_id].spec.block_size
        first, end = index * bs, min(cb.num_tokens, (index + 1) * bs)
        if end > known:
            return (
                f"request {rid!r}: block {cb.block_id} (group {cb.group_id}, index {index}) is "
                f"cached for {cb.num_tokens} tokens, but the request has {known} "
                f"tokens (after cache_blocks({rid!r}, {event.num_tokens}))"
            )
        why = missing_context(
            state.layout, state.shadow, cb.group_id, table[cb.group_id], req.ids, first, end
        )
        if why is not None:
            return (
                f"request {rid!r}: block {cb.block_id} (group {cb.group_id}) is cached for "
                f"{cb.num_tokens} tokens after cache_blocks({rid!r}, {event.num_tokens}), but "
                f"{why}"
            )
    return None


# ---------------------------------------------------------------------------
# Free and reset (F1, R1)


def freed_on_free(state: CheckState, event: FreeEvent) -> str | None:
    """F1: ``free()`` leaves the request without blocks."""
    try:
        table = state.engine.get_block_ids(event.request_id)
    except Exception:  # noqa: BLE001 - an engine may forget freed requests
        table = ()
    held = [b for g in table for b in g if b != 0]
    if held:
        return f"free({event.request_id!r}) left blocks {short(held)} in its table"
    return None


def reset_prefix_cache(state: CheckState, event: ResetEvent) -> str | None:
    """R1: reset succeeds iff no request holds blocks; afterwards nothing is cached.

    A request holds blocks when a non-null id stands in its table: one whose allocations
    gave only null blocks holds none (an asynchronous load of 1 token into a window of 1
    token, skipped at once, leaves the table ``((),)`` and a reset succeeds)."""
    holders = [
        rid
        for rid, r in state.requests.items()
        if r.holds_blocks and any(b for row in state.table_of(rid) for b in row)
    ]
    if event.ok and holders:
        return f"reset_prefix_cache succeeded while {short(holders)} hold blocks"
    if not event.ok and not holders:
        return "reset_prefix_cache failed with no request holding blocks"
    if event.ok and state.has_cached and state.cached_blocks():
        return "blocks are still cached after a successful reset"
    return None


# ---------------------------------------------------------------------------
# The pool (I1-I3)


def pool_accounting(state: CheckState, event: PoolEvent) -> str | None:
    """I1: free + blocks in use == num_blocks - 1 (null block excluded); without ref
    counts, free + blocks held by requests never exceeds it."""
    n = state.layout.num_blocks
    if state.has_ref_counts:
        used = sum(1 for c in state.ref_counts().values() if c > 0)
        if event.num_free + used != n - 1:
            return f"{event.num_free} free + {used} in use != {n - 1} blocks (null block excluded)"
        return None
    held = {b for t in event.tables.values() for row in t for b in row if b != 0}
    if event.num_free + len(held) > n - 1:
        return f"{event.num_free} free + {len(held)} held by requests > {n - 1} blocks"
    return None


def pinned_by_copies(state: CheckState) -> dict[int, int]:
    """Group -> the device blocks that copies in flight to or from the engine's own host
    tier keep from being free or reclaimable while no request holds them
    (``OwnsHostTier``, ``HostPoolUsage.num_pinned_device``, one count for the groups of
    a host pool, kept under its first group). Empty for an engine without a host tier."""
    if not state.has_host_tier:
        return {}
    return {p.group_ids[0]: p.num_pinned_device for p in state.host_pools() if p.group_ids}


def idle_pool_free(state: CheckState, event: PoolEvent) -> str | None:
    """I7: with no request holding blocks, every block is free or reclaimable: the free
    count is back to the fresh engine's (``num_blocks - 1`` for one shared pool), but for
    the blocks copies in flight to or from the engine's own host tier pin
    (:func:`pinned_by_copies`: that many fewer with one shared pool; with separate pools
    the smallest pool's count lies between the fresh count less them and the fresh
    count, S2 checks each pool exactly).

    Example: 15 blocks, every request freed, ``num_free_blocks() == 13``: a block leaked.
    """
    if event.tables or state.pending_block_copies or event.num_free == state.initial_free:
        return None  # pending block copies hold their blocks until they are handed over
    pinned = sum(pinned_by_copies(state).values())
    if pinned:
        fewest = state.initial_free - pinned
        if state.shared_pool and event.num_free == fewest:
            return None
        if not state.shared_pool and fewest <= event.num_free <= state.initial_free:
            return None
    return (
        f"no request holds blocks, but {event.num_free} blocks are free or reclaimable; "
        f"the fresh engine had {state.initial_free}"
    )


def ref_counts_match_owners(state: CheckState, event: PoolEvent) -> str | None:
    """I3: a block's ref count equals the number of (request, group) rows holding it,
    plus one per pending block copy it is an end of (copy-on-write of a partial hit:
    :class:`properties.core.engine.CopiesBlocks`, until the copy is handed over)."""
    owners: dict[int, int] = state.copy_holds()
    for table in event.tables.values():
        for row in table:
            for b in row:
                if b != 0:
                    owners[b] = owners.get(b, 0) + 1
    for b, c in state.ref_counts().items():
        if c != owners.get(b, 0):
            holders = [
                (rid, g) for rid, t in event.tables.items() for g, row in enumerate(t) if b in row
            ]
            copies = [pair for pair in state.pending_block_copies if b in pair]
            extra = f" and pending copies {copies}" if copies else ""
            return f"block {b} has ref count {c} but is held by {holders}{extra}"
    return None


def in_flight_reads_held(state: CheckState, event: PoolEvent) -> str | None:
    """W3 under asynchronous scheduling: every block a step still in flight reads (the
    window of its tokens, as planned) stays in the request's table until that step's
    output is processed: never freed, nulled or replaced meanwhile.

    Example: SWA w 4, bs 2, a request planned tokens 8..9 (they read tokens 5..9,
    blocks 2..4); freeing block 2 on the optimistic count 10 (skipped 7 -> blocks 0..2)
    before the step is processed breaks it.
    """
    for rid, chunks in state.in_flight_reads.items():
        table = event.tables.get(rid)
        for n, reads in chunks:
            for gid, index, block in sorted(reads):
                row = table[gid] if table is not None else ()
                if index >= len(row) or row[index] != block:
                    now = "freed with the request"
                    if table is not None:
                        now = f"now {row[index]}" if index < len(row) else "row shortened"
                    return (
                        f"request {rid!r}: block {block} (group {gid}, index {index}) is read "
                        f"by {n} tokens still in flight but was released ({now})"
                    )
    return None


def free_queue_contents(state: CheckState, event: PoolEvent) -> str | None:
    """I2: the free queue holds exactly the non-null blocks with ref count 0, once each."""
    queue = state.free_queue()
    zero = {b for b, c in state.ref_counts().items() if c == 0}
    free = event.num_free
    if len(queue) != len(set(queue)) or 0 in queue or set(queue) != zero or len(queue) != free:
        dups = sorted({b for b in queue if queue.count(b) > 1})
        return (
            f"free queue (len {len(queue)}, duplicates {dups}) differs from the "
            f"{len(zero)} blocks with ref count 0 (free count {free}): missing "
            f"{sorted(zero - set(queue))[:8]}, extra {sorted(set(queue) - zero)[:8]}"
        )
    return None


# ---------------------------------------------------------------------------
# Separate pools (S1-S3): engines whose groups do not share one block pool


def held_per_pool(state: CheckState, tables: dict) -> dict[str, set[int]]:
    """The distinct non-null blocks the requests' tables hold, per pool."""
    held: dict[str, set[int]] = {}
    for pool in state.pools():
        blocks = held.setdefault(pool.name, set())
        for table in tables.values():
            for gid in pool.group_ids:
                if gid < len(table):
                    blocks.update(b for b in table[gid] if b != 0)
    return held


def pool_accounting_per_pool(state: CheckState, event: PoolEvent) -> str | None:
    """S1: in every pool, the free count plus the distinct blocks the requests hold from
    it never exceeds the pool's capacity, and a pool's capacity and groups never change.

    Example: SGLang's SWA pool of 16 pages reports 14 free while two requests hold SWA
    pages 3, 4 and 9: 14 + 3 > 16, a page is counted free (or reclaimable) while held.
    """
    held = held_per_pool(state, event.tables)
    for pool in state.pools():
        first = state.initial_pools.get(pool.name)
        if first is None or (first.num_blocks, first.group_ids) != (
            pool.num_blocks,
            pool.group_ids,
        ):
            return (
                f"pool {pool.name!r} is now {pool.num_blocks} blocks for groups "
                f"{list(pool.group_ids)}; the fresh engine reported "
                f"{'no such pool' if first is None else (first.num_blocks, list(first.group_ids))}"
            )
        n = len(held[pool.name])
        if pool.num_free + n > pool.num_blocks:
            return (
                f"pool {pool.name!r} (groups {list(pool.group_ids)}): {pool.num_free} free + "
                f"{n} held by requests > its {pool.num_blocks} blocks"
            )
    return None


def idle_pool_free_per_pool(state: CheckState, event: PoolEvent) -> str | None:
    """S2: with no request holding blocks, every pool is back to the fresh engine's free
    count (I7 per pool: a leak in a larger pool hides behind a smaller pool's count).

    Example: full pool 12 pages, SWA pool 16 pages, every request freed, the SWA pool
    reports 15 free: a SWA page leaked, yet ``num_free_blocks()`` (SGLang: the smaller
    pool's count, 12) is back to the fresh engine's and I7 sees nothing. Blocks that
    copies in flight to or from the engine's own host tier pin are neither
    (:func:`pinned_by_copies`): 15 is right while one SWA page is being backed up.
    """
    if event.tables:
        return None
    pinned = pinned_by_copies(state)
    for pool in state.pools():
        first = state.initial_pools[pool.name]
        backups = sum(pinned.get(g, 0) for g in pool.group_ids)
        if pool.num_free != first.num_free - backups:
            also = f" ({backups} pinned by copies to or from the host)" if backups else ""
            return (
                f"no request holds blocks, but pool {pool.name!r} (groups "
                f"{list(pool.group_ids)}) has {pool.num_free} blocks free or reclaimable; "
                f"the fresh engine had {first.num_free}{also}"
            )
    return None


def allocation_fits_per_pool(state: CheckState, event: FailedAllocationEvent) -> str | None:
    """S3: A2 per pool: an allocation offered no prefix hit does not fail when, in every
    pool, the new blocks its groups need fit that pool's free count before the call
    (a group needs at most ``cdiv(slots, bs) - len(row)``; ``slots`` not capped at
    ``max_model_len``: engines such as SGLang give lookahead slots past it).

    Example: full pool (group 0) 3 free, SWA pool (group 1) 2 free, bs 4, empty rows,
    8 slots: each pool needs 2 blocks and has them, so ``None`` is a violation; with 12
    slots the SWA pool needs 3 > 2 and ``None`` is allowed.
    """
    free = event.before[3] if len(event.before) > 3 else None
    if free is None or (event.hit is not None and event.hit.num_tokens > 0):
        return None
    rows = event.tables_before or tuple(() for _ in state.layout.groups)
    slots = max(event.num_slots, event.num_slots_uncapped)
    needs = []
    for pool in state.pools():
        need = sum(
            max(0, most_row_blocks(state.layout.groups[g].spec, slots) - len(rows[g]))
            for g in pool.group_ids
        )
        if need > free.get(pool.name, 0):
            return None
        needs.append(f"{pool.name}: {need} of {free.get(pool.name, 0)} free")
    return (
        f"allocate_slots({event.request_id!r}) for {slots} slots returned None, "
        f"but every pool had the blocks it needs ({'; '.join(needs)})"
    )
