"""The CUDA data plane (device tables, NVRTC or torch kernels, paged attention) against
the CPU one on the same scenario (skips without a CUDA device)."""

from __future__ import annotations

import pytest
import torch

from tests.optimized.test_data_plane import run_scenario

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_cuda_data_plane_matches_cpu(backend: str) -> None:
    cpu = run_scenario("cpu", backend)
    cuda = run_scenario("cuda", backend)
    assert len(cpu) == len(cuda)
    for a, b in zip(cpu, cuda):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
