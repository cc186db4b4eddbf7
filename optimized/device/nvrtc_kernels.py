"""CUDA kernels of the data plane, compiled at run time with NVRTC (``cuda-python``).

Three kernels, each the rule of its torch twin:

* ``slot_mapping``: ``slots[i] = table[rows[i], pos[i] / bs] * bs + pos[i] % bs``
  (:func:`optimized.device.slot_mapping.slot_mapping`); one thread per token. ``table`` may
  be a group's view of the 3-D device table (row stride given, columns contiguous).
* ``table_update``: ``table[s, g, c] = b`` for each packed ``(s, g, c, b)`` entry of a sync
  (:meth:`optimized.device.device_tables.DeviceBlockTables.sync`); one thread per entry.
* ``kv_write``: ``key_cache[slots[i], e] = key[i, e]`` and the same for values, slots
  ``-1`` skipped (:meth:`paged.paged_cache.PagedKVCache.write`, without its checks,
  which the caller runs first); one thread per (token, element).

:func:`compile_ptx` needs only the NVRTC library (no GPU: CPU CI compiles the kernels);
:class:`CudaKernels` loads the PTX with the CUDA driver and launches on torch's current
stream. The ``gpu`` extra installs ``cuda-python`` (its NVRTC wheel comes with it:
``nvidia-cuda-nvrtc-cu12``). Example: bs 4, row ``[7, 2]``, positions 3 and 5 ->
``slot_mapping`` writes 31 and 9.
"""

from __future__ import annotations

import ctypes

import torch

from reference.errors import KVConformError

KERNEL_NAMES = ("slot_mapping", "kv_write", "table_update")

KERNEL_SOURCE = r"""
extern "C" __global__ void slot_mapping(
    const int* __restrict__ table, long long table_stride,
    const long long* __restrict__ rows, const long long* __restrict__ positions,
    long long* __restrict__ slots, int num_tokens, int block_size)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= num_tokens) return;
    long long pos = positions[i];
    long long block = table[rows[i] * table_stride + pos / block_size];
    slots[i] = block * block_size + pos % block_size;
}

extern "C" __global__ void table_update(
    int* __restrict__ table, long long slot_stride, long long group_stride,
    const long long* __restrict__ packed, int num_entries)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= num_entries) return;
    long long slot = packed[i];
    long long group = packed[num_entries + i];
    long long col = packed[2 * num_entries + i];
    table[slot * slot_stride + group * group_stride + col] = (int)packed[3 * num_entries + i];
}

extern "C" __global__ void kv_write(
    const long long* __restrict__ slots,
    const float* __restrict__ key, const float* __restrict__ value,
    float* __restrict__ key_cache, float* __restrict__ value_cache,
    int num_tokens, int width)
{
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)num_tokens * width) return;
    int token = (int)(idx / width);
    int elem = (int)(idx % width);
    long long slot = slots[token];
    if (slot < 0) return;
    key_cache[slot * width + elem] = key[idx];
    value_cache[slot * width + elem] = value[idx];
}
"""

THREADS = 256


class NvrtcUnavailableError(KVConformError):
    """cuda-python or the NVRTC library is missing (install the ``gpu`` extra)."""


def _check(result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise KVConformError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def compile_ptx(arch: str = "compute_80") -> bytes:
    """PTX of :data:`KERNEL_SOURCE` for ``arch`` (no GPU needed)."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise NvrtcUnavailableError(
            f"cuda-python is not installed ({exc}); install the 'gpu' extra"
        ) from exc
    try:
        prog = _check(
            nvrtc.nvrtcCreateProgram(KERNEL_SOURCE.encode(), b"kvconform.cu", 0, [], []),
            "nvrtcCreateProgram",
        )
    except KVConformError:
        raise
    except Exception as exc:  # noqa: BLE001 - the pathfinder raises its own types
        raise NvrtcUnavailableError(f"the NVRTC library cannot be loaded: {exc}") from exc
    options = [f"--gpu-architecture={arch}".encode(), b"--std=c++14"]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
    if int(err) != 0:
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise KVConformError(f"NVRTC could not compile the kernels: {log.decode(errors='replace')}")
    size = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
    ptx = b" " * size
    _check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
    return ptx


def device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"compute_{major}{minor}"


class CudaKernels:
    """The compiled kernels on one CUDA device (torch's current context and stream)."""

    def __init__(self, device: torch.device) -> None:
        from cuda.bindings import driver

        self.driver = driver
        self.device = device
        torch.cuda.init()
        _check(driver.cuInit(0), "cuInit")
        ptx = compile_ptx(device_arch(device))
        self.module = _check(driver.cuModuleLoadData(ptx), "cuModuleLoadData")
        self.functions = {
            name: _check(driver.cuModuleGetFunction(self.module, name.encode()), name)
            for name in KERNEL_NAMES
        }

    def _launch(self, name: str, num_threads: int, values: tuple, types: tuple) -> None:
        if num_threads == 0:
            return
        grid = (num_threads + THREADS - 1) // THREADS
        stream = torch.cuda.current_stream(self.device).cuda_stream
        _check(
            self.driver.cuLaunchKernel(
                self.functions[name], grid, 1, 1, THREADS, 1, 1, 0, stream, (values, types), 0
            ),
            f"cuLaunchKernel({name})",
        )

    def slot_mapping(
        self, table: torch.Tensor, token_rows: torch.Tensor, positions: torch.Tensor, bs: int
    ) -> torch.Tensor:
        if table.stride(1) != 1:
            table = table.contiguous()
        rows = token_rows.to(torch.int64).contiguous()
        pos = positions.to(torch.int64).contiguous()
        slots = torch.empty_like(pos)
        n = pos.numel()
        self._launch(
            "slot_mapping",
            n,
            (
                table.data_ptr(),
                table.stride(0),
                rows.data_ptr(),
                pos.data_ptr(),
                slots.data_ptr(),
                n,
                bs,
            ),
            (
                ctypes.c_void_p,
                ctypes.c_longlong,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_int,
            ),
        )
        return slots

    def table_update(self, table: torch.Tensor, packed: torch.Tensor) -> None:
        """``table[s, g, c] = b`` for each column ``(s, g, c, b)`` of ``packed``
        (int64 ``[4, n]``); ``table`` is the contiguous int32 3-D device table."""
        if table.dtype != torch.int32 or table.stride(2) != 1:
            raise KVConformError("table_update needs an int32 table with contiguous columns")
        packed = packed.to(device=table.device, dtype=torch.int64).contiguous()
        n = packed.shape[1]
        self._launch(
            "table_update",
            n,
            (table.data_ptr(), table.stride(0), table.stride(1), packed.data_ptr(), n),
            (ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int),
        )

    def kv_write(
        self,
        slots: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> None:
        """float32 caches only (the data plane falls back to torch for other dtypes)."""
        n = slots.numel()
        width = key[0].numel() if n else 0
        slots = slots.to(torch.int64).contiguous()
        key = key.to(key_cache.dtype).contiguous()
        value = value.to(value_cache.dtype).contiguous()
        self._launch(
            "kv_write",
            n * width,
            (
                slots.data_ptr(),
                key.data_ptr(),
                value.data_ptr(),
                key_cache.data_ptr(),
                value_cache.data_ptr(),
                n,
                width,
            ),
            (
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_int,
            ),
        )
