"""ROCm (AMD GPUs): what would run there, skipped without one.

On a ROCm build of torch, ``torch.cuda`` is the AMD GPU and the "nccl" backend is RCCL, so
tests/test_cuda.py runs there as it is (kernels against the torch path, bitwise; the chain
against the float64 reference; RCCL at world size 1). This file adds what is AMD's own: the
kernels run with wavefronts of 64 and the GPU's gfx target is one the compile check covers.
No AMD GPU has run them yet (README, "What is supported").
"""

from __future__ import annotations

import pytest
import torch

ROCM = torch.version.hip is not None and torch.cuda.is_available()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not ROCM, reason="needs a ROCm build and an AMD GPU")]


def test_the_gpu_is_a_target_of_the_compile_check():
    arch = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    assert arch in ("gfx942", "gfx90a"), f"{arch}: add it to scripts/compile_check.py's --archs and rerun"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_the_torch_path_on_an_amd_gpu(dtype):
    from helpers import simulate_allreduce

    from onebit.kernels import padded_numel

    W, n = 4, 100_003
    N = padded_numel(n, W)
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(n, generator=g, device="cuda").to(dtype) for _ in range(W)]
    we = [torch.randn(N, generator=g, device="cuda") * 0.1 for _ in range(W)]
    se = [torch.randn(N // W, generator=g, device="cuda") * 0.1 for _ in range(W)]
    errors = {k: ([e.clone() for e in we], [e.clone() for e in se]) for k in ("triton", "torch")}
    got = {k: simulate_allreduce(xs, *errors[k], backend=k) for k in ("triton", "torch")}
    # contraction is off (triton_kernels.FP_FUSION): outputs and both errors bitwise the torch path's
    for a, b in zip(got["triton"], got["torch"], strict=True):
        assert torch.equal(a, b)
    for mine, theirs in zip(errors["triton"], errors["torch"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
