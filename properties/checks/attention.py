"""The attention property: what an engine's block tables make the model compute is right.

Engine-agnostic: the checker sees only, per step, each scheduled request's tokens, how many
were computed before, how many are scheduled, and the engine's block table per group (after
``allocate_slots``). It keeps a paged cache per group across steps and requests, exactly as a
worker would, so a prefix hit reads blocks an earlier request wrote.

Per step and group (attention: full, sliding window, chunked local):

1. the K/V of every scheduled position (from :class:`reference.content.ContentModel`, whose
   vectors depend on the whole prefix, salt and LoRA) is written through the table's slot
   mapping; a scheduled token whose slot falls in the null block 0, or past the row, raises;
2. every scheduled query attends through the table (nulling view of docs/spec.md §7) and the
   paged cache (:func:`paged.paged_attention.paged_attention`), and is compared with the
   dense float64 reference (:func:`reference.attention.dense_attention`).

Mamba groups: before the writes, the state read from column ``cdiv(before, bs) - 1`` (when
``before > 0``) must equal the content model's state of ``tokens[0:before]``; after the step
the state of ``tokens[0:end]`` is written into column ``cdiv(end, bs) - 1``.

Tolerance (defaults ``atol = rtol = 1e-5`` for a float32 cache). Inputs are exact in float32
(see :mod:`reference.content`), so the only differences are float32 rounding in the dot
products (``head_size`` terms), the softmax and the weighted sum: a few ulps of 6e-8 times
``log2`` of at most a few thousand keys, i.e. below 1e-6 (observed: about 1e-7 over the test
and bench sequences). A fault is orders of magnitude above it: a key from a wrong prefix or
a stale page changes ``v`` by O(1) at softmax weight about ``1/n`` (n keys seen, at most a
few hundred here), i.e. an error of order 1e-3 or more, and a read of the null block or of
an unwritten page gives NaN, which never compares equal. With ``dtype=torch.float64`` the
defaults can shrink to 1e-10.

Host tier (external hits, :mod:`reference.host_tier`): :meth:`AttentionChecker.offload`
is the connector's store: when a block leaves the primary pool (detached from a window,
or released), its K/V are read back from the paged cache *then* and kept, keyed by group
and the prefix each position belongs to (``(salt, LoRA, tokens[0 : p + 1])``).
:meth:`AttentionChecker.load` is the connector's load: the kept K/V of positions
``[start, end)`` are copied into the request's blocks (null entries, below a sliding
window, are skipped). The queries of the next steps then read them, so content that
went out to the host tier and came back not exactly the content of its prefix (a block
overwritten before it was offloaded, a load into a block another request owns) fails
the comparison with the dense reference. A position to load that was never offloaded
raises :class:`AttentionMismatch`.

An engine that owns its host tier (``OwnsHostTier``, SGLang's HiCache) reports its own
copies instead (:meth:`AttentionChecker.host_transfers`): a ``write`` keeps the device
block's K/V under its host block, a ``load`` copies a host block's K/V into a device
block, a ``store`` and a ``fetch`` move a host block's K/V to and from its storage
tier. The queries that later read a loaded block then check that the engine's tiers
gave back exactly what they took, block for block (a load from the wrong host block, or
of a host block written before its device block was computed, reads another prefix's
K/V or NaN).

Example::

    checker = AttentionChecker(layout)
    blocks = engine.allocate_slots("a", 10)
    checker.check_step([ScheduledChunk(req_a, tokens, 0, 10, blocks)])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged.paged_attention import RequestQueries, paged_attention
from paged.paged_cache import CacheShape, PagedKVCache, PagedStateCache
from properties.core.engine import (
    HOST_FETCH,
    HOST_STORE,
    HOST_WRITE,
    BlockIds,
    ExposesDataPlane,
    HostTransfer,
    RequestInput,
)
from reference.attention import dense_attention, visible_keys
from reference.block_table import NULL_BLOCK_ID, BlockTable
from reference.content import ContentModel
from reference.errors import KVConformError
from reference.layout import KVCacheLayout
from reference.media import MultimodalItem, input_identities
from reference.specs import AttentionSpec, MambaSpec, RSWASpec, cdiv


class AttentionMismatch(KVConformError):
    """The paged path read the wrong K/V or state: names request, group, position, error."""


class AttentionInputError(KVConformError):
    """A :class:`ScheduledChunk` is inconsistent (counts, lengths, number of groups)."""


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's work in one step (see the module docstring)."""

    request: RequestInput
    token_ids: tuple[int, ...]
    num_computed_before: int
    num_scheduled: int
    block_ids: BlockIds

    @property
    def end(self) -> int:
        return self.num_computed_before + self.num_scheduled

    @property
    def positions(self) -> range:
        return range(self.num_computed_before, self.end)


@dataclass(frozen=True)
class GroupStep:
    """One attention group's inputs for one step, on the cache's device.

    ``slots``: the slot mapping of every scheduled token (request order); ``keys``/``values``:
    ``[tokens, heads, head_size]``; ``requests``: each request's row, positions and queries.
    """

    slots: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    requests: tuple[RequestQueries, ...]


def models_layout(layout: KVCacheLayout) -> bool:
    """Whether the attention check models every group of ``layout``: not R-SWA (its mask
    reads the prompt and a window) nor a circular buffer (a ring without slot mapping).
    Example: full + SWA is modelled; full + a ring of 8 is not."""
    return not any(
        isinstance(g.spec, RSWASpec) or not g.spec.uses_slot_mapping for g in layout.groups
    )


class AttentionChecker:
    """Paged caches for every group of ``layout`` plus the dense reference to compare with."""

    def __init__(
        self,
        layout: KVCacheLayout,
        *,
        device: str = "cpu",
        seed: int = 0,
        num_kv_heads: int = 1,
        head_size: int = 8,
        atol: float = 1e-5,
        rtol: float = 1e-5,
        dtype: torch.dtype = torch.float32,
        backend: str = "torch",
        state_size: int = 8,
        data_plane: ExposesDataPlane | None = None,
    ) -> None:
        self.layout = layout
        #: The engine's own data plane, when it exposes one: slot mapping, K/V writes,
        #: attention and Mamba states then go through the engine (end to end), and the
        #: harness keeps only the content model and the dense reference.
        self.data_plane = data_plane
        if data_plane is not None:
            data_plane.attach_data_plane(
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                state_size=state_size,
                dtype=dtype,
                device=device,
            )
        self.device = device
        self.atol = atol
        self.rtol = rtol
        self.backend = backend
        self.content = ContentModel(
            seed=seed, num_kv_heads=num_kv_heads, head_size=head_size, state_size=state_size
        )
        self.caches: list[PagedKVCache | PagedStateCache] = []
        if not models_layout(layout):
            raise AttentionInputError(
                "AttentionChecker: R-SWA's mask and circular buffers are not modelled "
                "(their groups are drawn by the production property only)"
            )
        for g in layout.groups:
            if isinstance(g.spec, MambaSpec):
                self.caches.append(
                    PagedStateCache(layout.num_blocks, state_size, dtype=dtype, device=device)
                )
            elif isinstance(g.spec, AttentionSpec):
                shape = CacheShape(layout.num_blocks, g.spec.block_size, num_kv_heads, head_size)
                self.caches.append(PagedKVCache(shape, dtype=dtype, device=device))
            else:
                raise AttentionInputError(
                    f"group spec {type(g.spec).__name__} is neither attention nor Mamba"
                )
        self._hash_memo: dict[str, tuple[tuple, tuple[int, ...], list[int]]] = {}
        #: host copies (see the module docstring): (group, salt, LoRA, prefix) -> (K, V)
        self._host: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        #: an engine's own host tier: (group, host block) -> the block's (K, V)
        self._host_blocks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        #: its storage tier (L3): (group, storage key) -> the stored block's (K, V)
        self._stored: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    # -- public -------------------------------------------------------------------------
    def check_step(
        self,
        chunks: Sequence[ScheduledChunk],
        copies: Sequence[tuple[int, int]] = (),
        copy_groups: Sequence[int | None] | None = None,
    ) -> None:
        """Run the step's block ``copies`` (copy-on-write of partial hits: ``(source,
        destination)``, before anything else; ``copy_groups``: see :meth:`copy_blocks`),
        write the step's K/V (or states) and check every scheduled query of every group."""
        self.copy_blocks(copies, copy_groups)
        chunks = [c for c in chunks if self._validate(c)]
        for gid, group in enumerate(self.layout.groups):
            if isinstance(group.spec, MambaSpec):
                self._check_mamba(gid, chunks)
            else:
                if self.data_plane is not None:
                    observed = self.run_engine_group(gid, chunks)
                else:
                    observed = self.run_group(gid, self.prepare_group(gid, chunks))
                expected = self.dense_outputs(gid, chunks)
                self.compare(gid, chunks, expected, observed)

    def copy_blocks(
        self,
        copies: Sequence[tuple[int, int]],
        groups: Sequence[int | None] | None = None,
    ) -> None:
        """Copy every page of ``source`` onto ``destination`` (each group's cache: with
        one shared pool a block id belongs to one group at a time, the other groups'
        pages at that id are unused), as a worker runs a step's copy-on-write copies
        before its forward pass. With separate pools ``groups`` names each copy's group
        (the pool it is in; None: unknown, not modelled); only that group's cache is
        copied. Example:
        ``copy_blocks([(4, 9)])`` makes block 9's K/V (or state) block 4's;
        ``copy_blocks([(4, 9)], [1])`` only group 1's."""
        if copies and self.data_plane is not None:
            raise AttentionInputError(
                "AttentionChecker.copy_blocks: block copies through an engine's data plane "
                "are not supported"
            )
        for i, (source, destination) in enumerate(copies):
            if groups is not None and groups[i] is None:
                continue  # separate pools, a copy of no known group: nothing is modelled
            caches = self.caches if groups is None else [self.caches[groups[i]]]
            for cache in caches:
                if isinstance(cache, PagedKVCache):
                    cache.key[destination] = cache.key[source]
                    cache.value[destination] = cache.value[source]
                else:
                    cache.state[destination] = cache.state[source]

    def _host_key(self, gid: int, request: RequestInput, token_ids: Sequence[int], p: int) -> tuple:
        return (gid, request.cache_salt, request.lora_name, tuple(token_ids[: p + 1]))

    def _attention_cache(self, gid: int, what: str) -> PagedKVCache:
        if self.data_plane is not None:
            raise AttentionInputError(
                f"AttentionChecker.{what}: host-tier copies through an engine's data plane "
                "are not supported"
            )
        cache = self.caches[gid]
        if not isinstance(cache, PagedKVCache):
            raise AttentionInputError(
                f"AttentionChecker.{what}: group {gid} is a Mamba group; offloaded states "
                "are not modelled"
            )
        return cache

    def offload(
        self,
        gid: int,
        request: RequestInput,
        token_ids: Sequence[int],
        block_index: int,
        block_id: int,
    ) -> None:
        """The connector stores block ``block_index`` of group ``gid`` (device block
        ``block_id``, leaving the primary pool now): its K/V are kept (module docstring)."""
        cache = self._attention_cache(gid, "offload")
        bs = cache.block_size
        for p in range(block_index * bs, (block_index + 1) * bs):
            self._host[self._host_key(gid, request, token_ids, p)] = (
                cache.key[block_id, p % bs].clone(),
                cache.value[block_id, p % bs].clone(),
            )

    def load(
        self,
        request: RequestInput,
        token_ids: Sequence[int],
        block_ids: BlockIds,
        start: int,
        end: int,
    ) -> None:
        """The connector loads positions ``[start, end)`` of ``request``'s prefix from the
        host copies into its blocks ``block_ids`` (module docstring)."""
        for gid in range(len(self.caches)):
            cache = self._attention_cache(gid, "load")
            bs = cache.block_size
            row = block_ids[gid]
            for p in range(start, end):
                col = p // bs
                if col >= len(row) or row[col] == NULL_BLOCK_ID:
                    continue
                copy = self._host.get(self._host_key(gid, request, token_ids, p))
                if copy is None:
                    raise AttentionMismatch(
                        f"request {request.request_id!r}, group {gid}, position {p}: "
                        "loaded from the host tier, which never received that block"
                    )
                cache.key[row[col], p % bs] = copy[0]
                cache.value[row[col], p % bs] = copy[1]

    def host_transfers(self, transfers: Sequence[HostTransfer]) -> None:
        """An engine with its own host tier copied these blocks, in order (module
        docstring): a ``write`` keeps the device block's K/V, a ``load`` puts a kept
        block's K/V into a device block (one never written raises)."""
        for t in transfers:
            cache = self._attention_cache(t.group_id, "host_transfers")
            key = (t.group_id, t.host_block)
            if t.kind in (HOST_STORE, HOST_FETCH):
                self._storage_copy(t, key)
                continue
            if t.kind == HOST_WRITE:
                self._host_blocks[key] = (
                    cache.key[t.device_block].clone(),
                    cache.value[t.device_block].clone(),
                )
                continue
            copy = self._host_blocks.get(key)
            if copy is None:
                raise AttentionMismatch(
                    f"group {t.group_id}: device block {t.device_block} loaded from host "
                    f"block {t.host_block}, which no write filled"
                )
            cache.key[t.device_block] = copy[0]
            cache.value[t.device_block] = copy[1]

    def _storage_copy(self, t: HostTransfer, host_key: tuple[int, int]) -> None:
        """A ``store`` keeps a host block's K/V under its storage key; a ``fetch`` puts a
        stored key's K/V into a host block (one never stored raises)."""
        stored_key = (t.group_id, t.storage_key)
        if t.kind == HOST_STORE:
            copy = self._host_blocks.get(host_key)
            if copy is None:
                raise AttentionMismatch(
                    f"group {t.group_id}: host block {t.host_block} stored under "
                    f"{t.storage_key!r}, but no write filled it"
                )
            self._stored[stored_key] = copy
            return
        stored = self._stored.get(stored_key)
        if stored is None:
            raise AttentionMismatch(
                f"group {t.group_id}: host block {t.host_block} fetched from storage key "
                f"{t.storage_key!r}, which no store wrote"
            )
        self._host_blocks[host_key] = stored

    # -- pieces (also used by the bench) --------------------------------------------------
    def hashes(self, chunk: ScheduledChunk) -> list[int]:
        """Prefix hashes of ``chunk.token_ids`` (salt, LoRA), extended incrementally."""
        req = chunk.request
        extra = (req.cache_salt, req.lora_name)
        memo = self._hash_memo.get(req.request_id)
        tokens = chunk.token_ids
        if req.has_media:  # what each position feeds the model (reference.media)
            items = [MultimodalItem(*item) for item in req.mm_items]
            tokens = tuple(input_identities(tokens, items, req.prompt_embeds))
        if memo is not None and memo[0] == extra and tokens[: len(memo[1])] == memo[1]:
            hashes = self.content.extend_hashes(memo[2], tokens[len(memo[1]) :])
        else:
            hashes = self.content.prefix_hashes(tokens, *extra)
        self._hash_memo[req.request_id] = (extra, tokens, hashes)
        return hashes

    def prepare_group(self, gid: int, chunks: Sequence[ScheduledChunk]) -> GroupStep:
        """Slot mapping and K/V/Q tensors of attention group ``gid`` for one step.

        Raises :class:`AttentionMismatch` when a scheduled token has no table entry or its
        slot lands in the null block 0.
        """
        cache = self.caches[gid]
        assert isinstance(cache, PagedKVCache)
        table = BlockTable.for_spec(self.layout.groups[gid].spec)
        slots: list[int] = []
        keys: list = []
        values: list = []
        requests: list[RequestQueries] = []
        for chunk in chunks:
            rid = chunk.request.request_id
            row = chunk.block_ids[gid]
            table.add_row(rid, row)
            for pos in chunk.positions:
                col = pos // table.block_size
                if col >= len(row):
                    raise AttentionMismatch(
                        f"request {rid!r}, group {gid}, position {pos}: the block table row "
                        f"has {len(row)} entries, the token needs column {col}"
                    )
                if row[col] == NULL_BLOCK_ID:
                    raise AttentionMismatch(
                        f"request {rid!r}, group {gid}, position {pos}: scheduled token's slot "
                        f"lands in the null block 0 (column {col} of row {list(row)})"
                    )
            positions = list(chunk.positions)
            slots += table.slot_mapping([rid] * len(positions), positions)
            hashes = self.hashes(chunk)
            keys += [self.content.key(hashes, p, gid) for p in positions]
            values += [self.content.value(hashes, p, gid) for p in positions]
            q = [self.content.query(hashes, p, gid) for p in positions]
            requests.append(
                RequestQueries(
                    tuple(row),
                    tuple(positions),
                    torch.tensor(q, dtype=cache.key.dtype, device=cache.key.device),
                )
            )
        device = cache.key.device
        return GroupStep(
            torch.tensor(slots, dtype=torch.int64, device=device),
            torch.tensor(keys, dtype=cache.key.dtype, device=device),
            torch.tensor(values, dtype=cache.key.dtype, device=device),
            tuple(requests),
        )

    def run_group(self, gid: int, step: GroupStep) -> list[torch.Tensor]:
        """The paged path: write the step's K/V through the slots, then attend per request."""
        cache = self.caches[gid]
        assert isinstance(cache, PagedKVCache)
        if step.slots.numel():
            cache.write(step.slots, step.keys, step.values)
        spec = self.layout.groups[gid].spec
        return paged_attention(cache, spec, step.requests, backend=self.backend)

    def run_engine_group(self, gid: int, chunks: Sequence[ScheduledChunk]) -> list[torch.Tensor]:
        """The engine's data plane: the step's K/V and queries of group ``gid`` go in, its
        slot mapping, cache writes and paged attention produce the outputs. An error it
        raises (a slot in the null block, a missing row) is a mismatch."""
        assert self.data_plane is not None
        keys: list = []
        values: list = []
        queries: list[torch.Tensor] = []
        for chunk in chunks:
            hashes = self.hashes(chunk)
            positions = list(chunk.positions)
            keys += [self.content.key(hashes, p, gid) for p in positions]
            values += [self.content.value(hashes, p, gid) for p in positions]
            queries.append(torch.tensor([self.content.query(hashes, p, gid) for p in positions]))
        try:
            return self.data_plane.data_plane_attention(
                gid,
                [c.request.request_id for c in chunks],
                [c.num_computed_before for c in chunks],
                [c.num_scheduled for c in chunks],
                torch.tensor(keys),
                torch.tensor(values),
                queries,
            )
        except KVConformError as exc:
            raise AttentionMismatch(f"group {gid}: the engine's data plane failed: {exc}") from exc

    def dense_outputs(self, gid: int, chunks: Sequence[ScheduledChunk]) -> list[list]:
        """The float64 reference outputs of group ``gid`` for every scheduled query."""
        spec = self.layout.groups[gid].spec
        return [
            dense_attention(self.content, spec, self.hashes(c), list(c.positions), gid)
            for c in chunks
        ]

    # -- internals ----------------------------------------------------------------------
    def _validate(self, chunk: ScheduledChunk) -> bool:
        rid = chunk.request.request_id
        if len(chunk.block_ids) != len(self.layout.groups):
            raise AttentionInputError(
                f"request {rid!r}: block_ids has {len(chunk.block_ids)} groups, the layout "
                f"{len(self.layout.groups)}"
            )
        if chunk.num_computed_before < 0 or chunk.num_scheduled < 0:
            raise AttentionInputError(
                f"request {rid!r}: num_computed_before {chunk.num_computed_before} and "
                f"num_scheduled {chunk.num_scheduled} must be >= 0"
            )
        if chunk.end > len(chunk.token_ids):
            raise AttentionInputError(
                f"request {rid!r}: computes up to position {chunk.end - 1} but token_ids has "
                f"only {len(chunk.token_ids)} tokens"
            )
        return chunk.num_scheduled > 0

    def _check_mamba_engine(self, gid: int, chunks: Sequence[ScheduledChunk]) -> None:
        """Mamba through the engine's data plane: the state read before the step is the
        content model's state of ``tokens[0:before]``; the step's final state is stored."""
        assert self.data_plane is not None
        for chunk in chunks:
            before = chunk.num_computed_before
            if before == 0:
                continue
            rid = chunk.request.request_id
            try:
                block, observed = self.data_plane.data_plane_read_state(gid, rid, before)
            except KVConformError as exc:
                raise AttentionMismatch(
                    f"request {rid!r}, group {gid} (mamba), position {before}: the engine's "
                    f"data plane failed: {exc}"
                ) from exc
            expected = torch.tensor(
                self.content.state(self.hashes(chunk), before, gid), dtype=torch.float64
            )
            self._raise_if_far(
                rid,
                gid,
                before,
                expected,
                observed.to(device="cpu", dtype=torch.float64),
                what=f"state of tokens[0:{before}] from block {block}",
            )
        for chunk in chunks:
            rid = chunk.request.request_id
            state = self.content.state(self.hashes(chunk), chunk.end, gid)
            try:
                self.data_plane.data_plane_write_state(
                    gid, rid, chunk.end, torch.tensor(state, dtype=torch.float64)
                )
            except KVConformError as exc:
                raise AttentionMismatch(
                    f"request {rid!r}, group {gid} (mamba), position {chunk.end}: the engine's "
                    f"data plane failed: {exc}"
                ) from exc

    def _check_mamba(self, gid: int, chunks: Sequence[ScheduledChunk]) -> None:
        if self.data_plane is not None:
            self._check_mamba_engine(gid, chunks)
            return
        cache = self.caches[gid]
        assert isinstance(cache, PagedStateCache)
        bs = self.layout.groups[gid].spec.block_size
        for chunk in chunks:
            before = chunk.num_computed_before
            if before == 0:
                continue
            rid = chunk.request.request_id
            row = chunk.block_ids[gid]
            col = cdiv(before, bs) - 1
            if col >= len(row):
                raise AttentionMismatch(
                    f"request {rid!r}, group {gid} (mamba), position {before}: the row has "
                    f"{len(row)} entries, the state of tokens[0:{before}] is in column {col}"
                )
            expected = torch.tensor(
                self.content.state(self.hashes(chunk), before, gid), dtype=torch.float64
            )
            observed = cache.read(row[col]).to(device="cpu", dtype=torch.float64)
            self._raise_if_far(
                rid,
                gid,
                before,
                expected,
                observed,
                what=f"state of tokens[0:{before}] from block {row[col]}",
            )
        for chunk in chunks:
            rid = chunk.request.request_id
            row = chunk.block_ids[gid]
            col = cdiv(chunk.end, bs) - 1
            if col >= len(row) or row[col] == NULL_BLOCK_ID:
                raise AttentionMismatch(
                    f"request {rid!r}, group {gid} (mamba), position {chunk.end}: the state of "
                    f"tokens[0:{chunk.end}] goes to column {col}, which is "
                    f"{'missing' if col >= len(row) else 'the null block'} in {list(row)}"
                )
            state = self.content.state(self.hashes(chunk), chunk.end, gid)
            cache.write(row[col], torch.tensor(state, dtype=torch.float64))

    def compare(
        self,
        gid: int,
        chunks: Sequence[ScheduledChunk],
        expected: list[list],
        observed: list[torch.Tensor],
    ) -> None:
        for chunk, exp_rows, obs in zip(chunks, expected, observed):
            exp = torch.tensor(exp_rows, dtype=torch.float64)
            obs = obs.to(device="cpu", dtype=torch.float64)
            ok = _close(exp, obs, self.atol, self.rtol).reshape(len(exp_rows), -1).all(dim=1)
            if bool(ok.all()):
                continue
            i = int((~ok).nonzero()[0])
            pos = chunk.num_computed_before + i
            culprit = self.wrong_key(gid, chunk, pos)
            self._raise_if_far(
                chunk.request.request_id,
                gid,
                pos,
                exp[i],
                obs[i],
                what="attention output" + (f" ({culprit})" if culprit else ""),
                spec_name=self.layout.groups[gid].spec.type_name,
            )

    def wrong_key(self, gid: int, chunk: ScheduledChunk, pos: int) -> str | None:
        """Why the query at ``pos`` read wrong K/V: the first visible key position whose
        slot (through the chunk's table) does not hold the content model's K and V of
        that position, named with its block id and slot and what the slot holds instead
        (the null block's NaN, another position of this request, or other content).
        None through an engine's data plane (its cache is its own) or when every slot
        holds the right K/V.

        Example: bs 4, row ``[5, 7]``, the query at 6 reads keys 0..6; if block 7 slot 1
        holds position 1's K, the answer is ``"key position 5 read from block 7 slot 1
        (column 1): it holds the K/V of position 1 of this request, the content model
        expects position 5's"``.
        """
        cache = self.caches[gid]
        if self.data_plane is not None or not isinstance(cache, PagedKVCache):
            return None
        spec = self.layout.groups[gid].spec
        bs = cache.block_size
        row = chunk.block_ids[gid]
        hashes = self.hashes(chunk)

        def content_at(q: int) -> tuple[torch.Tensor, torch.Tensor]:
            k = torch.tensor(self.content.key(hashes, q, gid), dtype=torch.float64)
            v = torch.tensor(self.content.value(hashes, q, gid), dtype=torch.float64)
            return k, v

        for k in visible_keys(spec, pos):
            col = k // bs
            block = row[col] if col < len(row) else None
            where = f"key position {k} read from block {block} slot {k % bs} (column {col})"
            if block is None:
                return f"key position {k}: column {col} is missing from the row ({len(row)})"
            held_k = cache.key[block, k % bs].to(device="cpu", dtype=torch.float64)
            held_v = cache.value[block, k % bs].to(device="cpu", dtype=torch.float64)
            want_k, want_v = content_at(k)
            if bool(_close(want_k, held_k, self.atol, self.rtol).all()) and bool(
                _close(want_v, held_v, self.atol, self.rtol).all()
            ):
                continue
            if block == NULL_BLOCK_ID:
                return f"{where}: the null block (NaN), the content model expects position {k}'s"
            if bool(held_k.isnan().any()):
                return f"{where}: never written (NaN), the content model expects position {k}'s"
            for q in range(min(len(chunk.token_ids), len(hashes))):
                other_k, _ = content_at(q)
                if q != k and bool(_close(other_k, held_k, self.atol, self.rtol).all()):
                    return (
                        f"{where}: it holds the K/V of position {q} of this request, the "
                        f"content model expects position {k}'s"
                    )
            return (
                f"{where}: it holds K/V of another prefix, the content model expects "
                f"position {k} of this request's tokens [0, {k + 1})"
            )
        return None

    def _raise_if_far(
        self,
        rid: str,
        gid: int,
        pos: int,
        expected: torch.Tensor,
        observed: torch.Tensor,
        *,
        what: str,
        spec_name: str = "mamba",
    ) -> None:
        if bool(_close(expected, observed, self.atol, self.rtol).all()):
            return
        diff = (expected - observed).abs()
        err = math.nan if bool(diff.isnan().any()) else float(diff.max())
        raise AttentionMismatch(
            f"request {rid!r}, group {gid} ({spec_name}), position {pos}: {what} differs; "
            f"expected {_fmt(expected)}, observed {_fmt(observed)}, max abs error {err:.3g} "
            f"(atol {self.atol:g}, rtol {self.rtol:g})"
        )


def _close(
    expected: torch.Tensor, observed: torch.Tensor, atol: float, rtol: float
) -> torch.Tensor:
    # NaN compares False, so a NaN anywhere is a mismatch.
    return (expected - observed).abs() <= atol + rtol * expected.abs()


def _fmt(t: torch.Tensor) -> str:
    vals = t.flatten().tolist()
    shown = ", ".join(f"{v:.6g}" for v in vals[:8])
    return f"[{shown}{', ...' if len(vals) > 8 else ''}]"
