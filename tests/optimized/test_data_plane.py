"""The optimized data plane: device slot mapping against the reference rule, delta uploads
of changed rows only, and attention run end to end through the engine's own device tables,
slot mapping and paged caches, compared with the dense float64 reference."""

from __future__ import annotations

import random

import numpy as np
import torch

from optimized.control.kv_cache_manager import KVCacheManager, StepItem
from optimized.device.data_plane import DataPlane
from optimized.device.slot_mapping import slot_mapping, step_positions
from reference.attention import dense_attention
from reference.block_table import BlockTable
from reference.content import ContentModel
from reference.layout import KVCacheGroup, KVCacheLayout
from reference.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def test_slot_mapping_matches_reference_rule() -> None:
    rng = random.Random(3)
    bs = 4
    rows = [[rng.randrange(1, 50) for _ in range(6)] for _ in range(5)]
    table = torch.tensor(rows, dtype=torch.int32)
    ref = BlockTable(bs)
    for i, r in enumerate(rows):
        ref.add_row(f"r{i}", r)
    token_rows, positions = step_positions([0, 3, 4], [5, 0, 22], [3, 2, 1], torch.device("cpu"))
    assert token_rows.tolist() == [0, 0, 0, 3, 3, 4]
    assert positions.tolist() == [5, 6, 7, 0, 1, 22]
    got = slot_mapping(table, token_rows, positions, bs).tolist()
    want = [ref.slot(f"r{r}", p) for r, p in zip(token_rows.tolist(), positions.tolist())]
    assert got == want
    # worked example of the module docstring: row [7, 2], bs 4, positions 3 and 5
    example = slot_mapping(torch.tensor([[7, 2]]), torch.tensor([0, 0]), torch.tensor([3, 5]), 4)
    assert example.tolist() == [31, 9]


def _layout() -> KVCacheLayout:
    groups = (
        KVCacheGroup(("f",), FullAttentionSpec(block_size=4)),
        KVCacheGroup(("s",), SlidingWindowSpec(block_size=4, sliding_window=6)),
        KVCacheGroup(("c",), ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8)),
        KVCacheGroup(("m",), MambaSpec(block_size=4)),
    )
    return KVCacheLayout(groups, num_blocks=400, max_model_len=64)


def test_delta_upload_moves_only_changed_entries() -> None:
    manager = KVCacheManager(_layout(), max_num_reqs=4)
    plane = DataPlane(manager)
    reqs = [manager.make_request(f"r{i}", list(range(i, i + 5 + i))) for i in range(6)]
    for r in reqs:
        assert manager.allocate_slots(r, r.num_tokens) is not None
        r.num_computed_tokens = r.num_tokens
    plane.begin_step()  # six rows in every group (the tables grew from 4 to 8 rows)
    for gid, m in enumerate(manager.coordinator.managers):
        assert np.array_equal(plane.tables.tables[gid].numpy(), m.table)
    # a decode step where only some requests cross a block boundary
    before = [m.table.copy() for m in manager.coordinator.managers]
    for r in reqs:
        r.append_output_token_ids([7])
    manager.schedule_step([StepItem(r, 1) for r in reqs])
    changed = {
        gid: set(np.flatnonzero(m.dirty_rows).tolist())
        for gid, m in enumerate(manager.coordinator.managers)
    }
    crossing = {
        manager.coordinator.row_of[r.request_id] for r in reqs if (r.num_tokens - 1) % 4 == 0
    }
    assert changed[0] == crossing  # full attention changes only on a new block
    moved = plane.begin_step()  # entries, not rows: only what differs from the last sync
    assert moved == sum(
        int(np.count_nonzero(m.table != b)) for m, b in zip(manager.coordinator.managers, before)
    )
    assert 0 < moved < 6 * 4
    for gid, m in enumerate(manager.coordinator.managers):
        assert np.array_equal(plane.tables.tables[gid].numpy(), m.table)
        assert not m.dirty_rows.any()


def run_scenario(device: str = "cpu", backend: str = "sdpa") -> list[torch.Tensor]:
    """Chunked prefill, prefix hits and decode on a 4-group hybrid through the data plane
    on ``device``; asserts every query of every attention group and every Mamba state read
    equals the dense reference, and returns every output (on the CPU) in order."""
    layout = _layout()
    manager = KVCacheManager(layout, max_num_reqs=2)
    plane = DataPlane(manager, backend=backend, device=device)
    observed: list[torch.Tensor] = []
    content = ContentModel(seed=1)
    rng = random.Random(5)
    shared = [rng.randrange(20) for _ in range(13)]
    prompts = {f"r{i}": shared + [rng.randrange(20) for _ in range(3 + i)] for i in range(4)}
    reqs = {rid: manager.make_request(rid, p) for rid, p in prompts.items()}
    waiting = list(reqs)
    running: list[str] = []
    checked = refused = hits = 0
    for _step in range(14):
        manager.new_step_starts()
        chunks = []  # (rid, start, count)
        for rid in running:
            r = reqs[rid]
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token_ids([rng.randrange(20)])
            # Mamba align mode: a chunk ends on a block boundary unless the tokens run out
            new = min(r.num_tokens - r.num_computed_tokens, 4 - r.num_computed_tokens % 4)
            assert manager.allocate_slots(r, new) is not None
            chunks.append((rid, r.num_computed_tokens, new))
        if waiting:
            rid = waiting.pop(0)
            r = reqs[rid]
            hit, n_hit = manager.get_computed_blocks(r)
            new = min(r.num_tokens - n_hit, 8 - n_hit % 4)
            if manager.allocate_slots(r, new, n_hit, hit if n_hit else None) is None:
                waiting.insert(0, rid)  # a Mamba state cached this step: retry next step
                refused += 1
            else:
                chunks.append((rid, n_hit, new))
                running.append(rid)
                hits += n_hit
        plane.begin_step()
        hashes = {rid: content.prefix_hashes(reqs[rid].all_token_ids) for rid, _, _ in chunks}
        for gid, group in enumerate(layout.groups):
            if isinstance(group.spec, MambaSpec):
                for rid, start, _count in chunks:
                    if start > 0 and start % 4 == 0:
                        _, got = plane.read_state(gid, rid, start)
                        got = got.cpu()
                        want = torch.tensor(content.state(hashes[rid], start, gid))
                        assert torch.allclose(got.double(), want.double(), atol=1e-6)
                        observed.append(got)
                        checked += 1
                for rid, start, count in chunks:
                    state = torch.tensor(content.state(hashes[rid], start + count, gid))
                    plane.write_state(gid, rid, start + count, state)
                continue
            keys, values, queries = [], [], []
            for rid, start, count in chunks:
                pos = range(start, start + count)
                keys += [content.key(hashes[rid], p, gid) for p in pos]
                values += [content.value(hashes[rid], p, gid) for p in pos]
                queries.append(torch.tensor([content.query(hashes[rid], p, gid) for p in pos]))
            outs = plane.attention(
                gid,
                [c[0] for c in chunks],
                [c[1] for c in chunks],
                [c[2] for c in chunks],
                torch.tensor(keys),
                torch.tensor(values),
                queries,
            )
            for (rid, start, count), out in zip(chunks, outs):
                want = torch.tensor(
                    dense_attention(
                        content, group.spec, hashes[rid], range(start, start + count), gid
                    ),
                    dtype=torch.float64,
                )
                out = out.cpu()
                assert torch.allclose(out.double(), want, atol=1e-5, rtol=1e-5), (rid, gid)
                observed.append(out)
                checked += count
        for rid, start, count in chunks:
            reqs[rid].num_computed_tokens = start + count
    assert checked > 100 and hits > 0, (checked, hits, refused)
    return observed


def test_attention_end_to_end_through_device_tables() -> None:
    assert len(run_scenario("cpu", "sdpa")) > 20
