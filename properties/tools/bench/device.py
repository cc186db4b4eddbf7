"""Bench: the optimized engine's device data plane per decode step, and its attention
against SDPA and FlexAttention at the same shapes.

For each concurrency ``n`` (default 64, 256, 1024, 4096) the layout is the ``sweep-<n>x2k``
trace's (:func:`properties.tools.bench.engines.sweep_recipe`: gpt-oss, a sliding group
w = 128 and a full group, bs 16). Request ``i`` gets a prompt of ``context - i % bs`` tokens
(staggered, so that each step about ``n / bs`` requests open a block); all are allocated on
the optimized control plane and their pages filled with random K/V, then ``steps`` decode
steps run. Each step the control plane schedules one token per request (not timed); the
timed part is the data plane's: the upload of the changed table entries
(:meth:`optimized.device.data_plane.DataPlane.begin_step`), then per attention group the
slot mapping, the K/V write and the attention through the device table. The attention
columns time the full group's decode attention alone three ways at the same shapes: through
the device table (:func:`optimized.device.table_attention.table_attention`, SDPA inside),
SDPA over keys laid out densely ``[n, heads, longest + 1, head_size]``, and FlexAttention
over that dense layout (compiled on CUDA, eager on the CPU).

Figures are wall times with ``torch.cuda.synchronize`` around each timed region on CUDA;
the fastest of ``steps`` runs is kept for the attention rows. The CPU runs the same code
(small sizes: the caches of 4096 x 2k requests need about 20 GB at 1 head of 64). Example::

    print(format_device_bench(bench_device(DeviceBenchConfig(device="cuda"))))
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from optimized.control.kv_cache_manager import KVCacheManager, StepItem
from optimized.device.data_plane import DataPlane
from optimized.device.table_attention import table_attention
from paged.paged_cache import PagedKVCache
from properties.tools.bench.engines import BenchError, recipe_layout, sweep_recipe
from properties.tools.bench.table import aligned
from reference.specs import AttentionSpec, FullAttentionSpec

#: Concurrencies of the default sweep (those of ``kvconform bench engines``' sweep).
DEFAULT_SIZES = (64, 256, 1024, 4096)


@dataclass(frozen=True)
class DeviceBenchConfig:
    """What one ``bench_device`` run measures. Example: ``DeviceBenchConfig(sizes=(4,),
    context=64, steps=2)`` runs 4 requests of 64 tokens for 2 decode steps."""

    device: str = "cuda"
    sizes: tuple[int, ...] = DEFAULT_SIZES
    context: int = 2048
    steps: int = 8
    num_kv_heads: int = 1
    head_size: int = 64
    flex: bool = True

    def __post_init__(self) -> None:
        for name in ("context", "steps", "num_kv_heads", "head_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise BenchError(f"DeviceBenchConfig.{name} must be an integer >= 1, got {value!r}")
        if not self.sizes or any(not isinstance(n, int) or n < 1 for n in self.sizes):
            raise BenchError(f"DeviceBenchConfig.sizes must be integers >= 1, got {self.sizes!r}")


@dataclass(frozen=True)
class DeviceRow:
    """One concurrency: per-step data-plane time, entries uploaded per step, and the full
    group's decode attention through the table, by dense SDPA and by dense FlexAttention
    (``None`` where it could not run; ``note`` says why)."""

    requests: int
    context: int
    device: str
    step_ms: float
    upload_ms: float
    entries_per_step: float
    table_attn_ms: float
    sdpa_ms: float
    flex_ms: float | None
    note: str = ""

    @property
    def us_per_request_step(self) -> float:
        return 1000 * self.step_ms / self.requests


def _clock(device: torch.device) -> Callable[[], float]:
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def _fastest(fn: Callable[[], object], now: Callable[[], float], runs: int) -> float:
    fn()  # warm-up (first-call and compile costs)
    best = float("inf")
    for _ in range(runs):
        t0 = now()
        fn()
        best = min(best, now() - t0)
    return best


def _flex(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "cuda":
        return torch.compile(flex_attention)

    def eager(q, k, v):
        with warnings.catch_warnings():  # eager on the CPU is intended
            warnings.filterwarnings("ignore", message="flex_attention called without")
            return flex_attention(q, k, v)

    return eager


def bench_one(config: DeviceBenchConfig, num_requests: int) -> DeviceRow:
    """The row of ``num_requests`` (see the module docstring)."""
    device = torch.device(config.device)
    now = _clock(device)
    layout = recipe_layout(sweep_recipe(num_requests, config.context))
    manager = KVCacheManager(layout)
    heads, dim = config.num_kv_heads, config.head_size
    plane = DataPlane(manager, num_kv_heads=heads, head_size=dim, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    for cache in plane.caches:
        if isinstance(cache, PagedKVCache):
            cache.key.normal_(generator=gen)
            cache.value.normal_(generator=gen)
    bs = layout.groups[0].spec.block_size
    reqs = [  # staggered lengths: each step about 1 / bs of the requests open a new block
        manager.make_request(
            f"d{i}", [(7 * i + k) % 32_000 for k in range(config.context - i % bs)]
        )
        for i in range(num_requests)
    ]
    for r in reqs:
        if manager.allocate_slots(r, r.num_tokens) is None:
            raise BenchError(f"bench device: the pool cannot hold {num_requests} requests")
        r.num_computed_tokens = r.num_tokens
    plane.begin_step()
    groups = [g for g, grp in enumerate(layout.groups) if isinstance(grp.spec, AttentionSpec)]
    rids = [r.request_id for r in reqs]
    ones = [1] * num_requests
    kv = torch.randn(num_requests, heads, dim, generator=gen, device=device)
    queries = list(torch.randn(num_requests, 1, heads, dim, generator=gen, device=device))
    step_s = upload_s = 0.0
    entries = 0
    for step in range(config.steps + 1):  # step 0 warms up
        for r in reqs:
            r.append_output_token_ids([1])
        manager.schedule_step([StepItem(r, 1) for r in reqs])
        starts = [r.num_computed_tokens for r in reqs]
        t0 = now()
        moved = plane.begin_step()
        t1 = now()
        for gid in groups:
            plane.attention(gid, rids, starts, ones, kv, kv, queries)
        t2 = now()
        if step:
            step_s += t2 - t0
            upload_s += t1 - t0
            entries += moved
        for r in reqs:
            r.num_computed_tokens += 1
    # the full group's decode attention at the same shapes, three ways
    full = next(g for g in groups if isinstance(layout.groups[g].spec, FullAttentionSpec))
    cache = plane.caches[full]
    assert isinstance(cache, PagedKVCache)
    spec = layout.groups[full].spec
    slots = [plane.source.slot_of(rid) for rid in rids]
    starts = [r.num_computed_tokens for r in reqs]
    q_flat = torch.cat(queries)
    table = plane.tables.tables[full]
    table_s = _fastest(
        lambda: table_attention(cache, spec, table, slots, starts, ones, q_flat, backend="sdpa"),
        now,
        config.steps,
    )
    length = max(starts) + 1  # the longest request's keys, for every request
    q = q_flat.reshape(num_requests, 1, heads, dim).transpose(1, 2)
    k = torch.randn(num_requests, heads, length, dim, generator=gen, device=device)
    v = torch.randn(num_requests, heads, length, dim, generator=gen, device=device)
    sdpa_s = _fastest(lambda: F.scaled_dot_product_attention(q, k, v), now, config.steps)
    flex_s: float | None = None
    note = ""
    if config.flex:
        try:
            flex = _flex(device)
            flex_s = _fastest(lambda: flex(q, k, v), now, config.steps)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run is a note
            note = f"flex: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    return DeviceRow(
        requests=num_requests,
        context=config.context,
        device=str(device),
        step_ms=1000 * step_s / config.steps,
        upload_ms=1000 * upload_s / config.steps,
        entries_per_step=entries / config.steps,
        table_attn_ms=1000 * table_s,
        sdpa_ms=1000 * sdpa_s,
        flex_ms=None if flex_s is None else 1000 * flex_s,
        note=note,
    )


def bench_device(
    config: DeviceBenchConfig, on_row: Callable[[DeviceRow], None] | None = None
) -> list[DeviceRow]:
    """One :class:`DeviceRow` per size of ``config.sizes``, in order."""
    rows = []
    for n in config.sizes:
        rows.append(bench_one(config, n))
        if on_row is not None:
            on_row(rows[-1])
    return rows


def cuda_missing(device: str) -> str | None:
    """Why ``device`` cannot run here (a CUDA device without CUDA), else ``None``."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        return f"bench device: no CUDA device here, skipped (--device {device})"
    return None


def format_device_bench(rows: Sequence[DeviceRow]) -> str:
    """An aligned table, one line per concurrency."""
    header = (
        "requests",
        "context",
        "device",
        "step ms",
        "us/req-step",
        "upload ms",
        "entries/step",
        "table attn ms",
        "sdpa ms",
        "flex ms",
        "note",
    )
    table = [header]
    for r in rows:
        table.append(
            (
                str(r.requests),
                str(r.context),
                r.device,
                f"{r.step_ms:.3f}",
                f"{r.us_per_request_step:.2f}",
                f"{r.upload_ms:.3f}",
                f"{r.entries_per_step:.1f}",
                f"{r.table_attn_ms:.3f}",
                f"{r.sdpa_ms:.3f}",
                "-" if r.flex_ms is None else f"{r.flex_ms:.3f}",
                r.note,
            )
        )
    return aligned(table, left={2, len(header) - 1})


def run_device_bench(
    device: str, sizes: Sequence[int] | None, context: int, threads: int | None = None
) -> int:
    """``kvconform bench device``: print the table (or why CUDA is missing); exit code 0."""
    missing = cuda_missing(device)
    if missing:
        print(missing)
        return 0
    if threads is not None:
        torch.set_num_threads(threads)
    config = DeviceBenchConfig(
        device=device, sizes=tuple(sizes) if sizes else DEFAULT_SIZES, context=context
    )
    print(format_device_bench(bench_device(config)))
    return 0
