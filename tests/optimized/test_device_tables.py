"""Device block tables: a sync uploads exactly the entries that changed (counted by hand on a
numpy source), and after whole scheduler traces on the optimized control plane the device
table equals the host tables at every step."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from optimized.device.device_tables import DeviceBlockTables
from optimized.device.table_source import BlockTableSource, ManagerTables, table_source
from properties.core.trace import Step
from properties.engines.optimized import make_engine
from properties.runner.scheduler import Scheduler
from properties.tools.bench.engines import DECODE_HEAVY, PREFIX_HEAVY, build_trace


class ArraySource:
    """A control plane reduced to its tables: group g's table is ``tables[g]``."""

    def __init__(self, num_slots: int, widths: tuple[int, ...]) -> None:
        self.tables = [np.zeros((num_slots, w), np.int32) for w in widths]
        self.masks = [np.zeros(num_slots, bool) for _ in widths]
        self.slots: dict[str, int] = {}

    def group_tables(self) -> list[np.ndarray]:
        return self.tables

    def dirty_masks(self) -> list[np.ndarray]:
        return self.masks

    def slot_of(self, request_id: str) -> int | None:
        return self.slots.get(request_id)

    def write(self, gid: int, slot: int, col: int, block: int) -> None:
        self.tables[gid][slot, col] = block
        self.masks[gid][slot] = True

    def grow(self, num_slots: int) -> None:
        for g, t in enumerate(self.tables):
            grown = np.zeros((num_slots, t.shape[1]), np.int32)
            grown[: t.shape[0]] = t
            self.tables[g] = grown
            mask = np.zeros(num_slots, bool)
            mask[: self.masks[g].size] = self.masks[g]
            self.masks[g] = mask


def entries(tables: DeviceBlockTables) -> set[tuple[int, int, int, int]]:
    u = tables.last_upload
    return set(zip(u.slots.tolist(), u.groups.tolist(), u.cols.tolist(), u.blocks.tolist()))


def assert_mirrors(tables: DeviceBlockTables, source: BlockTableSource) -> None:
    for gid, host in enumerate(source.group_tables()):
        assert np.array_equal(tables.tables[gid].cpu().numpy(), host), f"group {gid}"


def test_sync_uploads_only_changed_entries() -> None:
    src = ArraySource(4, (3, 2))
    src.tables[0][0, :2] = [5, 6]  # written before the data plane existed: no marks
    src.tables[0][2, 0] = 7
    src.tables[1][0, 0] = 8
    tables = DeviceBlockTables(src)
    # the first sync compares all 4 rows of both groups and moves the 4 non-null entries
    assert tables.rows_compared == 8
    assert entries(tables) == {(0, 0, 0, 5), (0, 0, 1, 6), (2, 0, 0, 7), (0, 1, 0, 8)}
    assert tuple(tables.device_table.shape) == (4, 2, 3)
    assert_mirrors(tables, src)
    # a decode step: slot 0 appends block 9 in group 0; group 1 nulls its head and appends 11;
    # slot 3 is marked but unchanged (compared, nothing moves)
    src.write(0, 0, 2, 9)
    src.write(1, 0, 0, 0)
    src.write(1, 0, 1, 11)
    src.masks[0][3] = True
    assert tables.sync() == 3
    assert entries(tables) == {(0, 0, 2, 9), (0, 1, 0, 0), (0, 1, 1, 11)}
    assert tables.rows_compared == 8 + 3
    assert not any(m.any() for m in src.masks)
    assert_mirrors(tables, src)
    # nothing marked: nothing compared, nothing moves
    assert tables.sync() == 0 and tables.rows_compared == 11
    # the marks are the contract: an unmarked write stays on the host until marked
    src.tables[0][2, 1] = 4
    assert tables.sync() == 0
    assert int(tables.tables[0][2, 1]) == 0
    src.masks[0][2] = True
    assert tables.sync() == 1 and entries(tables) == {(2, 0, 1, 4)}
    # the control plane grows to 6 slots; slot 5 is filled without a mark: grown rows are
    # compared whatever their marks
    src.grow(6)
    src.tables[1][5, :2] = [12, 13]
    assert tables.sync() == 2
    assert entries(tables) == {(5, 1, 0, 12), (5, 1, 1, 13)}
    assert tables.num_slots == 6
    # slot 0 is released (its row nulled) and recycled by a new request with block 14
    for gid, width in enumerate((3, 2)):
        src.tables[gid][0, :width] = 0
        src.masks[gid][0] = True
    src.write(0, 0, 0, 14)
    assert tables.sync() == 4  # group 0: 5 -> 14, 6 -> 0, 9 -> 0; group 1: 11 -> 0
    assert entries(tables) == {(0, 0, 0, 14), (0, 0, 1, 0), (0, 0, 2, 0), (0, 1, 1, 0)}
    assert tables.entries_uploaded == 4 + 3 + 1 + 2 + 4
    assert_mirrors(tables, src)


def test_group_views_share_the_device_table() -> None:
    src = ArraySource(2, (3, 1))
    src.tables[1][1, 0] = 6
    tables = DeviceBlockTables(src)
    full, sliding = tables.tables
    assert tuple(full.shape) == (2, 3) and tuple(sliding.shape) == (2, 1)
    assert sliding.data_ptr() == tables.device_table[:, 1].data_ptr()
    assert int(sliding[1, 0]) == 6


def test_table_source_of_the_optimized_manager() -> None:
    engine = make_engine(_small_trace(DECODE_HEAVY, 0).layout)
    source = table_source(engine.manager)
    assert isinstance(source, ManagerTables)
    assert isinstance(source, BlockTableSource)
    src = ArraySource(1, (1,))
    assert table_source(src) is src


def _small_trace(recipe, seed: int):
    # scale 32: 8 requests; concurrency 2 keeps the pool tight (preemptions, recycled slots)
    return build_trace(replace(recipe.scaled(32), seed=seed, concurrency=2))


@pytest.mark.parametrize(
    ("recipe", "seed"), [(DECODE_HEAVY, 0), (DECODE_HEAVY, 7), (PREFIX_HEAVY, 0), (PREFIX_HEAVY, 5)]
)
def test_device_table_mirrors_the_control_plane_over_traces(recipe, seed: int) -> None:
    trace = _small_trace(recipe, seed)
    engine = make_engine(trace.layout)
    scheduler = Scheduler(engine, trace.layout)
    source = table_source(engine.manager)
    tables = DeviceBlockTables(source, torch.device("cpu"))
    before = [t.copy() for t in source.group_tables()]
    preempted = moved = steps = 0
    for op in trace.operations:
        record = scheduler.apply(op)
        if not isinstance(op, Step):
            continue
        steps += 1
        preempted += len(record.preempted) if record is not None else 0
        now = source.group_tables()
        changed = 0
        for b, t in zip(before, now):
            b_rows = np.zeros_like(t)
            b_rows[: b.shape[0]] = b
            changed += int(np.count_nonzero(t != b_rows))
        assert tables.sync() == changed  # exactly the entries that differ, no more
        moved += changed
        assert_mirrors(tables, source)
        before = [t.copy() for t in now]
    slots = source.group_tables()[0].shape[0]
    width = max(t.shape[1] for t in source.group_tables())
    # far less than re-uploading every table at every step
    assert 0 < moved < steps * slots * width * len(before) // 4, (moved, steps)
    assert steps > 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernels", ["torch", "nvrtc"])
def test_cuda_device_table_mirrors_the_control_plane(kernels: str) -> None:
    device = torch.device("cuda")
    loaded = None
    if kernels == "nvrtc":
        from optimized.device.nvrtc_kernels import CudaKernels, NvrtcUnavailableError

        try:
            loaded = CudaKernels(device)
        except NvrtcUnavailableError as exc:
            pytest.skip(f"NVRTC unavailable: {exc}")
    trace = _small_trace(PREFIX_HEAVY, 5)
    engine = make_engine(trace.layout)
    scheduler = Scheduler(engine, trace.layout)
    source = table_source(engine.manager)
    tables = DeviceBlockTables(source, device, loaded)
    for op in trace.operations:
        scheduler.apply(op)
        if isinstance(op, Step):
            tables.sync()
            assert_mirrors(tables, source)
