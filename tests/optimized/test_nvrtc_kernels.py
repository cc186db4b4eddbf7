"""The NVRTC kernels: compiled on any machine with cuda-python (no GPU needed), and on
CUDA compared with their torch twins (slot mapping, K/V write, table update)."""

from __future__ import annotations

import pytest
import torch

from optimized.device.nvrtc_kernels import KERNEL_NAMES, NvrtcUnavailableError, compile_ptx
from optimized.device.slot_mapping import slot_mapping, step_positions
from paged.paged_cache import CacheShape, PagedKVCache


def _ptx_or_skip() -> bytes:
    try:
        return compile_ptx("compute_80")
    except NvrtcUnavailableError as exc:
        pytest.skip(f"NVRTC unavailable: {exc}")


def test_kernels_compile_to_ptx() -> None:
    ptx = _ptx_or_skip().decode()
    assert ".target sm_80" in ptx
    for name in KERNEL_NAMES:
        assert f".entry {name}(" in ptx


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernels_match_torch() -> None:
    from optimized.device.nvrtc_kernels import CudaKernels

    _ptx_or_skip()
    device = torch.device("cuda")
    kernels = CudaKernels(device)
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(1, 64, (8, 16), generator=gen, dtype=torch.int32).to(device)
    rows, positions = step_positions([0, 3, 7, 5], [0, 17, 40, 63], [5, 9, 1, 1], device)
    got = kernels.slot_mapping(table, rows, positions, 4)
    want = slot_mapping(table, rows, positions, 4)
    assert torch.equal(got, want)
    # K/V write: the same pages as PagedKVCache.write, padding skipped
    shape = CacheShape(num_blocks=64, block_size=4, num_kv_heads=2, head_size=8)
    torch_cache = PagedKVCache(shape, device=device)
    nvrtc_cache = PagedKVCache(shape, device=device)
    slots = torch.randperm(60 * 4, generator=gen)[:16].to(device) + 4
    slots[3] = -1
    key = torch.randn(16, 2, 8, generator=gen).to(device)
    value = torch.randn(16, 2, 8, generator=gen).to(device)
    torch_cache.write(slots, key, value)
    kernels.kv_write(slots, key, value, nvrtc_cache.key, nvrtc_cache.value)
    torch.cuda.synchronize()
    assert torch.equal(torch_cache.key.nan_to_num(7.0), nvrtc_cache.key.nan_to_num(7.0))
    assert torch.equal(torch_cache.value.nan_to_num(7.0), nvrtc_cache.value.nan_to_num(7.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_table_update_and_view_slot_mapping() -> None:
    from optimized.device.nvrtc_kernels import CudaKernels

    _ptx_or_skip()
    device = torch.device("cuda")
    kernels = CudaKernels(device)
    table = torch.zeros((4, 2, 5), dtype=torch.int32, device=device)
    # (slot, group, column, block): slot 3 group 1 gets blocks 8, 9; slot 0 group 0 block 4
    packed = torch.tensor([[3, 3, 0], [1, 1, 0], [0, 1, 2], [8, 9, 4]], device=device)
    kernels.table_update(table, packed)
    torch.cuda.synchronize()
    want = torch.zeros((4, 2, 5), dtype=torch.int32)
    want[3, 1, :2] = torch.tensor([8, 9], dtype=torch.int32)
    want[0, 0, 2] = 4
    assert torch.equal(table.cpu(), want)
    # the slot mapping reads a group's strided view of the 3-D table: bs 4, slot 3 of
    # group 1, positions 1 and 6 -> 8 * 4 + 1 = 33 and 9 * 4 + 2 = 38
    view = table[:, 1, :]
    rows = torch.tensor([3, 3], device=device)
    positions = torch.tensor([1, 6], device=device)
    assert kernels.slot_mapping(view, rows, positions, 4).tolist() == [33, 38]
