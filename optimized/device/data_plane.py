"""The device data plane of the optimized engine: caches, device tables, writes, attention.

Per step (:meth:`DataPlane.begin_step` first uploads the block-table entries the control
plane changed, :class:`optimized.device.device_tables.DeviceBlockTables`):

* attention groups: :meth:`DataPlane.attention` maps every scheduled token to its slot
  through the group's **device** table (:func:`optimized.device.slot_mapping.slot_mapping`),
  writes K/V into the group's paged cache through those slots, and attends each request's
  queries through the same device table, gathered on the device
  (:func:`optimized.device.table_attention.table_attention`);
* Mamba groups: :meth:`DataPlane.read_state` / :meth:`DataPlane.write_state` address the
  state page in column ``cdiv(n, bs) - 1`` of the device row.

Nothing here consults the manager's host rows after the upload, so a stale or skipped
upload shows up as a wrong read. Example: bs 4, a request on row 3 whose device row is
``[5, 9]`` schedules positions 6, 7: slots ``9 * 4 + 2 = 38`` and ``39``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from optimized.device.device_tables import DeviceBlockTables
from optimized.device.slot_mapping import slot_mapping, step_positions
from optimized.device.table_attention import table_attention
from optimized.device.table_source import table_source
from paged.paged_cache import CacheShape, PagedKVCache, PagedStateCache
from reference.errors import KVConformError
from reference.specs import AttentionSpec, MambaSpec, cdiv


class DataPlaneError(KVConformError):
    """A data-plane call names an unknown request or group, or shapes disagree."""


class DataPlane:
    """Paged caches and device block tables for every group of a manager's layout.

    The manager's tables are read through :func:`optimized.device.table_source.table_source`
    (``manager.layout`` names the groups)."""

    tables_cls = DeviceBlockTables

    def __init__(
        self,
        manager,
        *,
        num_kv_heads: int = 1,
        head_size: int = 8,
        state_size: int = 8,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        backend: str = "sdpa",
        kernels: str = "auto",
    ) -> None:
        """``kernels``: ``"torch"``, ``"nvrtc"`` (CUDA only: slot mapping and K/V writes by
        :mod:`optimized.device.nvrtc_kernels`) or ``"auto"`` (nvrtc on CUDA when cuda-python is
        installed, torch otherwise)."""
        self.manager = manager
        self.layout = manager.layout
        self.device = torch.device(device)
        self.backend = backend
        self.source = table_source(manager)
        self.caches: list[PagedKVCache | PagedStateCache] = []
        for g in self.layout.groups:
            if isinstance(g.spec, MambaSpec):
                cache = PagedStateCache(
                    self.layout.num_blocks, state_size, dtype=dtype, device=self.device
                )
            else:
                shape = CacheShape(
                    self.layout.num_blocks, g.spec.block_size, num_kv_heads, head_size
                )
                cache = PagedKVCache(shape, dtype=dtype, device=self.device)
            self.caches.append(cache)
        self.kernels = None
        if kernels not in ("torch", "nvrtc", "auto"):
            raise DataPlaneError(f"kernels must be 'torch', 'nvrtc' or 'auto', got {kernels!r}")
        if kernels != "torch" and self.device.type == "cuda" and dtype == torch.float32:
            from optimized.device.nvrtc_kernels import CudaKernels, NvrtcUnavailableError

            try:
                self.kernels = CudaKernels(self.device)
            except NvrtcUnavailableError:
                if kernels == "nvrtc":
                    raise
        elif kernels == "nvrtc":
            raise DataPlaneError("kernels='nvrtc' needs a float32 cache on a CUDA device")
        self.tables = self.tables_cls(self.source, self.device, self.kernels)

    def begin_step(self) -> int:
        """Upload the table entries the manager changed since the last step; how many."""
        return self.tables.sync()

    def _row(self, request_id: str) -> int:
        row = self.source.slot_of(request_id)
        if row is None:
            raise DataPlaneError(f"data plane: request {request_id!r} holds no row")
        return row

    def attention(
        self,
        gid: int,
        request_ids: Sequence[str],
        starts: Sequence[int],
        counts: Sequence[int],
        keys: torch.Tensor,
        values: torch.Tensor,
        queries: Sequence[torch.Tensor],
    ) -> list[torch.Tensor]:
        """Write the step's K/V of group ``gid`` through the device slot mapping, then attend.

        ``keys``/``values``: ``[tokens, heads, head_size]`` in request order;
        ``queries[i]``: ``[counts[i], heads, head_size]``. Returns one output per request.
        """
        spec = self.layout.groups[gid].spec
        cache = self.caches[gid]
        if not isinstance(spec, AttentionSpec) or not isinstance(cache, PagedKVCache):
            raise DataPlaneError(f"group {gid} is not an attention group")
        rows = [self._row(r) for r in request_ids]
        table = self.tables.tables[gid]
        if sum(counts):
            token_rows, positions = step_positions(rows, starts, counts, self.device)
            slots = self.slot_mapping(table, token_rows, positions, spec.block_size)
            if self.kernels is not None:
                cache.check_slots(slots)
                self.kernels.kv_write(
                    slots, keys.to(self.device), values.to(self.device), cache.key, cache.value
                )
            else:
                cache.write(slots, keys.to(self.device), values.to(self.device))
        flat = [q for q in queries if q.shape[0]]
        shape = (0, cache.shape.num_kv_heads, cache.shape.head_size)
        queries_t = torch.cat(flat) if flat else torch.zeros(shape, dtype=cache.key.dtype)
        out = table_attention(
            cache, spec, table, rows, starts, counts, queries_t, backend=self.backend
        )
        return list(torch.split(out, list(counts)))

    def slot_mapping(
        self, table: torch.Tensor, token_rows: torch.Tensor, positions: torch.Tensor, bs: int
    ) -> torch.Tensor:
        """The slot mapping (the NVRTC kernel on CUDA when loaded, torch otherwise)."""
        if self.kernels is not None:
            return self.kernels.slot_mapping(table, token_rows, positions, bs)
        return slot_mapping(table, token_rows, positions, bs)

    def _state_block(self, gid: int, request_id: str, num_tokens: int) -> int:
        spec = self.layout.groups[gid].spec
        if not isinstance(spec, MambaSpec):
            raise DataPlaneError(f"group {gid} is not a Mamba group")
        col = cdiv(num_tokens, spec.block_size) - 1
        table = self.tables.tables[gid]
        if col < 0 or col >= table.shape[1]:
            raise DataPlaneError(f"no state column for {num_tokens} tokens in group {gid}")
        return int(table[self._row(request_id), col])

    def read_state(self, gid: int, request_id: str, num_tokens: int) -> tuple[int, torch.Tensor]:
        """The state of ``tokens[0:num_tokens]``: its block id and the page's contents."""
        block = self._state_block(gid, request_id, num_tokens)
        cache = self.caches[gid]
        assert isinstance(cache, PagedStateCache)
        return block, cache.read(block)

    def write_state(self, gid: int, request_id: str, num_tokens: int, state: torch.Tensor) -> int:
        """Store the state of ``tokens[0:num_tokens]`` in its column's page; its block id."""
        block = self._state_block(gid, request_id, num_tokens)
        cache = self.caches[gid]
        assert isinstance(cache, PagedStateCache)
        cache.write(block, state)
        return block
